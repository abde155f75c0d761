"""The processes of pipeline ranks 1..P-1: spawning, watching, stopping, leaving none behind.

Rank 0 is the engine process itself. The other ranks are spawned (torch.multiprocessing, spawn
start method: CUDA cannot be forked) with their header pipes (`engine/parallel/link.py`) and one
event queue back to rank 0, on which a rank reports that its models are loaded, its stage times,
or the traceback of whatever made it fail. Rank 0 checks that queue and the processes' exit codes
whenever it waits, so a failing rank becomes a `PipelineError` naming the rank and its exception
instead of a hang; ranks waiting for a message notice a dead engine as a closed pipe.
"""

from __future__ import annotations

import multiprocessing as std_mp
import os
import shutil
import tempfile
import time
from multiprocessing.connection import Connection
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from loom_live.engine.config import LoomConfig
from loom_live.engine.parallel.stage import worker_main
from loom_live.host_bridge.wire.processes import pid_alive

KILL_JOIN_S = 5.0
ERROR_GRACE_S = 1.0  # a rank that exited may still be flushing its traceback into the queue


RENDEZVOUS_PREFIX = "loom-pipeline-"


def sweep_stale_rendezvous() -> None:
    """Remove the rendezvous folders of engines that are gone (killed, or stopped by force, before `kill()`)."""
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        pid, _, rest = name.removeprefix(RENDEZVOUS_PREFIX).partition("-")
        if name.startswith(RENDEZVOUS_PREFIX) and pid.isdigit() and rest and not pid_alive(int(pid)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


class PipelineError(RuntimeError):
    """A pipeline rank failed or exited; the message carries its exception and traceback."""


class RankProcesses:
    """Ranks 1..P-1 of a pipeline of P ranks over `ranges` of blocks; rank 0 keeps `outbox`/`inbox`."""

    def __init__(self, cfg: LoomConfig, ranges: list[range]) -> None:
        self.P = len(ranges)
        sweep_stale_rendezvous()
        # the pid in the name lets a later pipeline remove it when this engine was killed before `kill()`
        self._tmp = tempfile.mkdtemp(prefix=f"{RENDEZVOUS_PREFIX}{os.getpid()}-")
        self.init_file = os.path.join(self._tmp, "rendezvous")  # the ranks' FileStore rendezvous
        ctx = mp.get_context("spawn")
        self._events = ctx.Queue()
        self.timeout_s = cfg.parallel.rank_timeout_s
        self.beats = ctx.Array("d", self.P, lock=False)  # each rank's last heartbeat (time.monotonic)
        self._hung: set[int] = set()
        self._held: list[tuple[str, int, Any]] = []
        self.procs: list[Any] = []
        chain = [ctx.Pipe(duplex=False) for _ in range(self.P - 1)]  # rank r -> r+1: (reader, writer)
        back_reader, back_writer = ctx.Pipe(duplex=False)  # rank P-1 -> rank 0
        self.outbox: Connection = chain[0][1]
        self.inbox: Connection = back_reader
        for r in range(1, self.P):
            outbox = chain[r][1] if r < self.P - 1 else back_writer
            p = ctx.Process(target=worker_main, name=f"loom-pipeline-rank{r}", daemon=True,
                            args=(r, self.P, cfg, ranges[r], chain[r - 1][0], outbox, self._events,
                                  self.init_file, os.getpid(), self.beats))
            p.start()
            self.procs.append(p)
        for conn in [c for pair in chain for c in pair] + [back_writer]:  # the ends the ranks own
            if conn is not self.outbox:
                conn.close()

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def check(self) -> None:
        """Raise PipelineError when a rank reported an error, exited, or stopped beating (hung)."""
        try:
            while True:
                event = self._events.get_nowait()
                if event[0] == "error":
                    raise _rank_failed(event[1], event[2])
                self._held.append(event)
        except std_mp.queues.Empty:
            pass
        for r, p in enumerate(self.procs, start=1):
            if p.exitcode is not None:
                try:
                    kind, rank, info = self._events.get(timeout=ERROR_GRACE_S)
                    if kind == "error":
                        raise _rank_failed(rank, info)
                except std_mp.queues.Empty:
                    pass
                raise PipelineError(f"pipeline rank {r} (pid {p.pid}) exited with code {p.exitcode}")
        now = time.monotonic()
        for r, p in enumerate(self.procs, start=1):
            silent = now - self.beats[r]
            if self.beats[r] and silent > self.timeout_s:
                self._hung.add(r)
                raise PipelineError(f"pipeline rank {r} (pid {p.pid}) is hung: no heartbeat for {silent:.1f} s "
                                    f"(parallel.rank_timeout_s: {self.timeout_s:g})")

    def await_events(self, kind: str, count: int) -> list[Any]:
        """Wait for `count` events of `kind` ("loaded", "stats"), one per rank; raises on a failure."""
        got: list[Any] = []
        while True:
            self.check()
            got += [info for k, _, info in self._held if k == kind]
            self._held = [e for e in self._held if e[0] != kind]
            if len(got) >= count:
                return got
            time.sleep(0.01)

    def take_events(self, kind: str) -> list[Any]:
        """The events of `kind` that arrived so far (without waiting)."""
        self.check()
        got = [info for k, _, info in self._held if k == kind]
        self._held = [e for e in self._held if e[0] != kind]
        return got

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))

    def kill(self) -> None:
        """Terminate what still runs, leave the process group, remove the rendezvous folder."""
        for r, p in enumerate(self.procs, start=1):
            if p.is_alive():
                if r in self._hung:  # a stopped or frozen process would not act on SIGTERM
                    p.kill()
                else:
                    p.terminate()
        for p in self.procs:
            p.join(KILL_JOIN_S)
            if p.is_alive():
                p.kill()
                p.join(KILL_JOIN_S)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a group whose peers are gone may not close cleanly
                pass
        for conn in (self.outbox, self.inbox):
            conn.close()
        shutil.rmtree(self._tmp, ignore_errors=True)


def _rank_failed(rank: int, trace: str) -> PipelineError:
    """The rank's exception first (what a user reads), its traceback after."""
    lines = trace.strip().splitlines()
    return PipelineError(f"pipeline rank {rank} failed: {lines[-1] if lines else 'unknown error'}\n\n{trace}")
