"""One connection to one engine instance: handshake, rings, slots, liveness, teardown.

A link has the control `Channel` (served by the bridge's loop thread) and a path for frame notices
and releases, used directly by whichever host thread moves frames: the shared-memory `Doorbell` on
shm and cuda-ipc (the engine is on this machine), the `FrameLane` socket on tcp; both are `lane`
here. A restart is a new `Link` (new sockets, new endpoints, new token, new doorbell, new rings),
so nothing from a dead engine (queued messages, half-written slots) can leak into the next one.
The bridge and the supervisor hold the engine lock while calling into a link, except for `teardown`,
which may wait for a process to exit.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np

from loom_live.host_bridge.config import BridgeConfig
from loom_live.host_bridge.launcher import EngineProcess
from loom_live.host_bridge.wire.channel import Channel, CurveClient, EndpointError, PrivateEndpoint, SharedSecret
from loom_live.host_bridge.wire.doorbell import Doorbell
from loom_live.host_bridge.wire.frame_lane import FrameLane, lane_endpoint_for
from loom_live.host_bridge.wire.handoff_marks import MARKS
from loom_live.host_bridge.wire.protocol import TRANSPORTS, make
from loom_live.host_bridge.wire.rings import Ring, SlotTracker, create_ring

# A served engine takes one host at a time and answers a hello that arrives while another host is
# attached only with `wait`. Connecting, the host says hello again this often until the engine answers,
# so that it gets in about this soon after the previous host's bye.
HELLO_RESEND_S = 1.0


class Link:
    def __init__(self, link_id: int, channel: Channel, lane: FrameLane | Doorbell | None, proc: EngineProcess | None,
                 endpoint: PrivateEndpoint | None, token: str | None, cfg: BridgeConfig, lock: threading.RLock,
                 curve: CurveClient | SharedSecret | None = None):
        self.id = link_id
        self.channel = channel
        # the doorbell, made with the link; or a lane bound here when we launched the engine, else
        # connected once the engine's hello names it
        self.lane = lane
        self.curve = curve
        self.proc = proc
        self.endpoint = endpoint
        self.token = token
        self.cfg = cfg
        self._lock = lock
        now = time.monotonic()
        self.phase = "hello"
        self.hello_deadline = now + cfg.handshake_timeout_s
        self.load_deadline = float("inf")
        self.last_heard = now
        self.last_beat = 0.0
        self.last_stats = 0.0
        self.last_hello: float | None = None  # when this host last said hello first (connecting)
        self.ready_at = float("inf")
        self.engine_busy_s = 0.0
        self.engine_pid: int | None = None
        self.lane_refused: str | None = None  # a served engine that cannot open the lane this host offers
        self.engine_info: dict[str, Any] = {}
        self.ring_in: Ring | None = None
        self.ring_out: Ring | None = None
        self.in_tracker: SlotTracker | None = None
        self.retired: list[Ring] = []
        self.generation = 0
        self.ring_requests: dict[int, int] = {}
        self.stats_requests: set[int] = set()
        self._request_ids = iter(range(1 << 40, 1 << 62))  # apart from the Bridge's own request ids

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else self.engine_pid

    @property
    def ready(self) -> bool:
        return self.phase == "running"

    @property
    def hello_done(self) -> bool:
        return self.phase != "hello"

    def heard(self) -> None:
        self.last_heard = time.monotonic()

    def send(self, msg: dict[str, Any], payload: list[Any] | tuple = ()) -> bool:
        return self.channel.send(msg, payload)

    def send_hello(self) -> None:
        doorbell = self.lane.name if isinstance(self.lane, Doorbell) else None
        lane = self.lane.endpoint if self.cfg.launch and doorbell is None else None
        secret = self.curve.secret if isinstance(self.curve, SharedSecret) else ""
        if not self.cfg.launch:  # we speak first: said again until the engine answers (maybe_heartbeat)
            self.last_hello = time.monotonic()
        self.send(make("hello", role="host", token=self.token or secret, pid=os.getpid(), transports=list(TRANSPORTS),
                       software="loom host_bridge", lane=lane, doorbell=doorbell))

    def waiting(self) -> None:
        """The served engine answered our hello with `wait`: it is there, and serves another host. No
        handshake timeout while it says so; the hellos go on (maybe_heartbeat)."""
        self.hello_deadline = time.monotonic() + self.cfg.handshake_timeout_s

    def on_hello(self, msg: dict[str, Any]) -> str | None:
        if self.phase != "hello":
            self.channel.refuse("second hello")
            return None
        if msg["role"] != "engine" or self.token is not None and msg["token"] != self.token:
            # another local process (a tcp endpoint on 127.0.0.1 is reachable by any): refused and counted,
            # never a reason to give up on the engine we launched
            self.channel.refuse(f"hello from a {msg['role']} without this engine's launch token")
            return None
        if self.cfg.transport not in msg.get("transports", []):
            return f"handshake: the engine does not offer transport {self.cfg.transport!r} ({msg.get('transports')})"
        self.engine_pid = msg["pid"]
        if self.cfg.launch:  # we bound, the engine spoke first: answer
            self.send_hello()
        elif self.lane is None:  # the engine bound: its hello names the lane
            if "lane" not in msg:
                return "handshake: the engine's hello names no frame lane (an engine of an older protocol?)"
            try:
                endpoint = lane_endpoint_for(self.channel.endpoint, msg["lane"])
                identity = msg["lane_id"].encode() if "lane_id" in msg else None  # the only peer its lane serves
                self.lane = FrameLane(self.channel.context, endpoint, bind=False, side="host", curve=self.curve,
                                      identity=identity)
            except (EndpointError, ValueError, OSError) as exc:  # zmq.ZMQError is an OSError
                return f"handshake: cannot connect the frame lane: {exc}"
        self.phase = "loading"
        self.load_deadline = time.monotonic() + self.cfg.load_timeout_s
        return None

    def on_ready(self, info: dict[str, Any]) -> None:
        self.phase = "running"
        self.engine_info = info
        self.ready_at = time.monotonic()

    def on_release(self, msg: dict[str, Any]) -> bool:
        if self.ring_in is None or msg["gen"] != self.ring_in.spec.generation:
            return True  # a slot of a retired ring: nothing to do
        return self.in_tracker.release(msg["slot"])

    # -- frames ---------------------------------------------------------------------------------------

    def write_frame(self, seq: int, frame: np.ndarray | None, staging: Any, t: float,
                    control: bool | None = None, control_staging: Any = None) -> bool:
        """Copy a frame (host array, or the cuda staging buffer when frame is None) into a free slot
        and publish it. False when no slot is free.

        `control` (VACE): True when the frame is stacked over its control frame (twice the rows, see
        `RingSpec.control`; on cuda-ipc the control frame is in `control_staging`), False when a host
        that gives control frames has none for this one (only the frame's half is written), None for a
        host that gives none. A control ring stays once made."""
        rows = self._ensure_rings(frame, staging, control)
        if control is False and self.ring_in.spec.control:
            frame = None if frame is None else _over_blank(frame, self.ring_in.spec, rows)
        slot = self.in_tracker.acquire()
        if slot is None:
            return False
        MARKS.mark(seq, "host.slot_copy")
        try:
            if frame is None:
                self._copy_staged(slot, staging, control_staging if control else None)
                payload: list[Any] = []
            else:
                payload = self.ring_in.write(slot, frame)
        except Exception:
            self.in_tracker.unacquire(slot)
            raise
        self.in_tracker.publish(slot)
        MARKS.mark(seq, "host.notice")
        self.lane.send_frame(slot, seq, self.generation, payload, control=bool(control))
        return True

    def _copy_staged(self, slot: int, staging: Any, control_staging: Any) -> None:
        """cuda-ipc: the staged frame into `slot`, into its half of a control ring's slot (`RingSpec.half_rows`),
        and the staged control frame into the other half when there is one. Queued, not waited for: the
        engine's read waits for the slot's event, the next staging write for this read (on the GPU)."""
        ring = self.ring_in
        if not ring.spec.control:
            staging.copy_to(0, ring, slot, wait=False)
            return
        frame_row, control_row = ring.spec.half_rows
        staging.copy_to(0, ring, slot, frame_row, wait=False)
        if control_staging is not None:
            control_staging.copy_to(0, ring, slot, control_row, wait=False)

    def release_output(self, slot: int, gen: int) -> None:
        self.lane.send_release(slot, gen)

    def _ensure_rings(self, frame: np.ndarray | None, staging: Any, control: bool | None = None) -> int:
        """Rings for this frame's kind (new ones, a new generation, when it changed); returns the rows
        of one frame. A frame given with its control frame has twice those rows."""
        if frame is None:
            s = staging.spec
            want = dict(width=s.width, height=s.height, channels=s.channels, dtype=s.dtype, order=s.order,
                        orientation=s.orientation)
            extra = dict(device=staging.device)
            if control:  # the staged frame, its control frame staged beside it: a slot holds both
                want["height"] *= 2
        else:
            h, w, c = frame.shape
            want = dict(width=w, height=h, channels=c, dtype=frame.dtype.name, order="RGB", orientation="top-down")
            extra = dict(encoding=self.cfg.encoding, jpeg_quality=self.cfg.jpeg_quality) \
                if self.cfg.transport == "tcp" else {}
        rows = want["height"] // 2 if control else want["height"]
        current = self.ring_in.spec if self.ring_in is not None else None
        if current is not None and control is False and current.control:  # a control ring stays: no frame lost
            want["height"] = 2 * rows
        if current is not None and all(getattr(current, k) == v for k, v in want.items()) \
                and current.control == (want["height"] != rows):
            return rows
        generation = self.generation + 1
        common = dict(slots=self.cfg.ring_slots, generation=generation, **want, **extra)
        rings: list[Ring] = []
        try:  # both ring messages are validated before the rings replace the old ones
            for direction in ("in", "out"):
                control_ring = direction == "in" and want["height"] != rows
                size = dict(height=rows) if direction == "out" else {}
                rings.append(create_ring(self.cfg.transport, direction, **{**common, **size, "control": control_ring}))
            messages = {next(self._request_ids): make("ring", spec=r.spec.to_dict()) for r in rings}
        except Exception as exc:
            for ring in rings:
                ring.close()
            raise ValueError(f"frame {want['width']}x{want['height']} {want['dtype']}: no ring for it ({exc})") \
                from None
        if self.ring_in is not None:
            self.retired += [self.ring_in, self.ring_out]
        self.generation = generation
        self.ring_in, self.ring_out = rings
        self.in_tracker = SlotTracker(self.cfg.ring_slots)
        for rid, msg in messages.items():
            self.ring_requests[rid] = generation
            self.send({**msg, "id": rid})
        return rows

    def retire_older(self, generation: int) -> None:
        """The engine attached generation `generation`: older rings can go."""
        keep = []
        for ring in self.retired:
            if ring.spec.generation < generation:
                ring.close()
            else:
                keep.append(ring)
        self.retired = keep

    # -- liveness ------------------------------------------------------------------------------------

    def known_alive(self, heard_s: float) -> bool:
        """Whether the engine is running as far as this side can tell: its process (when we launched it) has not
        exited, and it last spoke `heard_s` ago (the caller's one reading of `last_heard`, which a heartbeat may
        move meanwhile), within the hang timeout. Its frames are fresh only then."""
        return self.phase == "running" and (self.proc is None or self.proc.alive) \
            and 0.0 <= heard_s <= self.cfg.hang_timeout_s

    def check(self, now: float) -> str | None:
        """A reason to give up on this engine, or None."""
        if self.proc is not None and not self.proc.alive:
            return self.proc.ending()
        refused = self.credentials_refused()
        if refused:
            return refused
        if self.phase == "hello":
            if now > self.hello_deadline:
                return f"no handshake from the engine within {self.cfg.handshake_timeout_s:.1f} s"
            return None
        silent = now - self.last_heard
        loading = self.phase == "loading"
        if silent > (self.cfg.loading_hang_timeout_s if loading else self.cfg.hang_timeout_s):
            return f"engine silent for {silent:.1f} s{' while loading' if loading else ''} (hung or unreachable)"
        if self.phase == "loading" and now > self.load_deadline:
            return f"engine not ready within {self.cfg.load_timeout_s:.0f} s"
        return None

    def maybe_heartbeat(self, now: float) -> None:
        """A heartbeat when one is due; before the engine's hello, a connecting host's hello again."""
        if self.phase == "hello":
            if self.last_hello is not None and now - self.last_hello >= HELLO_RESEND_S:
                self.send_hello()
            return
        if now - self.last_beat >= self.cfg.heartbeat_s:
            self.last_beat = now
            self.send(make("heartbeat", t=time.time()))

    def request_stats(self, rid: int) -> None:
        self.last_stats = time.monotonic()
        self.stats_requests.add(rid)
        if len(self.stats_requests) > 16:
            self.stats_requests.pop()
        self.send(make("stats", id=rid))

    def segment_names(self) -> list[str]:
        """Shared-memory segments this link owns (shm rings, the doorbell), for diagnostics and tests."""
        rings = [r for r in (self.ring_in, self.ring_out, *self.retired) if r is not None]
        doorbell = [self.lane.name] if isinstance(self.lane, Doorbell) else []
        return [h for r in rings if r.spec.transport == "shm" for h in r.spec.handles] + doorbell

    @property
    def refused(self) -> int:
        return self.channel.refused + (self.lane.refused if self.lane else 0)

    @property
    def last_refusal(self) -> str:
        lane = self.lane
        return lane.last_refusal if lane and lane.refused_at > self.channel.refused_at else self.channel.last_refusal

    def message_counts(self) -> dict[str, int]:
        """Messages through the control channel (these do not grow per frame) and notices through the
        frame path (`lane_*`: the lane's messages or the doorbell's records)."""
        lane = self.lane
        return {"control_sent": self.channel.sent, "control_received": self.channel.received,
                "lane_sent": lane.sent if lane else 0, "lane_received": lane.received if lane else 0}

    def log_tail(self, named: str = "") -> list[str]:
        """The launched engine's last lines; with `named` ("engine", "standby engine") each begins with that and
        the pid, for a tail that shows two engines' lines together."""
        lines = self.proc.log_tail() if self.proc else []
        return [f"[{named} pid {self.pid}] {line}" for line in lines] if named else lines

    def refusal(self) -> str | None:
        """Why no engine will take this run, so that none is tried again, else None: the launched engine's
        own error when it exited refusing its run (exit code 2), or a served engine's refusal of this
        host's credentials."""
        if self.lane_refused is not None:
            return self.lane_refused
        return self.proc.refusal() if self.proc is not None else self.credentials_refused()

    def refuse_lane(self, message: str) -> str:
        """A served engine answered this host's hello saying it cannot open the frame lane offered: the
        same hello will get the same answer, so no engine takes this run. Shared memory (shm's and
        cuda-ipc's doorbell) only reaches an engine on this machine, outside any other container."""
        hint = "" if self.cfg.transport == "tcp" else (
            f"; transport {self.cfg.transport!r} shares memory with the engine, which an engine on another "
            "machine or in another container cannot reach: use transport 'tcp' for it")
        self.lane_refused = f"the engine at {self.channel.endpoint} cannot open this host's frame lane " \
                            f"({message}){hint}"
        return self.lane_refused

    def credentials_refused(self) -> str | None:
        """What to fix when the engine turned this host's session secret or CurveZMQ keys down, else None."""
        refusal = self.channel.handshake_refusal
        if refusal is None:
            return None
        at = f"the engine at {self.channel.endpoint}"
        if isinstance(self.curve, SharedSecret):
            what = "session secret"
            refused = "is the secret file given to this host the one its `loom serve --secret-file` uses?"
            broken = "was it served with `--secret-file`?"
        else:
            what = "CurveZMQ keys"
            refused = "is the public key of curve_secret_file in the folder its `loom serve --curve-authorized` names?"
            broken = ("is curve_server_public_file the engine's public key, and was it served with "
                      "`--curve-secret-file`?")
        if refusal.kind == "credentials":
            return f"{at} refused this host's {what} ({refused})"
        if refusal.kind == "mechanism":
            return (f"{at} does not take a host's {what}: it was served with another kind of security "
                    "(`loom serve --secret-file`: a session secret; `--curve-secret-file`: CurveZMQ keys)")
        return f"{at} broke off the handshake with this host's {what} ({refusal.detail}; {broken})"

    # -- teardown ------------------------------------------------------------------------------------

    def say_bye(self) -> None:
        try:
            self.send(make("bye", reason="host closing"))
            self.channel.poll(0)  # flush the outbox now: the loop thread is gone
        except Exception:
            pass

    def teardown(self, reason: str, timeout_s: float) -> None:
        """Stop the engine (bye, then terminate, wait, kill the tree) and remove everything we own."""
        if reason == "closed":
            self.say_bye()
        if self.proc is not None:
            if reason == "closed":
                deadline = time.monotonic() + timeout_s
                while self.proc.alive and time.monotonic() < deadline:
                    time.sleep(0.01)
            self.proc.stop(timeout_s)
        self.channel.close()
        if self.lane is not None:
            self.lane.close()  # waits for a host thread that may be polling it (it is woken first); the
            # doorbell's segment is removed with it
        with self._lock:
            rings = [r for r in (self.ring_in, self.ring_out, *self.retired) if r is not None]
            self.ring_in = self.ring_out = None
            self.retired = []
        for ring in rings:
            ring.close()
        if self.endpoint is not None:
            self.endpoint.remove()


def _over_blank(frame: np.ndarray, spec: Any, rows: int) -> np.ndarray:
    """A frame without its control frame, as a control ring's slot holds it: the frame where the engine
    reads it (`RingSpec.half_rows`), zeros in the control half (not read: the notice says so)."""
    slot = np.zeros((2 * rows, *frame.shape[1:]), frame.dtype)
    first = spec.half_rows[0]
    slot[first:first + rows] = frame
    return slot
