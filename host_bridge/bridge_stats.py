"""What the bridge counts and times, and the `BridgeStatus` a host shows its user.

The bookkeeping lives in one object so that its bounds are in one place: submit times are kept
only for a limited number of frames (a stalled engine must not grow the host), latencies and
output times in fixed windows. `latest()` reads fps and the median latency once per frame, so
both are computed in plain Python, cheaply: the latencies are kept sorted as they come and go, so no
frame pays for a sort. The bridge calls into it with the engine lock held.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from loom_live.host_bridge.supervisor import EngineState

LATENCY_WINDOW = 256
SEQ_TIMES_LIMIT = 512  # submit times kept for latency; bounded so a stalled engine cannot grow it
FPS_IDLE_S = 1.0  # no output for this long: the output rate reads 0
# outputs spanning less than this read 0: a stream's first chunk comes back as a burst of frames a few ms apart,
# whose rate (over a thousand FPS on a CPU) says nothing of the stream's
FPS_MIN_SPAN_S = 0.25


@dataclass
class BridgeStatus:
    """What the host shows its user about the engine and the frame it was just given."""

    state: EngineState = EngineState.STOPPED
    fps: float = 0.0
    latency_ms: float = 0.0
    dropped: int = 0
    message: str = ""
    log_tail: list[str] = field(default_factory=list)
    seq: int = -1  # input sequence number the returned frame came from; -1 for a fallback frame
    fallback: bool = True
    restarts: int = 0
    frames_out: int = 0
    refused: int = 0  # frames and messages refused, on this side and (as last reported) on the engine's
    heard_s: float = -1.0  # seconds since the engine last spoke (-1: no engine); fresh only within hang_timeout_s
    refusal: str = ""  # the engine's own error when it refused its run (bad config, missing weights): not restarted
    standby: str = ""  # with BridgeConfig.standby: none (between attempts), starting, loading or ready; "" without


class FrameStats:
    """Frame counters, submit-to-output latencies and the output rate."""

    def __init__(self) -> None:
        self.counts = dict(submitted=0, sent=0, received=0, dropped=0, stale=0, refused=0, refused_frames=0,
                           refused_control=0, superseded=0)
        self._submit_times: dict[int, float] = {}
        self._latencies: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self._out_times: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self._sorted: list[float] = []  # the window's latencies in order, kept so as each comes and goes

    def sent(self, seq: int, t: float) -> None:
        """Input `seq`, submitted at `t`, went into a slot."""
        self.counts["sent"] += 1
        self._submit_times[seq] = t
        if len(self._submit_times) > SEQ_TIMES_LIMIT:
            self._submit_times.pop(next(iter(self._submit_times)))

    def received(self, seq: int, now: float) -> None:
        """The output of input `seq` arrived at `now`."""
        self.counts["received"] += 1
        self._out_times.append(now)
        t0 = self._submit_times.pop(seq, None)
        if t0 is not None:
            if len(self._latencies) == LATENCY_WINDOW:  # the oldest leaves the window
                del self._sorted[bisect.bisect_left(self._sorted, self._latencies[0])]
            self._latencies.append(now - t0)
            bisect.insort(self._sorted, now - t0)

    def fps(self) -> float:
        t = self._out_times
        if len(t) < 2 or time.monotonic() - t[-1] > FPS_IDLE_S or t[-1] - t[0] < FPS_MIN_SPAN_S:
            return 0.0
        return (len(t) - 1) / (t[-1] - t[0])

    def latency_ms(self, q: float) -> float:
        """Percentile `q` (linear, as numpy's default) of the window, read from the kept order."""
        values = self._sorted
        if not values:
            return 0.0
        k = (len(values) - 1) * q / 100
        lo = int(k)
        hi = min(lo + 1, len(values) - 1)
        return (values[lo] + (values[hi] - values[lo]) * (k - lo)) * 1000
