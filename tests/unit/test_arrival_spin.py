"""When a doorbell reader spins: only in a bounded window around a paced stream's next notice."""

from __future__ import annotations

import pytest

from loom_live.host_bridge.wire.arrival_spin import ENV, MAX_WINDOW_S, ArrivalSpin

PERIOD = 1 / 60
W = 0.0003


def _paced(spin: ArrivalSpin, n: int, t0: float = 1000.0, period: float = PERIOD) -> float:
    for i in range(n):
        spin.arrived(t0 + i * period)
    return t0 + (n - 1) * period


def test_off_by_default_and_a_bad_setting_leaves_it_off(monkeypatch, caplog):
    monkeypatch.delenv(ENV, raising=False)
    spin = ArrivalSpin.from_env()
    _paced(spin, 10)
    assert not spin.enabled and spin.plan(1000.1) is None
    for bad in ("fast", "-5", str(MAX_WINDOW_S * 1e6 * 2)):
        monkeypatch.setenv(ENV, bad)
        assert not ArrivalSpin.from_env().enabled
    assert ENV in caplog.text
    monkeypatch.setenv(ENV, "300")
    assert ArrivalSpin.from_env().window_s == pytest.approx(W)


def test_a_paced_stream_blocks_until_the_window_then_spins_inside_it_only():
    spin = ArrivalSpin(W)
    spin.arrived(1000.0)
    spin.arrived(1000.0 + PERIOD)
    assert spin.plan(1000.03) is None  # two arrivals: no period yet
    last = _paced(spin, 5)
    due = last + PERIOD
    assert spin.due() == pytest.approx(due)
    assert spin.plan(last + 0.001) == pytest.approx(due - W - (last + 0.001))  # block until the window opens
    assert spin.plan(due - W / 2) == 0.0 and spin.plan(due + W / 2) == 0.0
    assert spin.plan(due + 2 * W) is None  # missed: block as usual, never spin on


def test_the_spin_per_frame_is_bounded_and_an_idle_link_does_not_spin():
    spin = ArrivalSpin(W)
    last = _paced(spin, 9)
    grid = [last + i * 1e-5 for i in range(int(1.0 / 1e-5))]  # one second with no new notice
    spinning = sum(1e-5 for t in grid if spin.plan(t) == 0.0)
    assert spinning <= 2 * W + 2e-5  # one window after the last frame, then nothing


def test_one_late_frame_does_not_move_the_period_and_a_pause_starts_again():
    spin = ArrivalSpin(W)
    last = _paced(spin, 6)
    spin.arrived(last + 3 * PERIOD)  # a late one (two frames skipped)
    assert spin.due() == pytest.approx(last + 4 * PERIOD)
    spin.arrived(last + 10.0)  # a pause of seconds
    assert spin.due() is None
    _paced(spin, 4, t0=last + 10.0 + PERIOD)
    assert spin.due() == pytest.approx(last + 10.0 + 5 * PERIOD)
