"""Outputs handed out in order, complete, and never more than `max_unfinished` chunks behind."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loom_live.engine.config import load_config
from loom_live.engine.stream.output_queue import OutputQueue, _Entry
from loom_live.engine.stream.session import StreamSession


def test_cpu_outputs_are_ready_at_once_and_in_order():
    q = OutputQueue(torch.device("cpu"), max_unfinished=1)
    for i in range(3):
        q.add(torch.full((2, 4, 4, 3), i, dtype=torch.uint8), to_host=i != 1)
    got = q.take()
    assert [int(g[0, 0, 0, 0]) for g in got] == [0, 1, 2]
    assert isinstance(got[0], np.ndarray) and isinstance(got[1], torch.Tensor)
    assert len(q) == 0 and q.take() == []


class _SlowEvent:
    """A chunk's event that the GPU finishes after `looks` queries; a plain wait would block on it."""

    def __init__(self, looks: int) -> None:
        self.looks = looks

    def query(self) -> bool:
        self.looks -= 1
        return self.looks < 0

    def synchronize(self) -> None:
        raise AssertionError("a queue with `waiting` set must not block on the event")


def test_a_wait_for_the_gpu_calls_waiting_between_looks_and_hands_out_the_chunk_after():
    """The engine server's paced outputs go out during a chunk's wait: the queue calls `waiting` between
    short looks at the event instead of one blocking wait, and the chunk is still handed out, in order."""
    q = OutputQueue(torch.device("cpu"), max_unfinished=0)
    q.cuda = True  # its entries' events are the GPU's (stand-ins here)
    calls = []
    q.waiting = lambda: calls.append(len(calls))
    frames = np.zeros((4, 2, 2, 3), np.uint8)
    q._entries.append(_Entry(frames, _SlowEvent(looks=5)))
    got = q.take()
    assert len(calls) == 5 and len(got) == 1 and got[0] is frames and len(q) == 0


def test_negative_depth_is_refused():
    with pytest.raises(ValueError, match="max_unfinished"):
        OutputQueue(torch.device("cpu"), max_unfinished=-1)


def test_a_bad_config_value_fails_at_load():
    with pytest.raises(ValueError, match="max_unfinished_chunks"):
        load_config("tiny-random", ["stream.max_unfinished_chunks=9"])


@pytest.mark.gpu
def test_host_frames_are_complete_when_handed_out_and_the_queue_stays_bounded():
    q = OutputQueue(torch.device("cuda"), max_unfinished=1)
    a = torch.randn(4096, 4096, device="cuda")
    made, received = [], []
    for i in range(6):
        for _ in range(20):  # keep the GPU busy so the copies are still running when we look
            a = torch.tanh(a @ a)
        frames = ((a[:480, :832].abs() * 100).to(torch.uint8) + i)[None, :, :, None].expand(1, 480, 832, 3)
        made.append(frames.clone())
        q.add(frames.contiguous(), to_host=True)
        received += [g.copy() for g in q.take()]  # a snapshot at hand-out time
        assert len(q) <= 1, "more than one chunk left running"
    received += [g.copy() for g in q.take(wait_all=True)]
    assert len(q) == 0 and len(received) == 6
    for got, want in zip(received, made):
        assert np.array_equal(got, want.cpu().numpy())


@pytest.mark.gpu
def test_a_session_that_overlaps_pushes_gives_the_same_frames_as_one_that_waits():
    frames = np.random.default_rng(0).integers(0, 255, (45, 64, 64, 3), dtype=np.uint8)
    outs = []
    for depth in (0, 1):
        cfg = load_config("tiny-random", ["resolution.width=64", "resolution.height=64", "model.dtype=float32",
                                 f"stream.max_unfinished_chunks={depth}"])
        s = StreamSession.from_config(cfg)
        got = [s.push(frames[i:i + 4]) for i in range(0, 45, 4)] + [s.poll(), s.flush()]
        outs.append(np.concatenate([g for g in got if len(g)]))
    assert outs[0].shape == (45, 64, 64, 3)
    assert np.array_equal(outs[0], outs[1])
