"""The engine server's compute side: one thread that owns the session and moves frames.

It owns the path of frame notices for as long as it runs (the host's shared-memory doorbell, or on
tcp the frame lane socket; both are `lane` here): it polls it itself for input frame notices and
output slot releases, and sends output notices and input releases on it, so a frame costs one
record (or one ZMQ hop) each way and no thread hand-off. It takes input frames from the attached
input ring (live: up to LIVE_WAITING wait, in order; one more means the session is behind, and then
only the newest is kept, the others released unread and counted as dropped; lossless: every one, in
order), pushes them through the session, and writes outputs into free output slots. Live lets a few
wait because a session restyles in chunks of frames: while the frame that completes a chunk is being
restyled the next ones arrive, and with only the newest kept, all but one of them would be lost
although the session keeps up on average; a session that does not keep up gets the newest frame, as
before, rather than a queue of old ones.
A session emits outputs in bursts (a chunk of 4 frames at a time), so in live mode outputs are
paced out at the measured input frame interval; otherwise a latest-wins host would only ever see
the last frame of each chunk. Each output gets its time when it is queued, one interval after the
one before (at once when that time has passed), and keeps it: an emit that comes late because the
loop was busy with the next chunk does not push the later ones back, so the outputs leave at the
rate the frames come in and no backlog (lag, then dropped outputs) builds up behind a busy session.
On cuda-ipc an output's copy into its slot is only queued on the GPU; its notice goes once the copy is
done, looked at between frames and in the session's waits, so neither the worker nor a host that waits
for its reads ever waits for the engine's copy behind the model's work.

Everything else arrives through the server's control loop as commands (rings, mode, prompt,
parameters, reset, flush); `post()` queues one and wakes the lane's poll, and the answer (ack,
flushed, error) goes back on the control channel. The session is only touched by this thread.
Rings travel on the control channel and frame notices on the doorbell or lane, so a notice may
arrive before the ring of its generation: it waits (bounded by the slots) until that ring is installed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from loom_live.engine.server.worker_time import WorkerTime
from loom_live.engine.session_api import EngineSession
from loom_live.engine.startup_progress import STARTUP_PROGRESS
from loom_live.host_bridge.wire import pixels as formats
from loom_live.host_bridge.wire.doorbell import Doorbell
from loom_live.host_bridge.wire.frame_lane import FrameLane
from loom_live.host_bridge.wire.handoff_marks import MARKS
from loom_live.host_bridge.wire.protocol import MAX_SLOTS, make
from loom_live.host_bridge.wire.rings import Ring, SlotTracker

PACED_QUEUE_LIMIT = 16  # outputs waiting for their turn in live mode; beyond it the oldest go
INTERVAL_EMA = 0.2
LIVE_WAITING = 3  # live: unread frames that wait, oldest first; one more finds the session behind
PACE = 0.95  # outputs leave at this fraction of the input interval: a little ahead, never behind
MAX_PACE_S = 0.1  # ...of an interval of at most this: a slow or paused host is not paced at its gaps
WAIT_S = 0.02
ERROR_REPEAT_S = 1.0  # the same frame error is reported again at most this often
STATS_REFRESH_S = 0.25  # session stats (percentiles over a window) are recomputed at most this often
FLUSH_WAIT_S = 2.0  # a flush waits at most this long for the frame notice it names (the frames go on meanwhile)
FLUSH_WAIT_PERIODS = 2  # ...and no longer than this many input frame periods
FLUSH_MIN_WAIT_S = 0.5  # ...or this, for notices a loaded machine delivers late
OUTPUT_POLL_S = 0.001  # while a GPU session still runs a chunk, look for its frames this often

log = logging.getLogger(__name__)


class FrameWorker:
    def __init__(self, session_factory: Callable[[], EngineSession], send: Callable[..., bool],
                 lane: FrameLane | Doorbell,
                 stall_after: int | None = None, start: dict[str, Any] | None = None):
        self._factory = session_factory
        self._send = send  # the control channel (thread-safe)
        self.lane = lane
        self.session: EngineSession | None = None
        self.lock = threading.Lock()  # ring access: this thread reads/writes slots, the server closes rings
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.ring_in: Ring | None = None
        self.ring_out: Ring | None = None
        self.out_tracker: SlotTracker | None = None
        # (slot, seq, gen, payload, control: the slot holds the frame's control frame too)
        self.inputs: deque[tuple[int, int, int, list[bytes], bool]] = deque()
        self.lossless = False
        self.stop = False
        self.busy_since: float | None = None
        self.error: str | None = None
        self.refusal = ""  # the session could not be built from its inputs (CheckpointError, ConfigError, ...)
        self._stall_after = stall_after
        # the ready info's "start": the prompt and live parameters the session starts on (its config's), so
        # that a host can go back to them, and its model family (`LoomConfig.start_settings`); None: not said
        self._start = start
        self._last_in_seq = -1
        self._seqs: deque[int] = deque()
        self._paced: deque[tuple[int, Any, float]] = deque()  # (seq, frame, when due); numpy, or GPU tensors
        # outputs written into their slots whose notices wait for the copy to be done: (slot, seq, ring, payload)
        self._written: deque[tuple[int, int, Ring, list[Any]]] = deque()
        self._last_due = 0.0
        self._interval = 0.0
        self._last_arrival: float | None = None
        # dropped_out is the sum of its two causes: no output slot free (the host reads slowly), or the paced
        # queue full (the engine made frames faster than their pace lets them leave); out_late: paced outputs
        # that left over a pace step after they fell due (the worker was held elsewhere, so they left together)
        self.counts = dict(frames_in=0, frames_out=0, dropped=0, dropped_out=0, dropped_out_no_slot=0,
                           dropped_out_behind=0, out_late=0, stale=0, errors=0, new_streams=0)
        self.time = WorkerTime()
        self._error_sent = 0.0
        self.session_stats: dict[str, Any] = {}
        self._stats_at = 0.0
        self._device_slots: Any = None
        self._flush_due: tuple[int | None, int, float] | None = None  # a flush waiting for its notice: (id, seq, by)
        self._waiting_failure: Exception | None = None  # raised by `_while_waiting`, for the loop to raise
        self.thread = threading.Thread(target=self._run, name="loom-engine-worker", daemon=True)

    # -- called by the server's control thread --------------------------------------------------------

    def post(self, kind: str, msg: dict[str, Any], ring: Ring | None = None) -> None:
        """Queue a command (ring, mode, prompt, params, reset, flush) and wake the worker's poll."""
        self.commands.put((kind, msg, ring))
        self.lane.wake()

    def halt(self, timeout_s: float) -> bool:
        """Ask the thread to stop, wake it, wait for it. False when it is still busy in a session call."""
        self.stop = True
        self.lane.wake()
        self.thread.join(timeout=timeout_s)
        return not self.thread.is_alive()

    def close_rings(self, remove: bool) -> None:
        """Let go of the rings, also those attached but not installed yet (remove: the host is gone)."""
        rings = [self.ring_in, self.ring_out]
        while True:
            try:
                rings.append(self.commands.get_nowait()[2])
            except queue.Empty:
                break
        with self.lock:
            for ring in rings:
                if ring is not None:
                    ring.remove() if remove else ring.close()
            self.ring_in = self.ring_out = None

    # -- the worker thread: frames from the lane ------------------------------------------------------

    def _read_lane(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for lane messages (or a wake-up) and take them in."""
        if not self.lane.acquire(timeout_s=max(timeout_s, WAIT_S)):
            return
        try:
            messages = self.lane.receive(timeout_s)
        finally:
            self.lane.release()
        for msg, payload in messages:
            try:
                self._take_notice(msg, payload)
            except Exception as exc:  # an odd notice is refused and counted; the worker goes on
                self.lane.refuse(f"{msg['type']} notice: {type(exc).__name__}: {exc}")

    def _take_notice(self, msg: dict[str, Any], payload: list[bytes]) -> None:
        if msg["type"] == "frame":
            MARKS.mark(msg["seq"], "engine.notice")
            if len(self.inputs) >= MAX_SLOTS:
                self.lane.refuse(f"frame notice for slot {msg['slot']}: more notices waiting than a ring has slots")
                return
            self._last_in_seq = max(self._last_in_seq, msg["seq"])
            self._offer(msg["slot"], msg["seq"], msg["gen"], payload, msg.get("control", False))
        elif not self._on_release(msg["slot"], msg["gen"]):
            self.lane.refuse(f"release of output slot {msg['slot']} that was not published")

    def _offer(self, slot: int, seq: int, gen: int, payload: list[bytes], control: bool = False) -> None:
        """A new input frame notice."""
        now = time.monotonic()
        if self._last_arrival is not None:
            dt = now - self._last_arrival
            self._interval = dt if self._interval == 0 else (1 - INTERVAL_EMA) * self._interval + INTERVAL_EMA * dt
        self._last_arrival = now
        if not self.lossless and len(self.inputs) >= LIVE_WAITING:  # behind: the newest wins, the rest go back
            while self.inputs:
                old = self.inputs.popleft()
                self._release_in(old[0], old[2], dropped=True)
                self.counts["dropped"] += 1
        self.inputs.append((slot, seq, gen, payload, control))

    def _on_release(self, slot: int, gen: int) -> bool:
        if self.ring_out is None or gen != self.ring_out.spec.generation:
            return True  # an old generation's slot
        return self.out_tracker.release(slot)

    def _install(self, ring: Ring) -> None:
        with self.lock:
            if ring.spec.dir == "in":
                if self.ring_in is not None:
                    self.ring_in.close()
                self.ring_in = ring
            else:
                if self.ring_out is not None:
                    self.ring_out.close()
                self.ring_out = ring
                self.out_tracker = SlotTracker(ring.spec.slots)

    # -- the worker thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        self._send(make("status", state="loading", message="building the session (loading weights)"))
        try:
            with STARTUP_PROGRESS.to(lambda text: self._send(make("status", state="loading", message=text))):
                self.session = self._factory()
        except Exception as exc:  # any failure to build is reported, then the server exits
            self.error = f"session could not be built: {type(exc).__name__}: {exc}"
            if isinstance(exc, ValueError | FileNotFoundError):  # its inputs (a config, a weights file): a refusal
                self.refusal = str(exc).splitlines()[0] if str(exc) else self.error
            log.error("%s", self.error)
            self._send(make("status", state="error", message=self.error[:4000]))
            return
        self.session.while_waiting(self._while_waiting)
        try:  # what the session starts with (its prompt's style) is known from the first stats answer on
            self.session_stats = self.session.stats()
        except Exception as exc:  # telemetry: never a reason not to serve
            log.warning("the session's first stats failed: %s: %s", type(exc).__name__, exc)
        info: dict[str, Any] = {"session": type(self.session).__name__}
        if self._start is not None:
            info["start"] = self._start
        self._send(make("ready", info=info))
        log.info("%s ready", type(self.session).__name__)
        try:
            while not self.stop:
                if (self._flush_due is None or self._flush_ready()) and not self.stop:
                    self._run_commands()  # in order: none overtakes a flush still waiting for its notice
                if self.stop:  # halted, or the session failed beyond repair (then it is gone)
                    break
                ready = self._next_input(take=False) is not None
                self._read_lane(0.0 if ready else self._wait_time())
                job = self._next_input()
                if job is not None:
                    self._process(*job)
                elif self.session.unfinished:
                    with self.time.session():
                        outputs = self.session.poll()
                    self._take_outputs(outputs)
                self._raise_waiting_failure()
                self._emit_due()
        except Exception as exc:  # outside any one frame (collecting a chunk, say): the server exits and
            # the host's supervisor starts a fresh engine, rather than heartbeats hiding an engine taking no frames
            self.error = f"the frame worker failed: {type(exc).__name__}: {exc}"
            self._send(make("status", state="error", message=self.error[:4000]))
        finally:
            self._close_session()

    def _close_session(self) -> None:
        """Release the session's devices and processes, on this thread (never under a call still running):
        a served engine builds a session per host, and a pipeline's ranks and process group must be gone
        before the next host's session can start its own."""
        session, self.session = self.session, None
        if session is None:
            return
        try:
            session.close()
        except Exception as exc:  # a session that failed may not close cleanly: said, never raised
            log.warning("the session did not close cleanly: %s: %s", type(exc).__name__, exc)

    def _run_commands(self) -> None:
        while True:
            try:
                kind, msg, ring = self.commands.get_nowait()
            except queue.Empty:
                return
            rid = msg.get("id")
            try:
                if kind == "ring":
                    self._install(ring)
                elif kind == "mode":
                    self.lossless = msg["lossless"]
                elif kind == "prompt":
                    self.session.set_prompt(msg["text"], msg.get("transition_chunks"))
                elif kind == "params":
                    self.session.set_params(**msg["params"])
                elif kind == "reference":
                    self.session.set_reference(_reference(msg))
                elif kind == "reset":
                    self._drop_waiting_inputs()
                    self.session.reset()
                    self._seqs.clear()
                    self._paced.clear()
                elif kind == "flush":
                    if self._defer_flush(rid, msg.get("seq")):
                        return
                    self._send(make("flushed", id=rid, count=self._flush()))
                    continue
                if rid is not None:  # nobody waits for an id-less request's answer
                    self._send(make("ack", id=rid))
                if kind in ("prompt", "params", "reset", "reference"):
                    self.session_stats = self.session.stats()
            except Exception as exc:
                self._command_failed(kind, rid, exc)
                if self.stop:
                    return

    def _command_failed(self, kind: str, rid: int | None, exc: Exception) -> None:
        """Answer a command that raised: a refused request (ValueError, ...) with its error alone; one that
        failed inside the session with its error, then a new stream."""
        if isinstance(exc, ValueError | TypeError | KeyError):
            self._send(make("error", id=rid, code=kind, message=str(exc)[:4000]))
            return
        text = f"{type(exc).__name__}: {exc}"
        self._send(make("error", id=rid, code=kind, message=text[:4000]))
        log.warning("%s failed in the session, starting a new stream: %s", kind, text)
        self._new_stream(text)

    def _drop_waiting_inputs(self) -> None:
        """Frames the host sent before a reset belong to the stream it ends (a cancelled batch, say): a
        busy worker may not have taken them yet, and pushed after the reset they would open the new
        stream. Their notices, those still on the lane included, are released as dropped."""
        self._read_lane(0.0)
        while self.inputs:
            slot, _, gen, _, _ = self.inputs.popleft()
            self._release_in(slot, gen, dropped=True)
            self.counts["dropped"] += 1

    def _next_input(self, take: bool = True) -> tuple | None:
        """The oldest input that can be processed now (peek with take=False). Notices of an older
        generation are released as stale on the way; one of a newer generation waits for its rings."""
        stalled = self._stall_after is not None and self.counts["frames_in"] >= self._stall_after
        while self.inputs and not stalled:
            slot, seq, gen, payload, control = self.inputs[0]
            ring, out = self.ring_in, self.ring_out
            if ring is None or out is None or gen > ring.spec.generation or gen > out.spec.generation:
                return None  # its rings are still on their way over the control channel
            if gen < ring.spec.generation:
                self.inputs.popleft()
                self.counts["stale"] += 1
                self._release_in(slot, gen, dropped=True)
                continue
            if slot >= ring.spec.slots or (ring.spec.transport == "tcp") != bool(payload) \
                    or control and not ring.spec.control:
                self.inputs.popleft()
                self.lane.refuse(f"frame notice for slot {slot} does not fit the ring"
                                 + (" (a control frame on a ring without control frames)" if control else ""))
                continue
            if take:
                self.inputs.popleft()
            return ring, slot, seq, gen, payload, control
        return None

    def _wait_time(self) -> float:
        wait = OUTPUT_POLL_S if self.session.unfinished or self._written else WAIT_S
        if self._paced:
            return max(0.0, min(wait, self._paced[0][2] - time.monotonic()))
        return wait

    def _process(self, ring: Ring, slot: int, seq: int, gen: int, payload: list[bytes], control: bool = False) -> None:
        self.busy_since = time.monotonic()
        released = False  # an input slot not handed back is a credit the host never gets again
        try:
            if self.session.raw_passthrough and self._raw_copy(ring, slot, seq):
                return
            on_gpu = ring.on_device
            with self.lock:
                if ring is not self.ring_in:
                    self.counts["stale"] += 1
                    return
                with self.time.part("read"):
                    native = self._gpu().read(ring, slot) if on_gpu else ring.read(slot, payload)
            self._release_in(slot, gen)
            released = True
            spec = ring.spec
            if not on_gpu:
                batch = formats.to_engine(native, order=spec.order, bottom_up=spec.orientation == "bottom-up")[None]
            elif self.session.accepts_device_frames:
                batch = native[None]  # stays on the GPU
            else:
                batch = native[None].cpu().numpy()
            given = None
            if spec.control:  # the frame above, its control frame below (engine orientation)
                rows = spec.frame_height
                batch, given = batch[:, :rows], (batch[:, rows:] if control else None)
            with self.time.session():
                outputs = self.session.push(batch, control=given) if spec.control else self.session.push(batch)
            self.counts["frames_in"] += 1
            self._seqs.append(seq)
            self._take_outputs(outputs)
            if time.monotonic() - self._stats_at > STATS_REFRESH_S:  # not per frame: off the hot path
                self.session_stats = self.session.stats()
                self._stats_at = time.monotonic()
        except Exception as exc:  # report and keep serving: one bad frame must not kill the stream
            self.counts["errors"] += 1
            text = f"{type(exc).__name__}: {exc}"
            now = time.monotonic()
            if text != self.error or now - self._error_sent > ERROR_REPEAT_S:  # no flood at frame rate
                self._error_sent = now
                self._send(make("error", code="frame", message=text[:4000]))
                log.warning("frame %d: %s", seq, text)
            self.error = text
            if not released and ring is self.ring_in:  # unreadable (a payload that does not fit, a bad JPEG)
                self._release_in(slot, gen, dropped=True)
            if not isinstance(exc, ValueError):  # a refused input leaves the stream as it was
                self._new_stream(text)
        finally:
            self.busy_since = None

    def _new_stream(self, failure: str) -> None:
        """A failure inside the session (out of GPU memory, say) leaves its caches half updated and
        the frames it had taken without an answer: start a new stream rather than restyle from that
        state, or pair outputs with the wrong inputs. A session that cannot even do that is gone:
        the server exits, and the host's supervisor starts a fresh engine."""
        self._seqs.clear()
        try:
            self.session.reset()
        except Exception as exc:
            self.error = (f"the session failed ({failure}) and could not start a new stream: "
                          f"{type(exc).__name__}: {exc}")
            self._send(make("status", state="error", message=self.error[:4000]))
            log.error("%s", self.error)
            self._close_session()
            self.stop = True
            return
        self.counts["new_streams"] += 1

    def _take_outputs(self, outputs: Any) -> None:
        """Outputs come in input order, each paired with the seq of the input frame it answers."""
        for out in outputs:
            self._queue_output(self._seqs.popleft() if self._seqs else -1, out)

    def _gpu(self) -> Any:
        """GPU slot reader/writer (torch), created on first use: only cuda-ipc rings need it."""
        if self._device_slots is None:
            from loom_live.engine.server.device_frames import DeviceSlots
            self._device_slots = DeviceSlots()
        return self._device_slots

    def _raw_copy(self, ring: Ring, slot: int, seq: int) -> bool:
        """Pass-through: slot to slot, no frame array (rings of one layout: cuda-ipc on the GPU, or shm)."""
        out = self.ring_out
        if not ring.copies_slots or out is None or type(out) is not type(ring) \
                or _layout(out.spec) != _layout(ring.spec):
            return False
        out_slot = self._acquire_out()
        if out_slot is None:  # stopping, or (live) no free output slot: the frame is dropped
            self._release_in(slot, ring.spec.generation, dropped=True)
            return True
        with self.lock:
            if ring is not self.ring_in or out is not self.ring_out:
                return True
            MARKS.mark(seq, "engine.copy")
            ring.copy_to(slot, out, out_slot, wait=False)  # the host's read waits for it on the GPU
        self.counts["frames_in"] += 1
        MARKS.mark(seq, "engine.publish")
        self._publish(out_slot, seq, out, [])  # first: the host is waiting for this one
        MARKS.mark(seq, "engine.release")
        with self.lock:  # the input slot is handed back only once read (a closed ring waited as it closed)
            if out is self.ring_out:
                out.wait_writes()
        self._release_in(slot, ring.spec.generation)
        MARKS.mark(seq, "engine.done")
        return True

    def _while_waiting(self) -> None:
        """Called by the session, on this thread, while a push or poll waits for the GPU (up to a chunk's time):
        the host's releases and notices are taken and the outputs that fall due go out at their times, not in
        a burst once the call returns (a host that shows one frame per refresh would see only its last). A
        failure here is kept and raised by the loop once the session's call is over, as there."""
        if self._waiting_failure is not None or self.stop:
            return
        self.time.look()
        try:
            self._read_lane(0.0)
            self._emit_due()
        except Exception as exc:
            self._waiting_failure = exc

    def _raise_waiting_failure(self) -> None:
        failure, self._waiting_failure = self._waiting_failure, None
        if failure is not None:
            raise failure

    def _queue_output(self, seq: int, frame: np.ndarray) -> None:
        if self.lossless:
            self._emit(seq, frame)
            return
        if len(self._paced) >= PACED_QUEUE_LIMIT:
            self._paced.popleft()
            self._drop_out("behind")
        now, step = time.monotonic(), min(self._interval, MAX_PACE_S) * PACE
        self._last_due = max(now, min(self._last_due + step, now + len(self._paced) * step))
        self._paced.append((seq, frame, self._last_due))

    def _drop_out(self, cause: str) -> None:
        self.counts["dropped_out"] += 1
        self.counts[f"dropped_out_{cause}"] += 1

    def _emit_due(self) -> None:
        step = min(self._interval, MAX_PACE_S) * PACE
        while self._paced and ((now := time.monotonic()) >= self._paced[0][2] or self.lossless):
            seq, frame, due = self._paced.popleft()
            if now - due > step > 0.0:
                self.counts["out_late"] += 1
            self._emit(seq, frame)
        self._publish_written()

    def _defer_flush(self, rid: int | None, until_seq: int | None) -> bool:
        """A flush that names a frame notice not yet here waits for it without holding up the frames: the
        loop goes on and finishes the flush when the notice comes or after a frame period or two (a host
        that names a frame it never sends parks nothing). True when deferred."""
        if until_seq is None or self._last_in_seq >= until_seq:
            return False
        wait = min(FLUSH_WAIT_S, max(FLUSH_MIN_WAIT_S, FLUSH_WAIT_PERIODS * self._interval))
        self._flush_due = (rid, until_seq, time.monotonic() + wait)
        return True

    def _flush_ready(self) -> bool:
        """Finish the waiting flush if its notice came or its time is up; True when none waits any more."""
        rid, until_seq, by = self._flush_due
        if self._last_in_seq < until_seq and time.monotonic() < by and not self.stop:
            return False
        if self._last_in_seq < until_seq:
            log.warning("flush %s: frame notice %d did not come; flushed what came", rid, until_seq)
        self._flush_due = None
        try:  # answered as a flush that was not deferred is: a failure ends the stream, never the worker
            self._send(make("flushed", id=rid, count=self._flush()))
        except Exception as exc:
            self._command_failed("flush", rid, exc)
        return True

    def _flush(self) -> int:
        """Everything taken before the flush goes through first, then the session's tail. Frames whose notices
        come meanwhile (the session's waits read the lane, `_while_waiting`) belong after it and wait."""
        last = self._last_in_seq
        while not self.stop and (job := self._next_input(take=False)) is not None and job[2] <= last:
            self._process(*self._next_input())
        while self._paced:
            self._emit(*self._paced.popleft()[:2])
        if self.session is None:  # it failed beyond repair on the way: the server is exiting
            return 0
        outputs = self.session.flush()
        for out in outputs:
            self._emit(self._seqs.popleft() if self._seqs else -1, out)
        while self._written and not self.stop:  # every notice out before the answer
            self._publish_written()
            if self._written:
                time.sleep(OUTPUT_POLL_S)
        self.session_stats = self.session.stats()  # a batch host looks at the stats between batches
        return len(outputs)

    def _acquire_out(self) -> int | None:
        """A free output slot; in lossless mode wait (reading the lane) for the host to release one. Live, the
        lane is looked at once before a frame is dropped: after a long session call the host's releases of the
        slots it has read wait there unread, and the paced frames that fell due meanwhile go out back to back."""
        looked = False
        while not self.stop:
            if self.out_tracker is not None:
                slot = self.out_tracker.acquire()
                if slot is not None:
                    return slot
            if not self.lossless and looked:
                self._drop_out("no_slot")
                return None
            self._publish_written()  # a host releases only the slots it was told about
            self._read_lane(WAIT_S if self.lossless else 0.0)
            looked = True
        return None

    def _emit(self, seq: int, frame: np.ndarray) -> None:
        with self.time.part("emit"):
            self._write_out(seq, frame)

    def _write_out(self, seq: int, frame: np.ndarray) -> None:
        out = self.ring_out
        if out is None:
            return
        slot = self._acquire_out()
        if slot is None:
            return
        on_gpu = out.on_device
        fitted = frame if on_gpu else _fit(np.asarray(frame if isinstance(frame, np.ndarray) else frame.cpu()), out)
        with self.lock:
            if out is not self.ring_out:
                return
            try:
                with self.time.part("write"):
                    if on_gpu:
                        self._gpu().write(out, slot, fitted)
                        payload = []
                    else:
                        payload = out.write(slot, fitted)
            except Exception:
                self.out_tracker.unacquire(slot)
                raise
        self._written.append((slot, seq, out, payload))
        self._publish_written()

    def _publish_written(self) -> None:
        """Notices, in order, for the outputs whose writes are done. A cuda-ipc write is only queued on the GPU
        (`DeviceSlots.write`): announced before its copy is done, a host that waits for its reads (a
        TouchDesigner build whose calls take no stream) would wait for the engine's copy behind the model's
        work; looked at here without waiting, the worker is never held by it either."""
        while self._written:
            slot, seq, ring, payload = self._written[0]
            with self.lock:  # the control thread may close the ring meanwhile
                current = ring is self.ring_out
                if current and not ring.write_done(slot):
                    return
            self._written.popleft()
            if current:  # else a new generation came: the old slots are gone, and so is this frame
                self._publish(slot, seq, ring, payload)

    def _publish(self, slot: int, seq: int, out: Ring, payload: list[Any]) -> None:
        self.out_tracker.publish(slot)
        self.counts["frames_out"] += 1
        self.lane.send_frame(slot, max(seq, 0), out.spec.generation, payload)

    def _release_in(self, slot: int, gen: int, dropped: bool = False) -> None:
        self.lane.send_release(slot, gen, dropped)


def _reference(msg: dict[str, Any]) -> np.ndarray | None:
    """A reference command's image as uint8 RGB [H, W, 3] (its size was checked against the bytes), or None."""
    if msg.get("clear") or msg.get("image") is None:
        return None
    return np.frombuffer(msg["image"], np.uint8).reshape(msg["height"], msg["width"], 3).copy()


def _layout(spec: Any) -> tuple:
    return spec.width, spec.height, spec.channels, spec.dtype, spec.order, spec.orientation, spec.pitch


def _fit(frame: np.ndarray, ring: Ring) -> np.ndarray:
    """An engine frame (uint8 RGB top-down) in the output ring's size and layout."""
    spec = ring.spec
    if frame.shape[:2] != (spec.height, spec.width):
        import cv2
        frame = cv2.resize(frame, (spec.width, spec.height), interpolation=cv2.INTER_AREA)
    return formats.from_engine(frame, channels=spec.channels, dtype=spec.dtype, order=spec.order,
                               bottom_up=spec.orientation == "bottom-up")
