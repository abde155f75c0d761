"""The priority of the stream a viewer waits on (the Wan session's decode, the edit session's main stream):
chosen per device and config without a GPU (torch.cuda.Stream replaced by a recorder), and on a GPU the
real stream's priority (gpu marker)."""

from __future__ import annotations

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


def test_decode_stream_gets_the_highest_priority_others_the_default(recorded):
    s = session_streams(CUDA, separate_decode=True, decode_priority=True)
    assert s.decode.priority == highest_priority() == -3
    assert s.side.priority == s.denoise.priority == DEFAULT_PRIORITY
    assert len({id(s.side), id(s.denoise), id(s.decode)}) == 3 and len(recorded.made) == 3
    assert all(x.device == CUDA for x in recorded.made)


def test_switched_off_every_stream_at_the_default(recorded):
    s = session_streams(CUDA, separate_decode=True, decode_priority=False)
    assert [x.priority for x in (s.side, s.denoise, s.decode)] == [DEFAULT_PRIORITY] * 3


def test_low_vram_has_no_decode_stream(recorded):
    s = session_streams(CUDA, separate_decode=False, decode_priority=True)
    assert s.decode is None and s.side is not None and s.denoise is not None
    assert all(x.priority == DEFAULT_PRIORITY for x in recorded.made)


def test_cpu_makes_no_stream(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("a CUDA stream was made for a CPU session")

    monkeypatch.setattr(cuda_streams.torch.cuda, "Stream", refuse)
    s = session_streams(torch.device("cpu"), separate_decode=True, decode_priority=True)
    assert (s.side, s.denoise, s.decode) == (None, None, None)


def test_config_default_on_and_switchable():
    assert load_config("tiny-random").stream.decode_priority is True
    assert load_config("tiny-random", ["stream.decode_priority=false"]).stream.decode_priority is False


def test_the_edit_main_stream_gets_the_highest_priority_the_encoders_the_default(recorded):
    s = edit_streams(CUDA, two_streams=True, main_priority=True)
    assert s.main.priority == highest_priority() and s.side.priority == s.encoder.priority == DEFAULT_PRIORITY
    assert len({id(s.main), id(s.side), id(s.encoder)}) == 3
    one = edit_streams(CUDA, two_streams=False, main_priority=False)
    assert one.side is one.main and one.main.priority == DEFAULT_PRIORITY
    assert load_config("edit-tiny").edit.main_priority is True
    cpu = edit_streams(torch.device("cpu"), two_streams=True, main_priority=True)
    assert (cpu.main, cpu.side, cpu.encoder) == (None, None, None)


@pytest.mark.gpu
def test_real_decode_stream_priority():
    device = torch.device("cuda", torch.cuda.current_device())
    s = session_streams(device, separate_decode=True, decode_priority=True)
    least, greatest = torch.cuda.Stream.priority_range()
    assert greatest < least
    assert s.decode.priority == greatest and s.denoise.priority == least
