"""The CPU engine's thread count: the host keeps a core; a setting or OMP_NUM_THREADS rules."""

from __future__ import annotations

import pytest
import torch

from loom_live.engine.config import load_config
from loom_live.engine.stream.cpu_threads import apply_cpu_threads, engine_threads
from loom_live.host_bridge.wire.typed_config import ConfigError


@pytest.mark.parametrize(("setting", "cores", "expected"), [(0, 2, 1), (0, 1, 1), (0, 16, 15), (3, 2, 3), (1, 64, 1)])
def test_an_engine_leaves_one_core_to_its_host_unless_told(setting, cores, expected):
    assert engine_threads(setting, cores) == expected


@pytest.fixture
def threads_restored():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_cpu_session_computes_on_the_threads_it_was_given(threads_restored, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert apply_cpu_threads(1, torch.device("cpu")) == 1
    assert torch.get_num_threads() == 1
    assert apply_cpu_threads(0, torch.device("cpu")) >= 1


def test_omp_num_threads_and_gpu_sessions_are_left_alone(threads_restored, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert apply_cpu_threads(0, torch.device("cpu")) is None
    assert apply_cpu_threads(2, torch.device("cpu")) == 2  # an explicit setting still counts
    assert apply_cpu_threads(0, torch.device("cuda")) is None


def test_a_negative_thread_count_is_refused():
    with pytest.raises(ConfigError, match="cpu_threads"):
        load_config("default", ["model.cpu_threads=-1"])
