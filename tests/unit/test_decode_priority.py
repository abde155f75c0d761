"""The priority of the stream a viewer waits on (the Wan session's decode, the edit session's main stream)
and of the LoRA merge the next forward waits on: chosen per device and config without a GPU
(torch.cuda.Stream replaced by a recorder), and on a GPU the real streams' priorities and a live scale
change merged on its own stream giving what the denoise stream's merge gives (gpu marker)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loom_live.engine.config import load_config
from loom_live.engine.stream import cuda_streams
from loom_live.engine.stream.cuda_streams import DEFAULT_PRIORITY, edit_streams, highest_priority, session_streams

CUDA = torch.device("cuda", 0)


class _RecordedStream:
    """Stands in for torch.cuda.Stream: keeps what it was created with; torch's pool range on a Hopper."""

    made: list[_RecordedStream] = []

    def __init__(self, device: torch.device | None = None, priority: int = 0) -> None:
        self.device, self.priority = device, priority
        _RecordedStream.made.append(self)

    @staticmethod
    def priority_range() -> tuple[int, int]:
        return 0, -3


@pytest.fixture
def recorded(monkeypatch):
    _RecordedStream.made = []
    monkeypatch.setattr(cuda_streams.torch.cuda, "Stream", _RecordedStream)
    return _RecordedStream


def test_decode_and_merge_streams_get_the_highest_priority_others_the_default(recorded):
    s = session_streams(CUDA, separate_decode=True, decode_priority=True)
    assert s.decode.priority == s.merge.priority == highest_priority() == -3
    assert s.side.priority == s.denoise.priority == DEFAULT_PRIORITY
    assert len({id(s.side), id(s.denoise), id(s.decode), id(s.merge)}) == 4 and len(recorded.made) == 4
    assert all(x.device == CUDA for x in recorded.made)


def test_switched_off_every_stream_at_the_default_and_no_merge_stream(recorded):
    s = session_streams(CUDA, separate_decode=True, decode_priority=False, merge_stream=False)
    assert [x.priority for x in (s.side, s.denoise, s.decode)] == [DEFAULT_PRIORITY] * 3
    assert s.merge is None and len(recorded.made) == 3


def test_low_vram_has_no_decode_or_merge_stream(recorded):
    s = session_streams(CUDA, separate_decode=False, decode_priority=True)
    assert s.decode is None and s.merge is None and s.side is not None and s.denoise is not None
    assert all(x.priority == DEFAULT_PRIORITY for x in recorded.made)


def test_cpu_makes_no_stream(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("a CUDA stream was made for a CPU session")

    monkeypatch.setattr(cuda_streams.torch.cuda, "Stream", refuse)
    s = session_streams(torch.device("cpu"), separate_decode=True, decode_priority=True)
    assert (s.side, s.denoise, s.decode, s.merge) == (None, None, None, None)


def test_config_default_on_and_switchable():
    assert load_config("tiny-random").stream.decode_priority is True
    assert load_config("tiny-random", ["stream.decode_priority=false"]).stream.decode_priority is False
    assert load_config("tiny-random").stream.lora_priority is True
    assert load_config("tiny-random", ["stream.lora_priority=false"]).stream.lora_priority is False


def test_the_edit_main_stream_gets_the_highest_priority_when_asked_the_encoders_the_default(recorded):
    s = edit_streams(CUDA, two_streams=True, main_priority=True)
    assert s.main.priority == highest_priority() and s.side.priority == s.encoder.priority == DEFAULT_PRIORITY
    assert len({id(s.main), id(s.side), id(s.encoder)}) == 3
    one = edit_streams(CUDA, two_streams=False, main_priority=False)
    assert one.side is one.main and one.main.priority == DEFAULT_PRIORITY
    assert load_config("edit-tiny").edit.main_priority is False  # measured: on lengthened the p99 (performance.md)
    assert load_config("edit-tiny", ["edit.main_priority=true"]).edit.main_priority is True
    cpu = edit_streams(torch.device("cpu"), two_streams=True, main_priority=True)
    assert (cpu.main, cpu.side, cpu.encoder) == (None, None, None)


@pytest.mark.gpu
def test_real_decode_stream_priority():
    device = torch.device("cuda", torch.cuda.current_device())
    s = session_streams(device, separate_decode=True, decode_priority=True)
    least, greatest = torch.cuda.Stream.priority_range()
    assert greatest < least
    assert s.decode.priority == greatest and s.denoise.priority == least


@pytest.mark.gpu
def test_a_live_scale_change_on_the_merge_stream_gives_the_denoise_streams_frames(tmp_path):
    """The merge stream joins the denoise stream before and after the merge: the frames around a live
    change are the frames of the same change merged on the denoise stream itself."""
    from safetensors.torch import save_file

    from loom_live.engine.stream.session import StreamSession

    path = tmp_path / "ink.safetensors"
    dims = StreamSession.from_config(load_config("tiny-random", ["model.device=cpu"]), warmup=False).models.dit
    g = torch.Generator().manual_seed(0)
    save_file({f"diffusion_model.{name}.lora_{part}.weight": torch.randn(*shape, generator=g) * 0.05
               for name, m in dims.named_modules() if isinstance(m, torch.nn.Linear) and name.startswith("blocks.")
               for part, shape in (("down", (4, m.in_features)), ("up", (m.out_features, 4)))}, str(path))
    frames = np.random.default_rng(0).integers(0, 255, (45, 64, 64, 3), dtype=np.uint8)
    outs = []
    for own_stream in (True, False):
        cfg = load_config("tiny-random", ["resolution.width=64", "resolution.height=64", "model.dtype=float32",
                                          f"lora=[{{path: {path}, scale: 0.8}}]",
                                          f"stream.lora_priority={str(own_stream).lower()}"])
        s = StreamSession.from_config(cfg)
        assert (s._merge_stream is not None) is own_stream
        got = []
        for i in range(0, 45, 4):
            if i in (12, 24):
                s.set_params(lora_scales={"ink": 0.2 if i == 12 else 1.5})
            got.append(s.push(frames[i:i + 4]))
        got += [s.poll(), s.flush()]
        outs.append(np.concatenate([x for x in got if len(x)]))
    assert outs[0].shape == (45, 64, 64, 3)
    assert np.array_equal(outs[0], outs[1])
