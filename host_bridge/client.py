"""`Bridge`: what a host calls. Frames in without blocking, the newest output (or a fallback) out.

The bridge is the facade over four helpers: the `Supervisor` (supervisor.py), the background
thread that keeps one engine linked and restarts it, and owner of the engine lock the bridge's
frame state is kept under; `Wanted` (wanted.py), the prompt and parameters the host asked for,
which every fresh engine is told once; `NewestFrames` (newest_frames.py), the output and fallback
frames `latest()` answers with, and the cuda staging buffer; `FrameStats` (bridge_stats.py),
counters and latencies. What stays here is the frame flow and the calls a host makes.

Frames do not pass through the loop thread: their notices travel on the link's lane (the
shared-memory `Doorbell` on shm and cuda-ipc, the `FrameLane` socket on tcp), used by the host's own
threads. `submit()` converts the frame, copies it into a free slot and sends the notice itself, or
keeps it as the single pending frame (replacing, and counting as dropped, an older one), so neither
a slow nor a dead engine can block or grow the host. Whoever asks for output drains the lane:
`latest()`/`latest_cuda()` without waiting (on the doorbell: a look at a counter in shared memory),
`wait_for_output()` and the batch calls by waiting on it (holding only the lane's lock). The loop
thread also drains it on each tick, without waiting for the lock, so slots come back and counters
move even when the host never asks (not on cuda-ipc: there draining copies on the device, which
stays on the host's threads).
Lock order: the lane's lock, then the engine lock; a thread holding the engine lock only ever tries
the lane's lock without waiting.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import zmq

from loom_live.host_bridge.bridge_stats import BridgeStatus, FrameStats
from loom_live.host_bridge.config import BridgeConfig
from loom_live.host_bridge.frame_shrink import FrameShrinker
from loom_live.host_bridge.link import Link
from loom_live.host_bridge.newest_frames import DeviceFrame, NewestFrames, check_device_frame
from loom_live.host_bridge.supervisor import EngineState, Supervisor
from loom_live.host_bridge.wanted import PromptWish, Wanted
from loom_live.host_bridge.wire import pixels as formats
from loom_live.host_bridge.wire.cpu_awake import CpuAwake
from loom_live.host_bridge.wire.handoff_marks import MARKS
from loom_live.host_bridge.wire.params import LIVE, check_prompt_request
from loom_live.host_bridge.wire.protocol import MAX_REFERENCE_SIDE, PROTOCOL_VERSION, RingSpec, make, ready_start

LANE_WAIT_S = 0.05  # longest single poll of the lane by a waiting caller (then it re-checks the link)
LANE_BUSY_WAIT_S = 0.001  # another thread is draining the lane: wait this long for its news
# A new input size is taken (new rings; for a model session, its stream drained at the old size) only once
# it has held this many frames, a chunk of the causal VAE; until then frames are fitted to the size in use,
# so an input whose size changes every frame costs nothing, and one change costs at most a chunk.
SIZE_SETTLE_FRAMES = 4

logger = logging.getLogger(__name__)


class EngineRefused(RuntimeError):
    """The engine refused its run (a bad config, missing weights: it exited with code 2), or a served
    engine refused this host's session secret or CurveZMQ keys; nothing is restarted, and the message
    says what to fix."""


class Interrupted(BaseException):
    """A wait in the bridge ended by `Bridge.interrupt()` (a host's stop signal); a BaseException, as
    KeyboardInterrupt is, so that no `except Exception` takes it for a failed frame and carries on."""


class Bridge:
    """A host's link to one engine: `Bridge(BridgeConfig(...))` or `Bridge(**settings)`, used in a `with`
    block (or `start()` ... `close()`). Live: `submit`/`latest` (`submit_cuda`/`latest_cuda` on cuda-ipc)
    never wait; batch: `process`/`process_stream` wait for every frame; `set_prompt`, `set_params` and
    `set_reference` are remembered and told to every engine that starts later."""

    def __init__(self, config: BridgeConfig | Mapping[str, Any] | None = None, **overrides: Any):
        if config is None or isinstance(config, Mapping):
            config = BridgeConfig.from_dict({**dict(config or {}), **overrides})
        elif overrides:
            raise TypeError("give either a BridgeConfig or keyword settings, not both")
        else:  # checked again, as a copy: a field set after construction skipped the checks, and later ones
            config = dataclasses.replace(config)  # must not reach a running bridge
        self.config: BridgeConfig = config
        self._ctx = zmq.Context()
        self._sup = Supervisor(config, self._ctx)
        self._lock, self._cond = self._sup.lock, self._sup.cond  # the engine lock: the supervisor's
        self._process_lock = threading.Lock()
        self._seq = itertools.count()
        self.last_seq = -1  # sequence number of the last submitted frame (outputs carry it in status.seq)
        self._pending: tuple[int, np.ndarray | None, float] | None = None  # (seq, frame or None=staging, t)
        self._frames = NewestFrames(config.cuda_device)
        self._shrinker = FrameShrinker(config.max_frame_side, _weakly(self._take_shrunk),
                                       _weakly(self._refused_shrunk))
        # what close() does, also when a host drops its bridge without closing it (a notebook cell run
        # again) or exits: nothing here may hold the bridge itself, or it would never be collected
        self._awake = CpuAwake() if config.hold_cpu_awake else None  # held from start() to close()
        self._closer = weakref.finalize(self, _close_parts, self._shrinker, self._sup, self._frames, self._ctx,
                                        self._awake)
        self._settled_size: tuple[int, int] | None = None  # the input size in use (SIZE_SETTLE_FRAMES)
        self._new_size: tuple[tuple[int, int] | None, int] = (None, 0)  # another size, and how many frames it held
        self._collect: dict[int, np.ndarray] | None = None
        self._stats = FrameStats()
        self._wanted = Wanted()
        self._cuda_problem: str | None = None
        self._gives_control = False  # this host gave a control frame: it gives one with every frame
        self._interrupted = False  # interrupt() was asked: the wait in progress, or the next, raises
        if config.transport == "cuda-ipc":
            from loom_live.host_bridge.wire.rings.cuda import cuda_available
            ok, why = cuda_available()
            self._cuda_problem = None if ok else f"cuda-ipc transport unavailable: {why}"

    # ------------------------------------------------------------------------------------------------
    # lifecycle

    def start(self) -> Bridge:
        """Begin launching/connecting in the background; returns at once."""
        if not self._closer.alive:  # its context and threads are gone: it would say "starting" for ever
            raise RuntimeError("start: this bridge is closed; make a new Bridge to start an engine again")
        if self._sup.started:
            return self
        if self._awake is not None and not self._awake.hold().held:
            logger.info("hold_cpu_awake: %s", self._awake.why)  # stats()["cpu_awake"] says it to the host
        if self._cuda_problem is not None:
            self._sup.refuse_start(self._cuda_problem)
            return self
        self._sup.start(self)
        return self

    def close(self) -> None:
        """Say bye, stop the engine (terminate, wait, kill its tree), remove every ring. Idempotent; done
        as well when the bridge is garbage collected, and at exit."""
        self._closer()

    def interrupt(self) -> None:
        """Make the wait in progress (process, process_stream, wait_running, a control with wait=True), or else
        the next one, raise Interrupted within one poll of the frame lane. Meant for a signal handler, which must
        not raise inside the bridge itself: the bridge takes and drops its locks at points where an exception
        from outside would leave one held, and a later call would wait on it for ever. Only sets a flag."""
        self._interrupted = True

    def _check_interrupted(self) -> None:
        if self._interrupted:
            self._interrupted = False
            raise Interrupted("the bridge's wait was interrupted")

    def __enter__(self) -> Bridge:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------
    # frames in

    def submit(self, frame: np.ndarray, *, layout: str = "rgb", control: np.ndarray | None = None) -> bool:
        """Hand a frame to the engine without waiting for it. Latest wins.

        layout "rgb": [H, W, C] top-down RGB(A); "touchdesigner": a TOP's `numpyArray()` (bottom-up,
        BGRA for uint8 4-channel). uint8, uint16 or float32 (0..1). Returns True when the frame went
        into a slot now, False when it waits as the pending frame (engine busy or not running).
        `control` (VACE models with control_source 'video'): the frame's control frame, of its size and
        layout; it travels beside the frame in the same slot (on cuda-ipc staged on the device beside it,
        of the frame's channels and dtype too). One that does not fit (another size, NaN) is refused,
        said and counted (`stats()["refused_control"]`),
        and the frame goes on without it; the engine counts frames that came without one.
        One the engine cannot take (NaN or inf, a wrong shape or dtype) raises ValueError and is counted
        (`stats()["refused_frames"]`). A frame with a side over `max_frame_side` is shrunk on a thread of
        the bridge (frame_shrink.py) and this returns False at once: such a frame must not be written
        into afterwards, and NaN or inf in it is refused and counted there, without raising here.
        """
        if layout not in formats.LAYOUTS:
            raise ValueError(f"layout: {layout!r} is not allowed; expected one of {formats.LAYOUTS}")
        try:
            frame = formats.check_shape(frame)
            big = max(frame.shape[:2]) > self.config.max_frame_side
            converted = None if big else self._convert(self._settle_size(frame), layout)  # values checked there
        except (TypeError, ValueError):
            self._refused_frame()
            raise
        if control is not None or self._gives_control:
            self._gives_control = True  # from now on a frame without one is a missing control frame
            if big and control is not None:
                self._refuse_control(f"the frame is over max_frame_side ({self.config.max_frame_side} px) and "
                                     "is shrunk on its own")
            elif not big:
                converted = self._with_control(frame, converted, control, layout)
        now = time.monotonic()
        with self._lock:
            seq = self._next_seq()
            self._stats.counts["submitted"] += 1
            if big:
                if self._pending is not None:  # superseded by this frame, as a pending frame would be
                    self._pending = None
                    self._stats.counts["dropped"] += 1
                if self._shrinker.offer(frame, layout, seq, now):
                    self._stats.counts["dropped"] += 1
                return False
            MARKS.mark(seq, "host.stage")
            return self._hand_over(converted, layout, seq, now)

    def _with_control(self, frame: np.ndarray, converted: np.ndarray, control: np.ndarray | None,
                      layout: str) -> ControlledFrame:
        """The converted frame with its control frame (converted alike, fitted to the frame's settled size),
        or alone, marked as missing its control frame, when none came or it does not fit (refused, counted)."""
        if control is None:
            return ControlledFrame(converted, None)
        try:
            control = formats.check_shape(control, "control frame")  # its values: in _convert, once
            if control.shape[:2] != frame.shape[:2]:
                raise ValueError(f"control frame {control.shape[1]}x{control.shape[0]}; the frame is "
                                 f"{frame.shape[1]}x{frame.shape[0]} and its control frame must match it")
            fitted = self._convert(formats.resize(control, *converted.shape[:2]), layout, "control frame")
            if (fitted.shape[2], fitted.dtype) != (converted.shape[2], converted.dtype):  # cuda-ipc: own layouts
                raise ValueError(f"control frame {fitted.shape[2]}-channel {fitted.dtype}; on cuda-ipc it shares "
                                 f"the frame's slot and must be {converted.shape[2]}-channel {converted.dtype} too")
            return ControlledFrame(converted, fitted)
        except (TypeError, ValueError) as exc:
            self._refuse_control(str(exc))
            return ControlledFrame(converted, None)

    def _refuse_control(self, why: str) -> None:
        with self._lock:
            self._stats.counts["refused_control"] += 1
        self._sup.note(f"control frame refused: {why}; the frame goes on without it", error=True)

    def _settle_size(self, frame: np.ndarray) -> np.ndarray:
        """`frame`, or the frame fitted to the size in use while its own size has held for fewer than
        SIZE_SETTLE_FRAMES frames (host frames only: a device frame is taken at its size)."""
        size = frame.shape[:2]
        with self._lock:
            settled, (new, held) = self._settled_size, self._new_size
            if settled is None or size == settled:
                self._settled_size, self._new_size = size, (None, 0)
                return frame
            held = held + 1 if new == size else 1
            if held >= SIZE_SETTLE_FRAMES:
                self._settled_size, self._new_size = size, (None, 0)
                return frame
            self._new_size = (size, held)
        return formats.resize(frame, *settled)

    def _convert(self, frame: np.ndarray, layout: str, what: str | None = None) -> np.ndarray:
        """A host frame, its shape checked, as the link takes it: its own layout on cuda-ipc, else engine RGB; a
        ValueError naming `what` (the layout's frame by default) for NaN or infinite values (each path reads the
        values once)."""
        if self.config.transport == "cuda-ipc" and self._cuda_problem is None:
            native = np.ascontiguousarray(formats.check_frame(frame, what or "frame"))
            if native.shape[2] == 2:
                raise ValueError("frame: 2 channels are not allowed on cuda-ipc; expected 1, 3 or 4")
            return native
        if layout == "touchdesigner":
            return formats.from_touchdesigner(frame, what or "TouchDesigner frame")
        return formats.to_engine(frame, what=what or "frame")

    def _hand_over(self, converted: np.ndarray, layout: str, seq: int, t: float) -> bool:
        """Lock held: a converted frame becomes the pending one and goes into a slot if one is free."""
        if self.config.transport == "cuda-ipc" and self._cuda_problem is None:
            if isinstance(converted, ControlledFrame):
                self._frames.stage_host(converted.frame, layout, converted.control)
            else:
                self._frames.stage_host(converted, layout)
            self._set_pending(seq, None, t)
        else:
            self._frames.keep_input(converted.frame if isinstance(converted, ControlledFrame) else converted)
            self._set_pending(seq, converted, t)
        return self._pump()

    def _take_shrunk(self, frame: np.ndarray, layout: str, seq: int, t: float) -> None:
        """The shrinker's thread: a frame over the size limit, shrunk; dropped if a newer one came meanwhile."""
        try:
            converted = self._convert(self._settle_size(frame), layout)
        except (TypeError, ValueError) as exc:
            self._refused_shrunk(str(exc))
            return
        with self._lock:
            if seq != self.last_seq or self._sup.closing:
                self._stats.counts["dropped"] += 1
                return
            self._hand_over(converted, layout, seq, t)

    def _refused_shrunk(self, why: str) -> None:
        self._refused_frame()
        self._sup.note(f"frame refused: {why}", error=True)

    def submit_cuda(self, ptr: int, pitch: int, width: int, height: int, channels: int, dtype: str | np.dtype,
                    *, layout: str = "rgb", stream: int | None = None, control: DeviceFrame | None = None,
                    keep: Any = None) -> bool:
        """Hand over a frame in device memory (TouchDesigner `cudaMemory().ptr`, torch `data_ptr()`).

        The frame is copied on the GPU before this returns (the caller may reuse its buffer), in
        its own layout: the engine converts on the GPU. `stream`: the CUDA stream the frame was
        produced on, if not the legacy default stream. cuda-ipc transport only. `control` (VACE): the
        frame's control frame in device memory, in its layout, of its size, channels and dtype, copied
        on the same stream into the other half of the frame's slot; one that does not match is refused,
        said and counted as in `submit`, and the frame goes on without it. `keep`: what owns the source
        memory (TouchDesigner's `CUDAMemory` objects); given, this returns once the copies are queued,
        without waiting for the GPU, and the bridge holds `keep` until they are done (the caller must not
        reuse the memory otherwise: work it queues after this on `stream` is ordered after the copies).
        """
        if self.config.transport != "cuda-ipc":
            raise ValueError(f"submit_cuda needs transport 'cuda-ipc'; this bridge uses {self.config.transport!r}")
        if layout not in formats.LAYOUTS:
            raise ValueError(f"layout: {layout!r} is not allowed; expected one of {formats.LAYOUTS}")
        try:
            dtype = np.dtype(dtype).name
            check_device_frame(pitch, width, height, channels, dtype)
            if max(width, height) > self.config.max_frame_side:
                raise ValueError(f"size: {width}x{height} is not allowed; expected at most "
                                 f"{self.config.max_frame_side} px per side (max_frame_side)")
        except (TypeError, ValueError):
            self._refused_frame()
            raise
        now = time.monotonic()
        with self._lock:
            seq = self._next_seq()
            self._stats.counts["submitted"] += 1
            if self._cuda_problem is not None:
                self._stats.counts["dropped"] += 1
                return False
            if control is not None or self._gives_control:
                self._gives_control = True
                control = self._device_control(control, (width, height, channels, dtype))
            MARKS.mark(seq, "host.stage")
            self._frames.stage_device(ptr, pitch, width, height, channels, dtype, layout, stream,
                                      None if control is None else (control.ptr, control.pitch), keep)
            self._set_pending(seq, None, now)
            return self._pump()

    def _device_control(self, control: DeviceFrame | None, kind: tuple[int, int, int, str]) -> DeviceFrame | None:
        """A device control frame that matches its frame's (width, height, channels, dtype), or None (refused)."""
        if control is None:
            return None
        try:
            given = (control.width, control.height, control.channels, np.dtype(control.dtype).name)
            check_device_frame(control.pitch, *given)
            if given != kind:
                raise ValueError("control frame {}x{} {}-channel {}; ".format(*given) + "the frame is {}x{} "
                                 "{}-channel {} and its control frame must match it".format(*kind))
        except (TypeError, ValueError) as exc:
            self._refuse_control(str(exc))
            return None
        return control

    def _refused_frame(self) -> None:
        with self._lock:
            self._stats.counts["refused_frames"] += 1

    def _next_seq(self) -> int:
        self.last_seq = next(self._seq)
        return self.last_seq

    def _set_pending(self, seq: int, frame: np.ndarray | None, t: float) -> None:
        if self._pending is not None:
            self._stats.counts["dropped"] += 1
        self._pending = (seq, frame, t)

    # ------------------------------------------------------------------------------------------------
    # frames out

    def latest(self) -> tuple[np.ndarray | None, BridgeStatus]:
        """The newest output frame (uint8 RGB [H, W, 3] top-down, read-only) or the fallback, and the status."""
        self._drain(0.0)
        with self._lock:
            status = self._status()
            frames = self._frames
            if frames.has_output:
                fresh = self._fresh(status)
                if fresh or self.config.fallback == "last":
                    status.seq, status.fallback = frames.seq, not fresh
                    return frames.output_array(), self._as_shown(status)
            return frames.fallback_array(), self._as_shown(status)

    def latest_cuda(self, ptr: int, pitch: int | None = None, *, stream: int | None = None,
                    wait: bool = True) -> BridgeStatus:
        """Copy the newest output (or the fallback) into device memory, in the input's layout (cuda-ipc).

        Returns when the copy is done; `stream` orders it after the caller's own work on that stream.
        `wait` false: returns once the copy is queued on `stream`, without waiting for the GPU; work the
        caller queues after it on `stream` sees the frame. After the input changed size or format, the
        newest output is of the old kind until the engine catches up; the caller's buffer is sized for
        the new input, so until then the fallback is the input.
        """
        self._drain(0.0)
        with self._lock:
            status = self._status()
            frames = self._frames
            fresh = self._fresh(status)
            out, staging = frames.output_device, frames.staging
            fits = out is not None and (staging is None or _frame_kind(out.spec) == _frame_kind(staging.spec))
            if fits and (fresh or self.config.fallback == "last"):
                out.read_device(0, ptr, pitch, stream=stream, wait=wait)
                status.seq, status.fallback = frames.seq, not fresh
            elif frames.staging is not None:
                frames.staging.read_device(0, ptr, pitch, stream=stream, wait=wait)
            return self._as_shown(status)

    def status(self) -> BridgeStatus:
        """Where the engine is (running: it takes frames); the status `latest()` hands out with a frame
        says what that frame is."""
        with self._lock:
            return self._status()

    def _as_shown(self, status: BridgeStatus) -> BridgeStatus:
        """Lock held: the status that goes out with a frame matches the frame. An engine that is ready but has
        not sent this host a restyled frame yet (a fresh start, a restart, a switch to the standby) is
        shown as starting or restarting while the fallback goes out, not as running."""
        sup = self._sup
        if status.state == EngineState.RUNNING and status.fallback and self._frames.link_id != sup.link_id:
            status.state = EngineState.RESTARTING if sup.restarts else EngineState.STARTING
            status.message = "engine ready; its first restyled frame is on its way (the fallback meanwhile)"
        return status

    def _fresh(self, status: BridgeStatus) -> bool:
        """The newest output counts as fresh only while its engine is known alive (the hang timeout
        bounds how stale a frame marked fresh can be), judged by `status`'s own reading of when the engine last
        spoke, so that a frame and the status handed out with it agree; lock held."""
        link = self._link
        return (self._sup.state == EngineState.RUNNING and link is not None and self._frames.link_id == link.id
                and link.known_alive(status.heard_s))

    def _status(self) -> BridgeStatus:
        link = self._link
        sup = self._sup
        tail = link.log_tail() if link is not None else sup.log_tail
        counts = self._stats.counts
        report = sup.engine_report  # the engine's inputs it dropped, and outputs it had no room to hand over
        dropped = counts["dropped"] + int(report.get("dropped", 0)) + int(report.get("dropped_out", 0))
        refused = (counts["refused"] + counts["refused_frames"] + (link.refused if link else 0)
                   + int(sup.engine_report.get("refused", 0)))
        heard = time.monotonic() - link.last_heard if link is not None and link.hello_done else -1.0
        message = sup.message
        if sup.state == EngineState.RUNNING and heard > self.config.hang_timeout_s:
            message = f"engine silent for {heard:.1f} s: its frames are not fresh"
        return BridgeStatus(state=sup.state, fps=self._stats.fps(), latency_ms=self._stats.latency_ms(50),
                            dropped=dropped, message=message, log_tail=tail, restarts=sup.restarts,
                            frames_out=counts["received"], refused=refused, heard_s=round(heard, 3),
                            refusal=sup.refusal, standby=sup.standby.describe()["state"] if sup.standby else "")

    def stats(self) -> dict[str, Any]:
        """Host counters plus the engine's latest report (JSON-able)."""
        with self._lock:
            link, sup = self._link, self._sup
            counts = self._stats.counts
            refused = counts["refused"] + (link.refused if link else 0)
            return {
                "state": sup.state.value, "message": sup.message, "transport": self.config.transport,
                **{k: v for k, v in counts.items() if k != "refused"}, "refused": refused, "errors": sup.errors,
                "last_refusal": link.last_refusal if link else "",
                "restarts": sup.restarts, "fps": round(self._stats.fps(), 2),
                "latency_ms_p50": round(self._stats.latency_ms(50), 3),
                "latency_ms_p99": round(self._stats.latency_ms(99), 3),
                "in_flight": link.in_tracker.in_flight if link and link.in_tracker else 0,
                "copies_waited": self._frames.copies_waited,
                "last_error": sup.last_error, "refusal": sup.refusal, "engine": dict(sup.engine_report),
                "engine_pid": link.pid if link else None, "protocol": PROTOCOL_VERSION,
                "segments": link.segment_names() if link else [],
                "endpoint": link.channel.endpoint if link else None,
                "lane_endpoint": link.lane.endpoint if link and link.lane else None,
                "messages": link.message_counts() if link else {},
                "standby": sup.standby.describe() if sup.standby else None,
                "cpu_awake": None if self._awake is None else {"held": self._awake.held, "why": self._awake.why},
            }

    def engine_report(self, refresh: bool = False) -> dict[str, Any]:
        """The engine's latest report (`stats()["engine"]`: its counters and, under "session", the
        session's stats), as polled every second; `refresh`: ask the running engine now and wait for
        the answer (a host that must show what the engine just did, once, not per frame)."""
        if refresh:
            with contextlib.suppress(RuntimeError, TimeoutError, ValueError):  # not running: the last report
                return self._request("stats", time.monotonic() + self.config.request_timeout_s).get("data") or {}
        with self._lock:
            return dict(self._sup.engine_report)

    # ------------------------------------------------------------------------------------------------
    # batch use (ComfyUI)

    def process(self, frames: Iterable[np.ndarray], timeout_s: float = 300.0, *,
                layout: str = "rgb", control: Iterable[np.ndarray | None] | None = None) -> list[np.ndarray]:
        """Every frame through the engine, lossless and in order; blocks; one output per input.

        Frames may change size: each run of one size is flushed as a stream of its own before the
        next size goes. `control`: one control frame per frame (VACE, as in `submit`); the frames
        beyond its end, and the ones that do not fit, go without one (refused and counted)."""
        controls = iter(control) if control is not None else None
        deadline = time.monotonic() + timeout_s
        self.wait_running(timeout_s)
        with self._process_lock:
            link_id = self._sup.link_id
            self._request("mode", deadline, lossless=True)
            seqs: list[int] = []
            with self._lock:
                self._collect = {}
            try:
                shape = None
                for frame in frames:
                    if seqs and np.shape(frame) != shape:
                        # A new size means new rings, and notices still on their way for the old ones
                        # would be dropped as stale: the frames of the old size finish first.
                        self._finish_lossless(seqs, link_id, deadline)
                    shape = np.shape(frame)
                    given = next(controls, None) if controls is not None else None
                    seqs.append(self._submit_lossless(frame, layout, link_id, deadline, given, controls is not None))
                self._finish_lossless(seqs, link_id, deadline)
                with self._lock:
                    return [self._collect[s] for s in seqs]
            finally:
                with self._lock:
                    self._collect = None
                if self._sup.link_id == link_id:
                    self._request("mode", time.monotonic() + self.config.request_timeout_s, lossless=False)

    def process_stream(self, frames: Iterable[np.ndarray], stall_timeout_s: float = 300.0, *,
                       layout: str = "rgb", control: Iterable[np.ndarray | None] | None = None
                       ) -> Iterator[np.ndarray]:
        """Every frame through the engine, lossless and in order, as one stream; yields each output as
        soon as it and every one before it are back (a player writing a long file).

        Unlike one `process()` call per batch, the engine's stream (its caches, its motion estimate)
        goes on from frame to frame: a flush, which ends a stream, comes only at the end and where
        the frame size changes. Input frames are taken from `frames` only as slots free up, so
        neither side holds more than the rings do. Raises like `process()` when the engine stops, or
        when it returns nothing for `stall_timeout_s`; close the generator to stop early. `control`: as in
        `process()`, taken one per frame alongside."""
        controls = iter(control) if control is not None else None
        self.wait_running(stall_timeout_s)
        with self._process_lock:
            link_id = self._sup.link_id
            self._request("mode", time.monotonic() + stall_timeout_s, lossless=True)
            waiting: deque[int] = deque()  # sequence numbers sent whose outputs were not yielded yet
            with self._lock:
                self._collect = {}
            try:
                shape = None
                for frame in frames:
                    if waiting and np.shape(frame) != shape:  # see process(): the old size finishes first
                        self._finish_lossless(list(waiting), link_id, time.monotonic() + stall_timeout_s)
                    shape = np.shape(frame)
                    given = next(controls, None) if controls is not None else None
                    waiting.append(self._submit_lossless(frame, layout, link_id, time.monotonic() + stall_timeout_s,
                                                         given, controls is not None))
                    yield from self._in_order(waiting)
                if waiting:
                    self._finish_lossless(list(waiting), link_id, time.monotonic() + stall_timeout_s)
                yield from self._in_order(waiting)
            finally:
                with self._lock:
                    self._collect = None
                if self._sup.link_id == link_id:  # back to live mode: best effort, an engine may be gone by now
                    with contextlib.suppress(RuntimeError, TimeoutError, ValueError):
                        self._request("mode", time.monotonic() + self.config.request_timeout_s, lossless=False)

    def _in_order(self, waiting: deque[int]) -> list[np.ndarray]:
        """The outputs that are back, from the oldest sent on, up to the first still missing."""
        ready = []
        with self._lock:
            while waiting and waiting[0] in self._collect:
                ready.append(self._collect.pop(waiting.popleft()))
        return ready

    def _finish_lossless(self, seqs: list[int], link_id: int, deadline: float) -> None:
        """Flush the engine's stream up to the last of `seqs` and wait for all their outputs."""
        self._request("flush", deadline, seq=seqs[-1] if seqs else None)
        while not self._await(lambda: all(s in self._collect for s in seqs), LANE_WAIT_S):
            with self._lock:
                self._check_alive(link_id, deadline, f"{len(self._collect)}/{len(seqs)} outputs")

    def _submit_lossless(self, frame: np.ndarray, layout: str, link_id: int, deadline: float,
                         control: np.ndarray | None = None, gives_control: bool = False) -> int:
        cuda = self.config.transport == "cuda-ipc"
        data = (np.ascontiguousarray(frame) if cuda else
                formats.from_touchdesigner(frame) if layout == "touchdesigner" else formats.to_engine(frame))
        with_control, staged_control = None, None
        if gives_control:  # stacked over its control frame (cuda-ipc: staged beside it), or alone (missing, refused)
            paired = self._with_control(frame, data, control, layout) if control is not None \
                else ControlledFrame(data, None)
            with_control = paired.control is not None
            data, staged_control = (data, paired.control) if cuda else (paired.stacked(), None)
        with self._lock:
            seq = self._next_seq()
        while True:
            with self._lock:
                self._check_alive(link_id, deadline, "waiting for a free input slot")
                link = self._link
                if cuda:
                    self._frames.stage_host(data, layout, staged_control)
                if link.write_frame(seq, data if not cuda else None, self._frames.staging, time.monotonic(),
                                    with_control, self._frames.control_staging):
                    self._stats.counts["submitted"] += 1
                    self._stats.sent(seq, time.monotonic())
                    return seq
            self._await(lambda lk=link: lk.in_tracker is None or lk.in_tracker.free > 0 or self._link is not lk,
                        LANE_WAIT_S)

    def _check_started(self, what: str) -> None:
        """A call that needs an engine, made before `start()`: no engine is coming, and "stopped" alone
        would not say why."""
        if not self._sup.started:
            raise RuntimeError(f"{what}: the bridge is not started; call start() first, or use it in a with block")

    def _check_alive(self, link_id: int, deadline: float, what: str) -> None:
        if self._sup.link_id != link_id or self._sup.state != EngineState.RUNNING:
            raise RuntimeError(f"engine stopped during process(): {self._sup.state}: {self._sup.message}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"process(): timed out ({what})")

    def wait_for_output(self, seq: int, timeout_s: float = 5.0) -> bool:
        """Block until the output of input `seq` (or a later one) has arrived (scripts, tests, benchmarks)."""
        frames = self._frames
        return self._await(lambda: frames.seq >= seq and frames.link_id == self._sup.link_id, timeout_s)

    def _await(self, ready: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until `ready()` (checked under the lock) or the timeout, draining the frame lane meanwhile;
        when another thread is draining it, wait for that thread's news instead."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_interrupted()
            with self._cond:
                if ready():
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                link = self._link
                lane = link.lane if link is not None else None
                if lane is None:
                    self._cond.wait(min(remaining, LANE_WAIT_S))
                    continue
            if not self._drain(min(remaining, LANE_WAIT_S), link):
                with self._cond:
                    if not ready():
                        self._cond.wait(min(remaining, LANE_BUSY_WAIT_S))

    def wait_running(self, timeout_s: float = 60.0) -> BridgeStatus:
        """Block until the engine is running (for scripts and batch use; never call from a frame loop).

        Raises EngineRefused with the engine's own message when it refused its run, else RuntimeError
        (with the engine's last output) when it ended or did not start in time."""
        self._check_started("wait_running")
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while (state := self._sup.state) != EngineState.RUNNING:
                self._check_interrupted()
                if self._sup.refusal:
                    raise EngineRefused(self._sup.refusal)
                if state.ended or time.monotonic() > deadline:
                    tail = "\n".join(self._status().log_tail)
                    waited = "" if state.ended else f" after {timeout_s:.0f} s"
                    raise RuntimeError(f"engine is {state}{waited}: {self._sup.message}\n{tail}")
                self._cond.wait(0.05)
            return self._status()

    # ------------------------------------------------------------------------------------------------
    # control

    def set_prompt(self, text: str, transition_chunks: int | None = None, *, wait: bool = False) -> None:
        """Change the prompt. Remembered: an engine that starts or restarts later is told it once, when
        ready. A bad prompt raises ValueError and is not remembered; nor is one a running engine refuses
        with wait=True (e.g. missing from its embeddings file). An empty one is said in the words of the running
        engine's model family (what its prompt is), or of each family before an engine has said."""
        wish = PromptWish(*check_prompt_request(text, transition_chunks, family=self.engine_family))
        self._control("prompt", wait, lambda: self._wanted.want_prompt(wish), text=wish.text,
                      transition_chunks=wish.transition_chunks)

    def set_params(self, *, wait: bool = False, **params: Any) -> None:
        """Change live parameters (host_bridge/wire/params.py: steps, noise_scale, ...). Remembered like the
        prompt; a bad value raises ValueError and is not remembered, nor is one the engine refuses (wait=True)."""
        checked = LIVE.check(params)
        self._control("params", wait, lambda: self._wanted.want_params(checked), params=checked)

    def set_reference(self, image: np.ndarray | None, *, layout: str = "rgb", wait: bool = False) -> None:
        """VACE models: a new reference image (the look the stream keeps), in effect from the engine's next
        chunk; None streams without one from then on. Any size up to 4096 px a side (the engine maps it to
        its resolution), a frame's dtypes and layouts (`submit`). Remembered like the prompt: an engine that
        starts later gets it. A bad image raises ValueError; a model without VACE refuses it (wait=True:
        raised here; else said in the status)."""
        wish = None if image is None else reference_image(image, layout)
        fields: dict[str, Any] = {"clear": True} if wish is None else {"width": wish.shape[1], "height": wish.shape[0]}
        payload = [] if wish is None else [wish.tobytes()]
        self._control("reference", wait, lambda: self._wanted.want_reference(wish), payload=payload, **fields)

    @property
    def wanted(self) -> Wanted:
        """A copy of the prompt and parameters the host asked for (what a fresh engine is told)."""
        with self._lock:
            return self._wanted.snapshot()

    def engine_start(self) -> dict[str, Any] | None:
        """What the running engine started on, its config's prompt and live parameters, as its ready message
        said: {"prompt": text, "params": {name: value}}, as `set_prompt` and `set_params` take them (only the
        parameters this host knows, with allowed values), and where it says them, "family", its model family,
        "control_sources", the control sources it can make, and "takes_reference", whether it takes a reference
        image (`protocol.ready_start`); a copy. None before the engine is ready, or from one that does not say (an
        older one)."""
        with self._lock:
            link = self._link
            return ready_start(link.engine_info) if link is not None and link.ready else None

    @property
    def engine_family(self) -> str | None:
        """The running engine's model family (`model.family`: what its prompt is, a style or an edit
        instruction), as its ready message said; None before an engine is ready, or from one that does not say."""
        start = self.engine_start()
        return None if start is None else start.get("family")

    def reset(self, *, wait: bool = False) -> None:
        self._control("reset", wait)

    def _control(self, kind: str, wait: bool, remember: Callable[[], Callable[[], None]] | None = None,
                 payload: list[bytes] | None = None, **fields: Any) -> None:
        """Remember (`remember()` returns its undo) and send to a ready engine in one hold of the engine
        lock, so that this send and a fresh engine's `on_engine_ready` never both deliver one value."""
        if wait:
            undo: list[Callable[[], None]] = []
            try:
                self._request(kind, time.monotonic() + self.config.request_timeout_s,
                              before_send=(lambda: undo.append(remember())) if remember else None,
                              payload=payload, **fields)
            except ValueError:
                with self._lock:
                    for u in undo:
                        u()
                raise
            return
        with self._lock:
            if remember is not None:
                remember()
            link = self._link
            if link is None or not link.ready:
                return  # sent when the engine is ready (prompt and parameters are remembered)
            if not link.send(make(kind, **fields), payload or ()):
                self._sup.note(f"{kind} not sent: the engine is not reading")

    def _request(self, kind: str, deadline: float, *, before_send: Callable[[], None] | None = None,
                 payload: list[bytes] | None = None, **fields: Any) -> dict[str, Any]:
        """Send a request and wait for the engine's answer; `before_send` runs in the same lock hold."""
        self._check_started(kind)
        sup = self._sup
        with self._cond:
            if before_send is not None:
                before_send()
            rid = sup.new_request_id()
            msg = make(kind, id=rid, **fields)
            link = self._link
            if link is None or sup.state != EngineState.RUNNING or not link.send(msg, payload or ()):
                raise RuntimeError(f"{kind}: engine is {sup.state}: {sup.message}")
        # the engine may need released output slots to answer (a flush): keep draining the lane
        while not self._await(lambda: sup.has_reply(rid) or self._link is not link, LANE_WAIT_S):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{kind}: no reply from the engine")
        with self._cond:
            reply = sup.take_reply(rid)
        if reply is None:
            raise RuntimeError(f"{kind}: engine went away: {sup.message}")
        if reply["type"] == "error":
            raise ValueError(f"engine refused {kind}: {reply['message']}")
        return reply

    # ------------------------------------------------------------------------------------------------
    # the frame flow (shared with the loop thread; called with the lock held)

    @property
    def _link(self) -> Link | None:
        """The link to the engine now in use (the loop thread opens and replaces it)."""
        return self._sup.link

    def _drain(self, timeout_s: float, link: Link | None = None) -> bool:
        """Receive what the frame lane holds (waiting up to `timeout_s`) and act on it. False, at once,
        when another thread holds the lane: it is receiving, and acts on, the same messages."""
        link = link or self._link
        lane = link.lane if link is not None else None
        if lane is None or not lane.acquire(blocking=False):
            return False
        try:
            messages = lane.receive(timeout_s)
            if messages:
                newest = max((i for i, (msg, _) in enumerate(messages) if msg["type"] == "frame"), default=-1)
                with self._cond:
                    for i, (msg, payload) in enumerate(messages):
                        try:
                            self._on_lane(link, msg, payload, superseded=i < newest and self._collect is None)
                        except Exception as exc:  # an odd notice is refused and counted, never raised to a host
                            lane.refuse(f"{msg['type']} notice: {type(exc).__name__}: {exc}")
        finally:
            lane.release()
        return True

    def _on_lane(self, link: Link, msg: dict[str, Any], payload: list[bytes], superseded: bool = False) -> None:
        """An output frame notice or an input slot release (the lane accepts nothing else). `superseded`: a
        newer output came in the same receive, so this one's slot goes back unread."""
        if link is not self._link:
            return  # a torn-down engine's last words
        link.heard()
        if msg["type"] == "frame":
            self._on_output(link, msg, payload, superseded)
        else:
            if not link.on_release(msg):
                link.lane.refuse(f"release of slot {msg['slot']} that was not published")
            self._pump()
            self._cond.notify_all()

    def _on_output(self, link: Link, msg: dict[str, Any], payload: list[bytes], superseded: bool = False) -> None:
        """An output frame notice: read the slot (on cuda-ipc a device copy, queued), hand it back, and make
        the frame the newest output."""
        ring = link.ring_out
        if ring is None or msg["gen"] != ring.spec.generation:
            self._stats.counts["stale"] += 1
            return
        MARKS.mark(msg["seq"], "host.output_notice")
        if superseded:  # the engine made it, the host would never see it: counted, not copied
            link.release_output(msg["slot"], msg["gen"])
            self._stats.counts["superseded"] += 1
            self._stats.received(msg["seq"], time.monotonic())
            return
        try:
            frame = self._frames.read_output(ring, msg["slot"], payload, self.config.transport == "cuda-ipc")
        except (ValueError, RuntimeError) as exc:
            link.lane.refuse(f"output frame: {exc}")
            return
        MARKS.mark(msg["seq"], "host.output_release")
        link.release_output(msg["slot"], msg["gen"])
        MARKS.mark(msg["seq"], "host.notify")
        self._stats.received(msg["seq"], time.monotonic())
        self._frames.set_newest(frame, msg["seq"], link.id)
        if self._collect is not None:
            self._collect[msg["seq"]] = frame if frame is not None else self._frames.output_array()
        self._cond.notify_all()

    def _pump(self) -> bool:
        """Write the pending frame into a free slot, if the engine runs and a slot is free."""
        link = self._link
        if self._pending is None or link is None or not link.ready:
            return False
        seq, frame, t = self._pending
        control = False if self._gives_control else None  # a frame of a host that gives control frames: missing
        if isinstance(frame, ControlledFrame):
            frame, control = frame.stacked(), frame.control is not None
        elif frame is None and self._gives_control:  # cuda-ipc: staged, its control frame staged or not
            control = self._frames.control_staged
        try:
            if not link.write_frame(seq, frame, self._frames.staging, t, control, self._frames.control_staging):
                return False
        except ValueError as exc:  # a frame no ring can hold: refused and counted, never retried
            self._pending = None
            self._stats.counts["refused_frames"] += 1
            self._sup.note(f"frame refused: {exc}", error=True)
            return False
        except Exception as exc:  # e.g. out of shared or device memory: report, never raise into the frame loop
            self._sup.note(f"cannot hand the frame over: {type(exc).__name__}: {exc}", error=True)
            return False
        self._pending = None
        self._stats.sent(seq, t)
        return True

    # ------------------------------------------------------------------------------------------------
    # the supervisor's calls (supervisor.FrameSide)

    def on_engine_ready(self, link: Link) -> None:
        """A fresh engine (called with the engine lock held): it is told what the host wants, once, and
        gets the pending frame."""
        for kind, fields, payload in self._wanted.for_fresh_engine():
            try:  # each on its own: one that cannot be sent must not keep the others (or the frame) back
                link.send(make(kind, **fields), payload)
            except ValueError as exc:  # ProtocolError too
                self._sup.note(f"{kind} not told to the fresh engine: {exc}", error=True)
        self._pump()

    def on_tick(self, link: Link) -> None:
        """The loop thread's turn at the frames: outputs and releases nobody asked for yet (never waiting
        for the lane), then the pending frame. On cuda-ipc it leaves the lane to the host's threads: an
        output notice means a device copy in the host's process, and a host such as TouchDesigner wants
        its CUDA work on its own (main) thread; the host asks every frame, so nothing waits long."""
        if self.config.transport != "cuda-ipc":
            self._drain(0.0, link)
        with self._lock:
            self._pump()


class ControlledFrame:
    """A converted host frame (engine RGB, top-down) of a host that gives control frames, and its control
    frame (None: missing); `stacked()` is what a control ring's slot holds (the frame above the control)."""

    __slots__ = ("frame", "control")

    def __init__(self, frame: np.ndarray, control: np.ndarray | None) -> None:
        self.frame, self.control = frame, control

    def stacked(self) -> np.ndarray:
        return self.frame if self.control is None else np.concatenate([self.frame, self.control])


def reference_image(image: np.ndarray, layout: str = "rgb") -> np.ndarray:
    """A reference image as the wire carries it: uint8 RGB top-down, contiguous; ValueError names a bad one."""
    if layout not in formats.LAYOUTS:
        raise ValueError(f"layout: {layout!r} is not allowed; expected one of {formats.LAYOUTS}")
    image = formats.check_frame(formats.check_shape(np.asarray(image), "reference image"), "reference image")
    if max(image.shape[:2]) > MAX_REFERENCE_SIDE:
        raise ValueError(f"reference image: {image.shape[1]}x{image.shape[0]}; expected at most "
                         f"{MAX_REFERENCE_SIDE} px a side")
    rgb = formats.from_touchdesigner(image) if layout == "touchdesigner" else formats.to_engine(image)
    return np.ascontiguousarray(rgb)


def _frame_kind(spec: RingSpec) -> tuple[int, int, int, str]:
    """What a device frame's copy into a caller's buffer depends on."""
    return spec.width, spec.height, spec.channels, spec.dtype


def _close_parts(shrinker: FrameShrinker, sup: Supervisor, frames: NewestFrames, ctx: zmq.Context,
                 awake: CpuAwake | None) -> None:
    """A bridge's close, from its parts alone (it may run while the bridge is being collected, on whichever
    thread let go of it last: the parts' own threads never wait for themselves)."""
    shrinker.close()
    sup.stop()
    frames.close()
    ctx.term()
    if awake is not None:
        awake.close()


def _weakly(method: Callable[..., Any]) -> Callable[..., None]:
    """`method` called through a weak reference to its object: a thread holding it keeps no bridge alive."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)
    return call


__all__ = ["Bridge", "BridgeConfig", "BridgeStatus", "DeviceFrame", "EngineRefused", "RingSpec"]
