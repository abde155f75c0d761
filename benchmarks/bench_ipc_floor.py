"""The floor under the cuda-ipc handoff: two bare processes, no bridge code, each way of splitting the copies.

A paced handoff through the bridge costs several times its copies alone. This asks what any
two-process design could reach on the same machine, with the least work: the same 8 MB frames, the same
interprocess memory and events, and notices that are a shared integer (spun on, so no wake-up costs) or a
pipe (a kernel wake, as futexes and sockets cost). Forms:

- `host-copies`: the host copies the caller's frame into a shared input buffer and records an interprocess
  event; the engine waits for it on its stream, copies input to output, and says so once its copy is done;
  the host copies the output into the caller's buffer and waits for it. The bridge's split, minus staging,
  the newest-output buffer, Python bookkeeping and sockets.
- `host-copies-early`: the same, but the engine's notice goes as soon as its copy is queued and the host's
  stream waits for the engine's event instead (the engine never waits for the GPU).
- `engine-copies`: the host's only GPU call is an event after the caller's work; the engine copies straight
  from the caller's buffer and into the caller's output buffer (both opened in the engine by their
  interprocess handles) and says so once done. The host process puts no copy on the GPU.
- `host-copies-cpu`, `engine-copies-cpu`: the same splits ordered by the CPU instead of interprocess events: each
  side waits for its own stream before its notice, and neither stream ever waits for the other process's event.
  What a GPU wait across contexts costs is the difference.
- `host-copies-gpu`, `engine-copies-gpu`: the same splits ordered by the GPU alone, with no notices and no events:
  the engine queues each frame's copies ahead, behind a stream wait on a 32-bit mark in device memory (CUDA stream
  memory operations); the host's stream writes that mark after the caller's frame and waits on the engine's
  answering mark before its own copy out. The engine's CPU only re-arms after each frame. If a paced frame is
  slow because work must be launched after an idle gap, work already queued and waiting is not.

`--warm-gpu` keeps the GPU from idling between paced frames, as a running model would: while it waits for the
next frame the engine process queues a one-element kernel every `--warm-gpu-us` on a stream of its own (spun
notices only). The three copies in one process are timed back to back and paced too: a paced figure well above
its back-to-back one with no second process at all is the GPU's, not the messages'; and once more queued ahead
behind a mark that another stream writes at the frame's time.

A form whose paced p99 is above the target here cannot meet it in the bridge either; the gap between a
form and the bridge is what the bridge's own steps cost.

    python benchmarks/bench_ipc_floor.py --frames 500 --paced-frames 600 --json out/ipc_floor.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from multiprocessing import get_context
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import NamedTuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from loom_live.engine.tools.bridge_probe import percentiles  # noqa: E402
from loom_live.host_bridge.wire.files import write_replacing  # noqa: E402

FORMS = ("host-copies", "host-copies-early", "engine-copies", "host-copies-cpu", "engine-copies-cpu",
         "host-copies-gpu", "engine-copies-gpu")
WAITS = ("spin", "pipe")
DOOR, NOTICE, STOP = 0, 1, 2  # the shared integers: the host's newest frame, the engine's newest, the end
GO, DONE = 0, 1  # the GPU-ordered forms' marks: the host's newest frame, the engine's newest
ANSWER_TIMEOUT_S = 10.0


class Split(NamedTuple):
    """What a form's name says: who copies, how the two sides are ordered, when the engine's notice goes."""

    host_copies: bool  # the host copies into and out of shared buffers (else the engine copies the caller's own)
    cpu_ordered: bool  # each side waits for its own stream; no stream waits for the other process's event
    early: bool  # the engine's notice goes once its copy is queued, not done
    gpu_ordered: bool  # streams wait on marks in device memory; no notices, no events

    @classmethod
    def of(cls, form: str) -> Split:
        return cls(form.startswith("host-copies"), form.endswith("-cpu"), form.endswith("-early"),
                   form.endswith("-gpu"))


class StreamMarks:
    """32-bit marks in device memory that streams write and wait on (CUDA stream memory operations).

    A wait is queued like any other work and holds its stream until the mark reaches the value (a cyclic
    greater-or-equal), so work behind it is launched before it is due. Marks sit 128 bytes apart.
    """

    STRIDE = 32  # int32 elements between marks

    def __init__(self, tensor):
        from cuda.bindings import driver

        self.driver, self.tensor, self.base = driver, tensor, tensor.data_ptr()

    @classmethod
    def new(cls, torch, count: int = 2) -> StreamMarks:
        return cls(torch.zeros(count * cls.STRIDE, dtype=torch.int32, device="cuda"))

    def write(self, stream, mark: int, value: int) -> None:
        d = self.driver
        self._check(d.cuStreamWriteValue32(d.CUstream(stream.cuda_stream), d.CUdeviceptr(self._at(mark)), value,
                                           int(d.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT)), "write")

    def wait(self, stream, mark: int, value: int) -> None:
        d = self.driver
        self._check(d.cuStreamWaitValue32(d.CUstream(stream.cuda_stream), d.CUdeviceptr(self._at(mark)), value,
                                          int(d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)), "wait")

    def _at(self, mark: int) -> int:
        return self.base + 4 * self.STRIDE * mark

    def _check(self, result, what: str) -> None:
        err = result[0] if isinstance(result, tuple) else result
        if err != self.driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuStream{what.capitalize()}Value32 failed: {err}")


class Notices:
    """One side's view of the notices: a shared integer it spins on, or a pipe it blocks on."""

    def __init__(self, shm_name: str, wait: str, conn):
        self.shm = SharedMemory(name=shm_name)
        self.flags = np.ndarray((4,), dtype=np.int64, buffer=self.shm.buf)
        self.wait, self.conn = wait, conn

    def say(self, slot: int, seq: int) -> None:
        self.flags[slot] = seq
        if self.wait == "pipe":
            self.conn.send_bytes(b"n")

    def hear(self, slot: int, seq: int, idle=None) -> bool:
        """False once the other side said stop (or went silent); `idle()` runs between spins."""
        if self.wait == "pipe":
            if not self.conn.poll(ANSWER_TIMEOUT_S):
                return False
            self.conn.recv_bytes()
            return self.flags[STOP] == 0
        end = time.perf_counter() + ANSWER_TIMEOUT_S
        flags = self.flags
        while flags[slot] < seq:
            if flags[STOP] or time.perf_counter() > end:
                return False
            if idle is not None:
                idle()
        return True

    def close(self) -> None:
        del self.flags
        self.shm.close()


def engine_main(form: str, wait: str, shm_name: str, conn, shared: dict, events: dict, warm_us: float) -> None:
    """The engine side: wait for each frame, copy it on its own stream, say it is there."""
    import torch

    notices = Notices(shm_name, wait, conn)
    stream = torch.cuda.Stream()
    split = Split.of(form)
    if split.gpu_ordered:
        return _engine_gpu_ordered(torch, split, notices, conn, stream, shared)
    ev_in = torch.cuda.Event.from_ipc_handle(torch.device("cuda", 0), events["in"])
    ev_out = torch.cuda.Event.from_ipc_handle(torch.device("cuda", 0), events["out"])
    src, dst = shared["src"], shared["dst"]
    work = None if split.host_copies else torch.empty_like(src)
    idle = _warmer(torch, warm_us) if warm_us > 0 else None
    conn.send_bytes(b"ready")
    seq = 0
    try:
        while True:
            seq += 1
            if not notices.hear(DOOR, seq, idle):
                return
            with torch.cuda.stream(stream):
                if not split.cpu_ordered:
                    stream.wait_event(ev_in)
                if work is not None:  # the caller's frame into the engine's memory, its answer into the caller's
                    work.copy_(src)
                    dst.copy_(work)
                else:
                    dst.copy_(src)
                ev_out.record(stream)
            if not split.early:
                stream.synchronize()
            notices.say(NOTICE, seq)
    finally:
        notices.close()


def _engine_gpu_ordered(torch, split: Split, notices: Notices, conn, stream, shared: dict) -> None:
    """The engine side ordered by the GPU: each frame's copies queued ahead behind the host's mark, re-armed once
    the frame before is done."""
    marks, src, dst = StreamMarks(shared["marks"]), shared["src"], shared["dst"]
    work = None if split.host_copies else torch.empty_like(src)

    def arm(seq: int) -> None:
        with torch.cuda.stream(stream):
            marks.wait(stream, GO, seq)
            if work is not None:
                work.copy_(src)
                dst.copy_(work)
            else:
                dst.copy_(src)
            marks.write(stream, DONE, seq)

    seq = 1
    arm(seq)
    conn.send_bytes(b"ready")
    try:
        while True:
            stream.synchronize()  # frame `seq` is done (or the host released the wait to stop us)
            if notices.flags[STOP]:
                return
            seq += 1
            arm(seq)
    finally:
        notices.close()


def spin_until(event, t0: float, rescue, why: str) -> None:
    """Spin until the GPU passes `event` (a spun wait, as the other forms' synchronize); after
    `ANSWER_TIMEOUT_S` from `t0`, call `rescue()` to free what waits on a mark and raise: a mark that never
    comes must end the form, not the whole run."""
    end = t0 + ANSWER_TIMEOUT_S
    while not event.query():
        if time.perf_counter() > end:
            rescue()
            raise RuntimeError(why)


def _warmer(torch, every_us: float):
    """A callable that queues a one-element kernel on a stream of its own at most every `every_us`."""
    stream = torch.cuda.Stream()
    cell = torch.zeros(1, device="cuda")
    every_s, last = every_us / 1e6, [0.0]

    def idle() -> None:
        now = time.perf_counter()
        if now - last[0] >= every_s:
            last[0] = now
            with torch.cuda.stream(stream):
                cell.add_(1)

    return idle


class Host:
    """The host side: a caller's frame in, the engine's answer back in the caller's buffer."""

    def __init__(self, form: str, wait: str, width: int, height: int, warm_us: float = 0.0):
        import torch

        self.torch, self.split = torch, Split.of(form)
        self.src = torch.randint(0, 256, (height, width, 4), dtype=torch.uint8, device="cuda")
        self.dst = torch.empty_like(self.src)
        self.stream = torch.cuda.Stream()
        if not self.split.host_copies:
            shared = {"src": self.src, "dst": self.dst}
        else:
            self.slot_in, self.slot_out = torch.empty_like(self.src), torch.empty_like(self.src)
            shared = {"src": self.slot_in, "dst": self.slot_out}
        self.marks = StreamMarks.new(torch) if self.split.gpu_ordered else None
        if self.marks is not None:
            shared["marks"] = self.marks.tensor
            self.answered, self.rescue = torch.cuda.Event(), torch.cuda.Stream()
        self.ev_in = torch.cuda.Event(interprocess=True)
        self.ev_out = torch.cuda.Event(interprocess=True)
        self.shm = SharedMemory(create=True, size=64)
        np.ndarray((4,), dtype=np.int64, buffer=self.shm.buf)[:] = 0
        ctx = get_context("spawn")
        ours, theirs = ctx.Pipe()
        torch.cuda.synchronize()
        self.proc = ctx.Process(target=engine_main, daemon=True, args=(
            form, wait, self.shm.name, theirs, shared,
            {"in": self.ev_in.ipc_handle(), "out": self.ev_out.ipc_handle()}, warm_us))
        self.proc.start()
        if not ours.poll(60) or ours.recv_bytes() != b"ready":
            self.proc.kill()
            self.shm.close()
            self.shm.unlink()
            raise RuntimeError(f"{form}/{wait}: the engine process did not start (exit code {self.proc.exitcode})")
        self.notices = Notices(self.shm.name, wait, ours)
        self.seq = 0

    def handoff(self) -> tuple[float, float]:
        """One frame there and back; (seconds to the engine's notice, seconds to the frame in the caller's buffer)."""
        torch, stream = self.torch, self.stream
        self.seq += 1
        t0 = time.perf_counter()
        if self.marks is not None:
            return self._handoff_gpu_ordered(t0)
        with torch.cuda.stream(stream):
            if self.split.host_copies:
                self.slot_in.copy_(self.src)
            if self.split.cpu_ordered:
                stream.synchronize()
            else:
                self.ev_in.record(stream)
        self.notices.say(DOOR, self.seq)
        if not self.notices.hear(NOTICE, self.seq):
            raise RuntimeError(f"no answer from the engine for frame {self.seq}")
        t1 = time.perf_counter()
        with torch.cuda.stream(stream):
            if not self.split.cpu_ordered:
                stream.wait_event(self.ev_out)
            if self.split.host_copies:
                self.dst.copy_(self.slot_out)
                stream.synchronize()  # the caller's buffer holds the answer
        return t1 - t0, time.perf_counter() - t0

    def _handoff_gpu_ordered(self, t0: float) -> tuple[float, float]:
        """The whole handoff queued on the host's stream at once; the engine's copies wait on the GPU, not the
        host's CPU (no notice: both figures are the frame in the caller's buffer)."""
        torch, stream, marks = self.torch, self.stream, self.marks
        with torch.cuda.stream(stream):
            if self.split.host_copies:
                self.slot_in.copy_(self.src)
            marks.write(stream, GO, self.seq)
            marks.wait(stream, DONE, self.seq)
            if self.split.host_copies:
                self.dst.copy_(self.slot_out)
            self.answered.record(stream)
        # on a silent engine, our stream goes free so that close() ends
        spin_until(self.answered, t0, lambda: marks.write(self.rescue, DONE, self.seq),
                   f"no answer from the engine for frame {self.seq}")
        done = time.perf_counter() - t0
        return done, done

    def close(self) -> bool:
        """Stops the engine; True if the caller's buffer holds the frame it handed over."""
        exact = bool(self.torch.equal(self.src, self.dst))
        self.notices.flags[STOP] = 1
        if self.notices.wait == "pipe":
            self.notices.conn.send_bytes(b"stop")
        if self.marks is not None:  # release the engine's queued wait, so it sees the stop
            self.marks.write(self.stream, GO, self.seq + 1)
            self.stream.synchronize()
        self.proc.join(10)
        self.notices.close()
        self.shm.unlink()
        return exact


def _four_frames(torch, width: int, height: int) -> tuple:
    """The one-process rows' caller frame (random RGBA) and the three buffers its copies pass through."""
    src = torch.randint(0, 256, (height, width, 4), dtype=torch.uint8, device="cuda")
    return (src, *(torch.empty_like(src) for _ in range(3)))


def one_process(width: int, height: int, frames: int, period_s: float = 0.0) -> list[float]:
    """The three copies of `host-copies` in one process and stream, one wait, a frame every `period_s`: what
    the messages add to."""
    import torch

    src, a, b, dst = _four_frames(torch, width, height)
    stream = torch.cuda.Stream()
    samples = []
    for _ in range(frames):
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            a.copy_(src)
            b.copy_(a)
            dst.copy_(b)
            stream.synchronize()
        samples.append(time.perf_counter() - t0)
        rest = period_s - (time.perf_counter() - t0)
        if rest > 0:
            time.sleep(rest)
    return samples


def one_process_prequeued(width: int, height: int, frames: int, period_s: float, warmup: int) -> list[float]:
    """The same three copies queued ahead behind a mark, released at the frame's time by a write on a second
    stream: a paced frame with nothing to launch after the idle gap."""
    import torch

    src, a, b, dst = _four_frames(torch, width, height)
    stream, go = torch.cuda.Stream(), torch.cuda.Stream()
    marks, copied = StreamMarks.new(torch, 1), torch.cuda.Event()
    torch.cuda.synchronize()  # the mark is zero before any stream waits on it

    def arm(seq: int) -> None:
        with torch.cuda.stream(stream):
            marks.wait(stream, GO, seq)
            a.copy_(src)
            b.copy_(a)
            dst.copy_(b)
            copied.record(stream)

    samples = []
    arm(1)
    last = frames + warmup
    for seq in range(1, last + 1):
        t0 = time.perf_counter()
        marks.write(go, GO, seq)
        # were the two streams to share one hardware queue, the write would wait behind the wait it releases
        spin_until(copied, t0, lambda: marks.write(torch.cuda.Stream(), GO, last + 1),
                   f"one process, pre-queued: frame {seq} was never released")
        if seq > warmup:
            samples.append(time.perf_counter() - t0)
        arm(seq + 1)
        rest = period_s - (time.perf_counter() - t0)
        if rest > 0:
            time.sleep(rest)
    marks.write(go, GO, last + 1)  # the last armed frame, released
    stream.synchronize()
    if not torch.equal(src, dst):
        raise RuntimeError("one process, pre-queued: the copies changed the frame")
    return samples


def run(form: str, wait: str, width: int, height: int, frames: int, paced: int, fps: float, warmup: int,
        warm_us: float = 0.0) -> dict:
    host = Host(form, wait, width, height, warm_us)
    out: dict = {}
    try:
        for name, n, period in (("b2b", frames, 0.0), ("paced", paced, 1.0 / fps)):
            notice, done = [], []
            for i in range(n + warmup):
                t0 = time.perf_counter()
                n_s, d_s = host.handoff()
                if i >= warmup:
                    notice.append(n_s)
                    done.append(d_s)
                rest = period - (time.perf_counter() - t0)
                if rest > 0:
                    time.sleep(rest)
            if n:
                out[name] = {"notice": stats(notice), "done": stats(done)}
    finally:
        exact = host.close()
    if not exact:
        raise RuntimeError(f"{form}/{wait}: the round trip changed the frame")
    return out


def stats(samples: list[float]) -> dict:
    """The bridge benchmarks' percentiles, and the worst frame."""
    return {**percentiles(samples), "max_ms": max(samples) * 1000.0}


def print_one_process(results: dict, label: str, key: str) -> None:
    one, paced = results[key], results.get(f"{key}_paced")
    paced_cols = f" {paced['p50_ms']:10.3f} {paced['p99_ms']:7.3f} {paced['max_ms']:7.3f}" if paced else ""
    print(f"{label:>28} {one['p50_ms']:8.3f} {one['p99_ms']:7.3f}{paced_cols}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1920x1080", help="WIDTHxHEIGHT of the RGBA uint8 frames")
    ap.add_argument("--frames", type=int, default=500, help="frames back to back per form")
    ap.add_argument("--paced-frames", type=int, default=600, help="frames at --fps per form (0: none)")
    ap.add_argument("--fps", type=float, default=60.0)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--forms", nargs="+", choices=FORMS, default=list(FORMS))
    ap.add_argument("--waits", nargs="+", choices=WAITS, default=list(WAITS))
    ap.add_argument("--warm-gpu", action="store_true", help="also each form with spun notices and the GPU kept warm")
    ap.add_argument("--warm-gpu-us", type=float, default=500.0, help="--warm-gpu: a kernel at most this often")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    try:
        width, height = (int(v) for v in args.size.lower().split("x"))
    except ValueError:
        ap.error(f"--size {args.size!r}: expected WIDTHxHEIGHT, for example 1920x1080")
    import torch

    if not torch.cuda.is_available():
        print("bench_ipc_floor: needs a CUDA GPU", file=sys.stderr)
        return 2
    results = {"size": [width, height], "fps": args.fps, "device": torch.cuda.get_device_name(0),
               "one_process": stats(one_process(width, height, args.frames)), "forms": {}}
    if args.paced_frames:
        results["one_process_paced"] = stats(one_process(width, height, args.paced_frames, 1.0 / args.fps))
    # the GPU-ordered forms have no notices to wait on, and their engine's CPU waits for its own stream (no warmer)
    runs = [(form, wait, 0.0) for form in args.forms if not Split.of(form).gpu_ordered for wait in args.waits]
    if args.warm_gpu:
        runs += [(form, "spin", args.warm_gpu_us) for form in args.forms if not Split.of(form).gpu_ordered]
    runs += [(form, "gpu", 0.0) for form in args.forms if Split.of(form).gpu_ordered]
    # the table's rows as each form finishes, so a run cut short keeps what it measured
    print(f"\ncuda-ipc floor, {width}x{height} RGBA uint8, two bare processes ({results['device']}); ms")
    print(f"{'form/wait':>28} {'b2b p50':>8} {'p99':>7} {'paced p50':>10} {'p99':>7} {'max':>7} "
          f"{'notice p50':>11} {'p99':>7}")
    print_one_process(results, "one process, 3 copies", "one_process")
    failed = False
    for form, wait, warm_us in runs:
        key = f"{form}/{wait}" + ("+warm" if warm_us else "")
        try:
            r = results["forms"][key] = run(form, wait, width, height, args.frames, args.paced_frames, args.fps,
                                            args.warmup, warm_us)
        except RuntimeError as e:  # one form's failure (a driver without stream memory operations) ends no other
            results["forms"][key] = {"error": str(e)}
            failed = True
            print(f"{key:>28} failed: {e}", flush=True)
            continue
        b, p = r["b2b"]["done"], r.get("paced", {}).get("done")
        paced_cols = f"{p['p50_ms']:10.3f} {p['p99_ms']:7.3f} {p['max_ms']:7.3f}" if p else f"{'-':>10} {'':7} {'':7}"
        notice = r.get("paced", r["b2b"])["notice"]
        print(f"{key:>28} {b['p50_ms']:8.3f} {b['p99_ms']:7.3f} {paced_cols} {notice['p50_ms']:11.3f} "
              f"{notice['p99_ms']:7.3f}", flush=True)
    # last, as the GPU-ordered forms: stream memory operations are the newest path here
    try:
        results["one_process_prequeued"] = stats(one_process_prequeued(width, height, args.frames, 0.0, args.warmup))
        if args.paced_frames:
            results["one_process_prequeued_paced"] = stats(
                one_process_prequeued(width, height, args.paced_frames, 1.0 / args.fps, args.warmup))
        print_one_process(results, "one process, pre-queued", "one_process_prequeued")
    except RuntimeError as e:
        results["one_process_prequeued"] = {"error": str(e)}
        failed = True
        print(f"{'one process, pre-queued':>28} failed: {e}", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_replacing(args.json, lambda f: f.write(json.dumps(results, indent=2).encode()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
