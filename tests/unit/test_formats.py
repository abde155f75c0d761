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


def test_value_mapping_rounds_and_clips():
    assert formats.to_uint8(np.array([0, 257, 65535, 32896], np.uint16)).tolist() == [0, 1, 255, 128]
    assert formats.to_uint8(np.array([-0.5, 0.0, 0.5, 1.0, 7.0], np.float32)).tolist() == [0, 0, 128, 255, 255]


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
