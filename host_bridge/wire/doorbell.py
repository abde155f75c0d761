"""The doorbell: frame notices and slot releases through shared memory, for an engine on this machine.

Why: with the shm and cuda-ipc rings both processes share memory anyway, and a notice sent through a
ZMQ socket (JSON, a socket hop, a kernel wake-up of the other side, each way, per frame and per
release) cost more than the frame copies. Here a notice is a 64-byte record in a segment both map,
and the reader finds it behind a counter it sleeps on (see Waiting). tcp links keep the `FrameLane`; this class has the
lane's interface (`send_frame`, `send_release`, `receive`, `lock`, `wake`, counters), so the threads
that move frames use either one the same way.

Layout: one segment per link, created by the host (named and removed like the ring segments, mode
0600: see `transport_shm`), named in the host's hello. A header, then two single-producer,
single-consumer record rings: the host's (input frame notices, output slot releases) and the engine's
(output frame notices, input slot releases). Each ring has a `published` counter written only by its
producer and a `consumed` counter written only by its consumer, each on a cache line of its own, then
CAPACITY records. Every field is a native-endian uint64 written with one aligned store, so no counter
is ever seen half-written.

Memory ordering: the producer writes a record's body (kind, slot, flags, seq, generation, time,
checksum), then its stamp (index + 1), then advances `published`. On x86 stores become visible in
that order, so a reader that sees the counter sees the record. ARM (Apple silicon) may show them out
of order, so the reader accepts a record only when its stamp is the expected one and the checksum
matches the body; otherwise it looks again on its next poll, and refuses the record (counted, skipped)
when it has not verified within RECORD_GRACE_S, far longer than any reordering: it is torn or corrupt.
The producer reuses a record only after the consumer's counter has passed it, and a ring that is
full refuses the send (counted as dropped): records in flight are bounded by the frame slots.

Waiting: the consumer sleeps in the kernel on the low 32 bits of `published` (`shared_wait`: a futex
on Linux, a ulock on macOS, a named event per ring on Windows), and the producer, after advancing the
counter, wakes it. A futex wait compares the word with the value the consumer last saw, so a record
published between the consumer's last look and its sleep ends the sleep at once. The consumer sets a
`sleeping` word (beside `consumed`) before its last look, and clears it after: a producer that sees it
clear skips the wake call, so a stream whose reader is busy pays no system call per notice. Skipping
is safe only where a locked instruction orders the producer's counter store before its load of
`sleeping` and the consumer's flag store before its look (`_fence`; x86's locked instructions are full
barriers); elsewhere the producer always makes the call, whose kernel side carries that barrier.
`wake()` from another thread of the consumer's process (a command, closing) calls the kernel's wake
until the sleeper is out of its wait, as a word wait cannot see it coming.

Polling remains where no kernel wait exists, and while a record has not verified yet (see above, the
next look must come soon): a backoff from SLEEP_MIN_S doubling to SLEEP_MAX_S, or SLEEP_IDLE_S once
nothing has come for IDLE_AFTER_S. Within SPIN_S of this side's last record the consumer spins,
yielding the CPU and the GIL between looks, before it sleeps (0 turns the spin off; docs/performance.md
has what it buys). On a paced stream the consumer may also spin in a window around the predicted
arrival of the peer's next frame notice and sleep only until that window opens (`arrival_spin`, off
unless configured). Every wait keeps its timeout, and `wake()` ends one early.

Threads: one consumer at a time (it holds `lock`, reentrant, as on the lane); sends from any
thread, serialised by a short lock of their own that is never held while waiting.
"""

from __future__ import annotations

import os
import platform
import struct
import sys
import threading
import time
from typing import Any

from loom_live.host_bridge.wire.arrival_spin import ArrivalSpin
from loom_live.host_bridge.wire.protocol import MAX_SLOTS, NOTICE_DIRS, PROTOCOL_VERSION
from loom_live.host_bridge.wire.rings.shm import (
    is_segment_name,
    new_segment_name,
    open_segment,
    sweep_stale_segments,
    unlink_segment,
)
from loom_live.host_bridge.wire.shared_wait import SharedWait, shared_wait

TRANSPORTS = ("shm", "cuda-ipc")  # both processes on one machine: these links use a doorbell
MAGIC = 0x4C4F4F4D44424C31  # "LOOMDBL1"
LAYOUT_VERSION = 2  # 2: a `sleeping` word beside each `consumed`; producers wake sleeping consumers
CAPACITY = 64  # records per direction; at most 2 x MAX_SLOTS are ever unconsumed
MAX_CAPACITY = 4096  # what an attaching side accepts from a segment's header
HEADER_WORDS = 8  # magic, layout version, capacity, owner pid; one cache line
COUNTER_WORDS = 8  # a counter alone on its cache line: producer and consumer never write the same line
SLEEPING = 1  # word after `consumed` on the consumer's line: 1 while the consumer may sleep in the kernel
RECORD_WORDS = 8  # stamp, info, seq, gen, t_ns, check, 2 spare: one cache line
RING_WORDS = 2 * COUNTER_WORDS + CAPACITY * RECORD_WORDS  # one direction's ring, as this side creates it
WORD = 8
MASK64 = (1 << 64) - 1
MAX_VALUE = 1 << 62  # seq and gen: the protocol's integer range
KIND_FRAME, KIND_RELEASE = 1, 2
FLAG_DROPPED = 1  # a release: the frame was not read
FLAG_CONTROL = 2  # a frame: its slot holds a control frame too (a control ring)
RECORD_GRACE_S = 0.01  # an unverified record this old is torn or corrupt, not late (reordering: ns)
SPIN_S = 0.0  # spin this long after the last record before sleeping (see docs/performance.md)
WAKE_RETRY_S = 0.0001  # `wake()`: call the kernel's wake again after this until the sleeper is out
SLEEP_MIN_S = 0.00005
SLEEP_MAX_S = 0.0005  # the most a waiter oversleeps a notice of a stream (plus the OS timer's slack)
IDLE_AFTER_S = 0.25  # no record for this long: nothing streams (below 4 fps), sleep longer
SLEEP_IDLE_S = 0.002  # the most a waiter oversleeps the first notice after such a pause
_CHECK_KEYS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93, 0xFF51AFD7ED558CCD)
_BODY = struct.Struct("5Q")  # info, seq, gen, t_ns, check (after the stamp)
_RECORD = struct.Struct("6Q")  # stamp + body
RINGS = {"host": 0, "engine": 1}  # which ring each side writes
_yield = getattr(os, "sched_yield", lambda: time.sleep(0))
_LOW_HALF = 0 if sys.byteorder == "little" else 4  # the low 32 bits of a uint64 word: what a futex compares
_MASK32 = (1 << 32) - 1
FENCE_ORDERS = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")
_fence_lock = threading.Lock()


def _fence() -> None:
    """A full memory barrier where FENCE_ORDERS: taking and dropping a lock is a locked instruction. A `with`, not
    acquire() then release(): an exception raised between the two (Ctrl-C) would leave the lock held, and the next
    fence, of any thread, waiting on it for ever."""
    with _fence_lock:
        pass


class DoorbellError(ValueError):
    """A doorbell segment that cannot be used (missing, not ours, wrong layout)."""


def _check(stamp: int, info: int, seq: int, gen: int, t_ns: int) -> int:
    """A checksum over a record's fields: a body torn between two writes, or bytes overwritten, fail it."""
    k = _CHECK_KEYS
    return (stamp * k[0] ^ info * k[1] ^ seq * k[2] ^ gen * k[3] ^ t_ns * k[4] ^ MAGIC) & MASK64


def segment_bytes(capacity: int = CAPACITY) -> int:
    return (HEADER_WORDS + 2 * (2 * COUNTER_WORDS + capacity * RECORD_WORDS)) * WORD


class Doorbell:
    """One link's doorbell, as seen from one side ("host" creates and owns it, "engine" attaches)."""

    def __init__(self, shm: Any, side: str, owner: bool):
        self._shm = shm
        self._owner = owner
        self.name: str = shm.name.lstrip("/")
        self.endpoint = f"doorbell:{self.name}"
        self._in_dirs = NOTICE_DIRS["engine" if side == "host" else "host"]  # what the peer writes
        self._words = shm.buf.cast("Q")
        self._buf = shm.buf
        capacity = self._words[2]
        self.capacity = capacity
        mine, theirs = RINGS[side], 1 - RINGS[side]
        ring_words = 2 * COUNTER_WORDS + capacity * RECORD_WORDS
        self._out_base = HEADER_WORDS + mine * ring_words  # the ring this side writes
        self._in_base = HEADER_WORDS + theirs * ring_words  # the ring this side reads
        self._w = self._words[self._out_base]  # this side's next record index (0 on a fresh segment)
        self._r = self._words[self._in_base + COUNTER_WORDS]
        self._unverified_since: float | None = None
        self._active_at = 0.0  # perf_counter() of this side's last record sent or received
        self.lock = threading.RLock()  # held by the consuming thread
        self._send_lock = threading.Lock()
        self._woken = False
        self._closed = False
        self._asleep = 0  # while the consumer is in (or entering) a kernel wait: that sleep's number
        self._in_wait = self._waiter(theirs, owner)  # sleeps on the ring this side reads
        self._out_wait = self._waiter(mine, owner)  # wakes the peer sleeping on the ring this side writes
        self.sent = self.received = self.refused = self.dropped = 0
        self.wakes = self.sleeps = 0  # kernel wake calls made for the peer; kernel sleeps of this consumer
        self.pace = ArrivalSpin.from_env()  # spin around the peer's next paced frame notice (off by default)
        self.spin_turns = 0  # looks made spinning in such a window
        self.spun_s = 0.0  # time spent yielding in them
        self.last_refusal = ""
        self.refused_at = 0.0

    def _waiter(self, ring: int, create: bool) -> SharedWait | None:
        base = HEADER_WORDS + ring * (2 * COUNTER_WORDS + self.capacity * RECORD_WORDS)
        return shared_wait(self._buf, base * WORD + _LOW_HALF, f"{self.name}_{ring}", create)

    @classmethod
    def create(cls) -> Doorbell:
        """The host's doorbell for a new link (a fresh segment, mode 0600)."""
        sweep_stale_segments()
        shm = open_segment(new_segment_name(), create=True, size=segment_bytes())
        struct.pack_into("4Q", shm.buf, 0, MAGIC, LAYOUT_VERSION, CAPACITY, os.getpid())
        return cls(shm, "host", owner=True)

    @classmethod
    def attach(cls, name: str) -> Doorbell:
        """The engine's side of the doorbell the host's hello names."""
        if not isinstance(name, str) or not is_segment_name(name):
            raise DoorbellError(f"doorbell {str(name)[:80]!r}: not a loom segment name (loom_<pid>_<hex>)")
        try:
            shm = open_segment(name, create=False)
        except OSError as exc:
            raise DoorbellError(f"doorbell {name}: cannot open the segment: {exc}") from exc
        problem = None
        if shm.size < segment_bytes(1):
            problem = f"{shm.size} bytes is too small"
        else:
            magic, version, capacity = struct.unpack_from("3Q", shm.buf, 0)
            if magic != MAGIC or version != LAYOUT_VERSION:
                problem = f"not a doorbell of layout {LAYOUT_VERSION}"
            elif not 1 <= capacity <= MAX_CAPACITY or shm.size < segment_bytes(capacity):
                problem = f"capacity {capacity} does not fit its {shm.size} bytes"
        if problem:
            shm.close()
            raise DoorbellError(f"doorbell {name}: {problem}")
        return cls(shm, "engine", owner=False)

    # -- producing (any thread) -------------------------------------------------------------------------

    def send_frame(self, slot: int, seq: int, gen: int, payload: list[Any] | tuple = (), control: bool = False) -> bool:
        """Publish a frame notice for `slot` of the ring this side writes (`control`: with its control
        frame). Never blocks."""
        if payload:
            raise ValueError("the doorbell carries notices only; frame payloads need the tcp transport's lane")
        return self._publish(KIND_FRAME | (FLAG_CONTROL << 16 if control else 0), slot, seq, gen)

    def send_release(self, slot: int, gen: int, dropped: bool = False) -> bool:
        """Hand `slot` of the peer's ring back. Never blocks."""
        return self._publish(KIND_RELEASE | (FLAG_DROPPED << 16 if dropped else 0), slot, 0, gen)

    def _publish(self, kind_flags: int, slot: int, seq: int, gen: int) -> bool:
        """Body, then stamp, then counter (see the module docstring). False when full or closed."""
        if not 0 <= slot < MAX_SLOTS or not 0 <= seq <= MAX_VALUE or not 0 <= gen <= MAX_VALUE:
            raise ValueError(f"doorbell notice: slot {slot}, seq {seq}, gen {gen}; expected a slot below "
                             f"{MAX_SLOTS} and seq, gen in [0, 2**62]")
        info = kind_flags | slot << 8
        t_ns = time.time_ns()
        with self._send_lock:
            if self._closed:
                self.dropped += 1
                return False
            words, base, i = self._words, self._out_base, self._w
            if not 0 <= i - words[base + COUNTER_WORDS] < self.capacity:
                self.dropped += 1  # full (the consumer is behind), or its counter is garbage
                return False
            rec = base + 2 * COUNTER_WORDS + (i % self.capacity) * RECORD_WORDS
            stamp = i + 1
            _BODY.pack_into(self._buf, (rec + 1) * WORD, info, seq, gen, t_ns, _check(stamp, info, seq, gen, t_ns))
            words[rec] = stamp
            words[base] = stamp
            self._w = stamp
            self.sent += 1
            self._wake_consumer(base)
        self._active_at = time.perf_counter()
        return True

    def _wake_consumer(self, base: int) -> None:
        """After a publish (send lock held, so the mapping stays): wake the peer if it may be asleep."""
        if self._out_wait is None:
            return
        if FENCE_ORDERS:
            _fence()  # the counter store before the load of `sleeping` (see the module docstring)
            if not self._words[base + COUNTER_WORDS + SLEEPING]:
                return
        self._out_wait.wake()
        self.wakes += 1

    # -- consuming (the holder of `lock`) -----------------------------------------------------------------

    def acquire(self, blocking: bool = True, timeout_s: float = -1) -> bool:
        return self.lock.acquire(blocking, timeout_s)

    def release(self) -> None:
        self.lock.release()

    def wake(self) -> None:
        """Make a thread waiting in `receive()` return now (a command, closing)."""
        self._woken = True
        asleep = self._asleep  # 0: a sleep that begins from now on sees `_woken` first
        if self._in_wait is None or not asleep:
            return
        while True:
            with self._send_lock:  # the mapping stays while the kernel is called
                if self._shm is None:
                    return
                self._in_wait.wake()
            if self._in_wait.sticky or self._asleep != asleep:
                return  # that sleep is over; the receive loop sees `_woken` next
            time.sleep(WAKE_RETRY_S)  # it may not have entered the kernel yet: a word wait cannot see us

    def receive(self, timeout_s: float) -> list[tuple[dict[str, Any], list[bytes]]]:
        """Lock holder only: the peer's new notices as lane messages (payloads empty); waits up to
        `timeout_s` (0: just look) for the first (see the module docstring)."""
        out = self._poll()
        if out or timeout_s <= 0 or self._closed:
            self._woken = False
            return out
        now = time.perf_counter()
        deadline = now + timeout_s
        delay = SLEEP_MIN_S if now - self._active_at < IDLE_AFTER_S else SLEEP_IDLE_S
        while True:
            if self._woken or self._closed:
                self._woken = False
                return self._poll()
            pace = self.pace.plan(time.time()) if self.pace.enabled else None
            until = deadline - now if pace is None else min(deadline - now, pace)  # the window opens then
            if pace == 0.0:
                self._spin_turn()
            elif now - self._active_at < SPIN_S:
                _yield()
            elif self._in_wait is not None and self._unverified_since is None:
                self._sleep(until)
            else:
                time.sleep(min(delay, max(until, 0.0)))
                delay = min(delay * 2, SLEEP_MAX_S if now - self._active_at < IDLE_AFTER_S else SLEEP_IDLE_S)
            out = self._poll()
            now = time.perf_counter()
            if out or now >= deadline:
                return out

    def _spin_turn(self) -> None:
        """One look's pause inside the arrival window: give the CPU and the GIL away, come straight back."""
        t0 = time.perf_counter()
        _yield()
        self.spun_s += time.perf_counter() - t0
        self.spin_turns += 1

    def _sleep(self, timeout_s: float) -> None:
        """Sleep in the kernel until the peer publishes, `wake()` or the timeout; may return early."""
        words, published = self._words, self._in_base
        sleeping = self._in_base + COUNTER_WORDS + SLEEPING
        self.sleeps += 1
        self._asleep = self.sleeps
        words[sleeping] = 1
        try:
            _fence()  # the flag store before the last look (see the module docstring)
            if words[published] == self._r and not self._woken and not self._closed:
                self._in_wait.wait(self._r & _MASK32, timeout_s)
        finally:
            words[sleeping] = 0
            self._asleep = 0

    def _poll(self) -> list[tuple[dict[str, Any], list[bytes]]]:
        if self._closed:
            return []
        words, base, r = self._words, self._in_base, self._r
        w = words[base]
        if w == r:
            return []
        out: list[tuple[dict[str, Any], list[bytes]]] = []
        if not 0 < w - r <= self.capacity:
            self.refuse(f"doorbell: the peer's counter went from {r} to {w}; it may move at most "
                        f"{self.capacity} records ahead (corrupt segment)")
            r = w  # start again from where the producer says it is
        records = base + 2 * COUNTER_WORDS
        while r < w:
            stamp, info, seq, gen, t_ns, check = _RECORD.unpack_from(
                self._buf, (records + (r % self.capacity) * RECORD_WORDS) * WORD)
            if stamp != r + 1 or check != _check(stamp, info, seq, gen, t_ns):
                now = time.monotonic()
                if self._unverified_since is None:
                    self._unverified_since = now
                if now - self._unverified_since < RECORD_GRACE_S:
                    break  # not all of it visible yet (weakly ordered memory): look again next poll
                self.refuse(f"doorbell record {r}: torn or corrupt (stamp {stamp}, expected {r + 1}, "
                            "or its checksum does not match)")
            else:
                msg = self._message(info, seq, gen, t_ns)
                if msg is not None:
                    out.append((msg, []))
            self._unverified_since = None
            self.received += 1
            r += 1
        self._r = r
        words[base + COUNTER_WORDS] = r
        self._active_at = time.perf_counter()
        return out

    def _message(self, info: int, seq: int, gen: int, t_ns: int) -> dict[str, Any] | None:
        """A verified record as the lane message it stands for; None (refused) when a field is out of range."""
        kind, slot, flags = info & 0xFF, info >> 8 & 0xFF, info >> 16
        frame_dir, release_dir = self._in_dirs
        if kind == KIND_FRAME and flags & ~FLAG_CONTROL == 0:
            self.pace.arrived(t_ns / 1e9)
            msg = {"v": PROTOCOL_VERSION, "type": "frame", "dir": frame_dir, "slot": slot, "seq": seq, "gen": gen,
                   "t": t_ns / 1e9, **({"control": True} if flags & FLAG_CONTROL else {})}
        elif kind == KIND_RELEASE and flags & ~FLAG_DROPPED == 0 and seq == 0:
            msg = {"v": PROTOCOL_VERSION, "type": "release", "dir": release_dir, "slot": slot, "gen": gen,
                   "dropped": bool(flags)}
        else:
            self.refuse(f"doorbell record: kind {kind} with flags {flags}; expected a frame (1) or a release (2)")
            return None
        if slot >= MAX_SLOTS or seq > MAX_VALUE or gen > MAX_VALUE:
            self.refuse(f"doorbell {msg['type']} record: slot {slot}, seq {seq}, gen {gen}; expected a slot "
                        f"below {MAX_SLOTS} and seq, gen at most 2**62")
            return None
        return msg

    def refuse(self, why: str) -> None:
        self.refused += 1
        self.last_refusal = why[:300]
        self.refused_at = time.monotonic()

    # -- teardown -----------------------------------------------------------------------------------------

    def close(self) -> None:
        """Wake a waiting consumer, wait for it, unmap (the owner also removes the segment). Idempotent."""
        self._unmap(unlink=self._owner)

    def remove(self) -> None:
        """Close and remove the segment even when not the owner (used by an engine whose host died)."""
        self._unmap(unlink=True)

    def _unmap(self, unlink: bool) -> None:
        self._closed = True
        self.wake()
        with self.lock, self._send_lock:
            shm, self._shm = self._shm, None
            if shm is None:
                return
            for waiter in (self._in_wait, self._out_wait):
                if waiter is not None:
                    waiter.close()
            self._words.release()
            self._buf = self._words = None
            shm.close()
            if unlink:
                unlink_segment(shm)
