"""Holes a hostile or careless peer finds (issue 23), on the pure functions: each test reproduces one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from loom_live.host_bridge.wire import pixels
from loom_live.host_bridge.wire.protocol import PROTOCOL_VERSION, ProtocolError, decode, make
from loom_live.host_bridge.wire.typed_config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
HUGE = "1" + "0" * 400  # a 401-digit integer: math.isfinite() overflows on it
V = f'{{"v":{PROTOCOL_VERSION},'  # the start of a message of this protocol version


@pytest.mark.parametrize("text", [
    V + '"type":"heartbeat","t":' + HUGE + "}",
    V + '"type":"frame","dir":"in","slot":0,"seq":1,"gen":1,"t":' + HUGE + "}",
    V + '"type":"status","state":"running","progress":-' + HUGE + "}",
    V + '"type":"heartbeat","t":1e999}',
    V + '"type":"heartbeat","t":' + "9" * 5000 + "}",  # past Python's int digit limit
])
def test_hole1_over_long_numbers_are_refused_by_the_protocol_error(text):
    with pytest.raises(ProtocolError):
        decode([text.encode()])


def test_hole1_deeply_nested_values_are_refused():
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(ProtocolError):
        decode([(V + '"type":"params","params":{"a":' + deep + "}}").encode()[:60_000]])
    nested = V + '"type":"ready","info":' + '{"a":' * 5000 + "1" + "}" * 5001
    with pytest.raises(ProtocolError):
        decode([nested.encode()])


def test_hole3_nan_and_inf_frames_are_refused():
    for bad in (np.nan, np.inf, -np.inf):
        frame = np.zeros((4, 4, 3), np.float32)
        frame[1, 2, 0] = bad
        with pytest.raises(ValueError, match="NaN or infinite"):
            pixels.check_frame(frame)
    pixels.check_frame(np.ones((4, 4, 3), np.float32))  # finite floats pass


def test_host_downscales_frames_over_the_size_limit():
    frame = np.arange(40 * 24 * 3, dtype=np.uint16).reshape(40, 24, 3)
    small = pixels.limit_size(frame, 10)
    assert small.shape == (10, 6, 3) and small.dtype == np.uint16
    assert small[0, 0, 0] == frame[:4:2, :4:2, 0].mean().round()  # an area mean of every second pixel (k = 4)
    assert pixels.limit_size(frame, 40) is frame
    exact = frame[:2, :2].mean(axis=(0, 1))  # k = 2: every pixel, rounded
    assert (np.abs(pixels.limit_size(frame, 20)[0, 0] - exact) <= 0.5).all()


def test_hole7_yaml_alias_bomb_gives_a_short_error():
    bomb = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
        f"{c}: &{c} [*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p}]\n" for p, c in zip("abcdefg", "bcdefgh"))
    from loom_live.host_bridge.config import BridgeConfig

    value = yaml.safe_load(bomb)["h"]  # 9**8 strings once expanded
    with pytest.raises(ConfigError) as err:
        BridgeConfig.from_dict({"transport": value})
    assert len(str(err.value)) < 1000 and "transport" in str(err.value)
    with pytest.raises(ConfigError) as err:
        BridgeConfig.from_dict(value)  # not a mapping at all
    assert len(str(err.value)) < 1000


def test_hole9_host_shm_starts_no_resource_tracker():
    code = ("from multiprocessing import resource_tracker as rt\n"
            "from loom_live.host_bridge.wire.rings import create_ring\n"
            "from loom_live.host_bridge.wire.doorbell import Doorbell\n"
            "r = create_ring('shm', 'in', slots=2, width=4, height=4); d = Doorbell.create()\n"
            "r.close(); d.close()\n"
            "assert rt._resource_tracker._pid is None, 'resource tracker started'\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr


def test_hole10_device_or_fifo_as_checkpoint_path_is_a_clear_error(tmp_path):
    from loom_live.engine.models.checkpoint_io import CheckpointError, checkpoint_files

    with pytest.raises(CheckpointError, match="not a regular file or directory"):
        checkpoint_files("/dev/zero")
    fifo = tmp_path / "weights.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match="not a regular file or directory"):
        checkpoint_files(fifo)


def test_messages_a_host_builds_are_still_valid():
    assert decode([json.dumps(make("heartbeat", t=2**62)).encode()])["t"] == 2**62


def test_hole5_engine_shrinks_a_huge_frame_before_converting_it_to_float(monkeypatch):
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    from loom_live.engine.stream import frames as engine_frames

    rng = np.random.default_rng(0)
    big = np.repeat(np.repeat(rng.integers(0, 256, (1, 64, 128, 3), dtype=np.uint8), 16, axis=1), 16, axis=2)
    floats: list[int] = []
    real_float = torch.Tensor.to

    def watch(t, *a, **k):
        out = real_float(t, *a, **k)
        if out.dtype == torch.float32 and out.dim() == 4:
            floats.append(out.numel())
        return out

    mapper = engine_frames.FrameMapper(64, 32, "stretch", torch.device("cpu"), torch.float32)
    monkeypatch.setattr(torch.Tensor, "to", watch)
    x = mapper.to_model(big)  # 1024 x 2048
    monkeypatch.undo()
    assert max(floats) <= engine_frames.SHRINK_BAND_ROWS * big.shape[2] * 3  # a band of rows, never the frame
    reference = F.interpolate(torch.from_numpy(big).permute(0, 3, 1, 2).float(), size=(32, 64), mode="bilinear",
                              antialias=True, align_corners=False) / 127.5 - 1.0
    assert (x - reference).abs().mean() < 0.02
    out = mapper.to_host(x, big)
    assert out.shape == big.shape and out.dtype == torch.uint8
