"""Format conversion between TouchDesigner, ComfyUI and the engine's uint8 RGB top-down frames."""

from __future__ import annotations

import numpy as np
import pytest

from loom_live.host_bridge.wire import pixels as formats
from loom_live.plugin.comfyui import pixels as comfy_pixels


def _rgb(h: int = 5, w: int = 7) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)


def test_touchdesigner_uint8_is_bgra_bottom_up():
    rgb = _rgb()
    td = formats.to_touchdesigner(rgb, np.uint8, 4)
    assert td.shape == (5, 7, 4) and td.dtype == np.uint8
    assert np.array_equal(td[-1, 0, :3], rgb[0, 0, ::-1])  # top-left pixel is in the last row, BGR order
    assert np.all(td[..., 3] == 255)
    assert np.array_equal(formats.from_touchdesigner(td), rgb)


@pytest.mark.parametrize("dtype", [np.uint16, np.float32])
def test_touchdesigner_other_dtypes_are_rgba_and_round_trip_exactly(dtype):
    rgb = _rgb()
    td = formats.to_touchdesigner(rgb, dtype, 4)
    assert td.dtype == dtype
    assert np.array_equal(formats.to_uint8(td[-1, 0, :3]), rgb[0, 0])  # RGBA, bottom-up
    assert np.array_equal(formats.from_touchdesigner(td), rgb)


@pytest.mark.parametrize("opencv", [True, False], ids=["opencv", "numpy"])
def test_value_mapping_rounds_and_clips(opencv, monkeypatch):
    if not opencv:
        monkeypatch.setattr(formats, "_opencv", lambda: None)
    assert formats.to_uint8(np.array([0, 257, 65535, 32896], np.uint16)).tolist() == [0, 1, 255, 128]
    assert formats.to_uint8(np.array([-0.5, 0.0, 0.5, 1.0, 7.0], np.float32)).tolist() == [0, 0, 128, 255, 255]
    ties = np.array([0.5, 1.5, 2.5, 253.5, 254.5], np.float32) / np.float32(255)  # halfway after the scale
    assert formats.to_uint8(ties).tolist() == np.rint(ties * np.float32(255)).astype(np.uint8).tolist()
    batch = np.random.default_rng(3).uniform(-1, 2, (2, 3, 4, 3)).astype(np.float32)  # ComfyUI's [B, H, W, 3]
    assert np.array_equal(formats.to_uint8(batch), np.rint(np.clip(batch, 0, 1) * np.float32(255)).astype(np.uint8))


def test_comfyui_images_round_trip():
    batch = np.stack([_rgb(), _rgb()[::-1]])
    images = comfy_pixels.to_comfy(batch)
    assert images.dtype == np.float32 and images.shape == (2, 5, 7, 3) and images.max() <= 1.0
    assert np.array_equal(comfy_pixels.from_comfy(images), batch)


def test_to_engine_accepts_grey_rgba_and_copies():
    rgba = np.dstack([_rgb(), np.zeros((5, 7, 1), np.uint8)])
    out = formats.to_engine(rgba)
    assert out.shape == (5, 7, 3) and out.flags.c_contiguous and np.array_equal(out, rgba[..., :3])
    rgb = _rgb()
    assert formats.to_engine(rgb) is not rgb
    grey = formats.to_engine(rgb[..., 0])
    assert np.array_equal(grey[..., 2], rgb[..., 0])


def test_bad_frames_say_what_is_allowed():
    with pytest.raises(ValueError, match="dtype int32 is not allowed; expected uint8, uint16 or float32$"):
        formats.to_engine(np.zeros((4, 4, 3), np.int32))
    swapped = np.zeros((4, 4, 3), np.dtype(np.uint16).newbyteorder())  # a big-endian file's uint16 on this machine
    with pytest.raises(ValueError, match=r"uint16 or float32 in this machine's byte order \(this one is byte-swapped"):
        formats.to_engine(swapped)
    assert formats.to_engine(swapped.astype(swapped.dtype.newbyteorder("="))).dtype == np.uint8
    with pytest.raises(ValueError, match=r"shape \(4, 4, 5\)"):
        formats.to_engine(np.zeros((4, 4, 5), np.uint8))
    with pytest.raises(ValueError, match="ComfyUI IMAGE"):
        comfy_pixels.from_comfy(np.zeros((4, 4, 3), np.float32))


def test_comfyui_images_without_pixels_or_of_integers_are_refused_naming_what_is_allowed():
    """A crop to nothing reached the bridge as an unnamed frame; integer values became black and white."""
    with pytest.raises(ValueError, match=r"ComfyUI IMAGE: shape \(2, 0, 8, 3\) is not allowed; expected \[B, H, W, 3\] "
                                         "with H and W at least 1"):
        comfy_pixels.from_comfy(np.zeros((2, 0, 8, 3), np.float32))
    with pytest.raises(ValueError, match="ComfyUI IMAGE: dtype uint8 is not allowed; expected float values in 0..1"):
        comfy_pixels.from_comfy(np.full((1, 4, 4, 3), 128, np.uint8))


@pytest.mark.parametrize("dtype, order, bottom_up", [("uint8", "BGRA", True), ("uint16", "RGBA", True),
                                                      ("float32", "RGBA", False), ("uint8", "RGB", False)])
def test_gpu_conversions_follow_the_numpy_rules_exactly(dtype, order, bottom_up):
    import torch

    from loom_live.engine.server import device_frames as server_gpu

    rng = np.random.default_rng(1)
    c = len(order)
    if dtype == "float32":
        native = rng.uniform(-0.2, 1.2, (6, 9, c)).astype(np.float32)
    else:
        native = rng.integers(0, np.iinfo(dtype).max + 1, (6, 9, c)).astype(dtype)
    expected = formats.to_engine(native, order=order, bottom_up=bottom_up)
    got = server_gpu.to_engine(torch.from_numpy(native), order, bottom_up)
    assert np.array_equal(got.numpy(), expected)
    rgb = _rgb(6, 9)
    back = server_gpu.from_engine(torch.from_numpy(rgb), c, dtype, order, bottom_up).numpy()
    assert back.dtype == np.dtype(dtype)
    assert np.array_equal(formats.to_engine(back, order=order, bottom_up=bottom_up), rgb)
    if order == "BGRA" and bottom_up:
        assert np.array_equal(back, formats.to_touchdesigner(rgb, np.uint8, 4))


def _reference_to_engine(frame: np.ndarray, order: str, bottom_up: bool) -> np.ndarray:
    """The rules in plain numpy indexing: grey to three equal channels, BGR reversed, alpha dropped, rows flipped."""
    if frame.shape[2] <= 2:
        rgb = np.repeat(frame[:, :, :1], 3, axis=2)
    else:
        rgb = frame[:, :, 2::-1] if order.startswith("BGR") else frame[:, :, :3]
    rgb = rgb[::-1] if bottom_up else rgb
    if frame.dtype == np.uint16:
        return ((rgb.astype(np.uint32) * 255 + 32767) // 65535).astype(np.uint8)
    if frame.dtype == np.float32:
        return np.rint(np.clip(rgb, 0.0, 1.0) * 255).astype(np.uint8)
    return rgb


@pytest.mark.parametrize("opencv", [True, False], ids=["opencv", "numpy"])
@pytest.mark.parametrize("dtype", ["uint8", "uint16", "float32"])
def test_every_layout_converts_as_the_plain_numpy_rules_with_or_without_opencv(dtype, opencv, monkeypatch):
    """Both directions, every channel count, order and orientation, contiguous frames and strided views: OpenCV's
    passes (taken where a host's Python has it) give the same bytes as numpy's."""
    if not opencv:
        monkeypatch.setattr(formats, "_opencv", lambda: None)
    rng = np.random.default_rng(2)
    for c, order in ((1, "R"), (2, "RG"), (3, "RGB"), (3, "BGR"), (4, "RGBA"), (4, "BGRA")):
        if dtype == "float32":
            whole = rng.uniform(-0.2, 1.2, (6, 18, c)).astype(np.float32)
        else:
            whole = rng.integers(0, np.iinfo(dtype).max + 1, (6, 18, c)).astype(dtype)
        for frame in (whole[:, :9], whole[:, ::2]):  # rows strided / pixels strided
            for bottom_up in (False, True):
                out = formats.to_engine(frame, order=order, bottom_up=bottom_up)
                assert out.flags.c_contiguous and out.dtype == np.uint8 and not np.shares_memory(out, frame)
                assert np.array_equal(out, _reference_to_engine(frame, order, bottom_up)), (c, order, bottom_up)
    rgb = _rgb(6, 9)
    for c, order in ((1, "R"), (3, "RGB"), (3, "BGR"), (4, "RGBA"), (4, "BGRA")):
        for bottom_up in (False, True):
            host = formats.from_engine(rgb, channels=c, dtype=dtype, order=order, bottom_up=bottom_up)
            assert host.shape == (6, 9, c) and host.dtype == np.dtype(dtype) and host.flags.c_contiguous
            rows = host[::-1] if bottom_up else host
            picked = rows[:, :, :3][:, :, ::-1] if order.startswith("BGR") else rows[:, :, :min(c, 3)]
            assert np.array_equal(formats.to_uint8(picked), rgb[:, :, :min(c, 3)]), (c, order, bottom_up)
            if c == 4:
                assert np.all(formats.to_uint8(host[..., 3]) == 255)
            kept = np.zeros_like(host)  # a sink's buffer, kept from frame to frame
            assert formats.from_engine(rgb, channels=c, dtype=dtype, order=order, bottom_up=bottom_up,
                                       out=kept) is kept and np.array_equal(kept, host)


def test_nan_or_inf_anywhere_is_refused_and_huge_finite_values_are_not():
    """A frame's values are checked in one pass (a sum); a sum past float32's range falls back to min and max."""
    for bad in (np.nan, np.inf, -np.inf):
        frame = np.zeros((4, 6, 4), np.float32)
        frame[3, 5, 3] = bad  # the last value, alpha included
        with pytest.raises(ValueError, match="holds NaN or infinite values"):
            formats.to_engine(frame, order="RGBA")
    huge = np.full((4, 6, 3), np.finfo(np.float32).max, np.float32)  # finite, but their sum is not
    assert np.array_equal(formats.to_engine(huge), np.full((4, 6, 3), 255, np.uint8))
    mixed = np.zeros((4, 6, 3), np.float32)
    mixed[0, 0], mixed[0, 1] = np.inf, -np.inf  # a sum of NaN
    with pytest.raises(ValueError, match="TouchDesigner frame: holds NaN"):
        formats.from_touchdesigner(mixed)
