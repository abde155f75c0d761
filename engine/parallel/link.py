"""Messages between pipeline ranks: a small header over a pipe, then tensors over torch.distributed.

Why two channels: a rank spends most of its life waiting for the next message, and that wait
must notice a dead neighbour or a closed engine. A multiprocessing pipe can be polled with a
timeout and reports a dead writer as EOF; a gloo receive cannot (a timed-out gloo wait tears the
connection down). So the header (what follows, for which rows) travels over the pipe, and only
once it has arrived are the receives of the tensors posted: they complete promptly.

Tensors go point to point with isend/irecv: NCCL between GPUs, issued on dedicated
communication streams (a send is ordered after the compute that produced it by a stream wait,
so transfers overlap the next compute), gloo between CPU processes (tests). The return path
(last rank -> rank 0) has its own process group: with 2 ranks both directions would otherwise
share one communicator and its stream, where rank 0's send of tick t queued behind its receive
of an older return (or the reverse on rank 1) can wait on each other for good once a message
outgrows NCCL's buffers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

# gloo sends complete only once received and cannot be polled; a rank waits for its oldest send
# past this many, more than a ring of ticks ever holds in flight, so that wait returns at once.
MAX_PENDING_SENDS = 256
POLL_S = 0.5  # how often a waiting rank checks that its peers are alive
SPIN_S = 0.002  # a waiting rank first spins this long (a message is usually about to arrive)
WAIT_LOOK_S = 0.0005  # with a `waiting` call: how often rank 0 looks for the last rank's header

NEW_CONTEXT = 1  # a prompt embedding follows; recompute cross-attention K/V
REFRESH_SINKS = 2  # a prompt change has fully arrived: refresh the sinks of every row
RESET = 4  # a new stream starts: clear the KV cache rows (and the VAE decode state)
SCRUB = 8  # with RESET, after non-finite values: zero the KV cache slots too (KVCache.scrub)


class Kind(IntEnum):
    DATA = 1  # a micro-batch of rows (forward), or its result (return to rank 0)
    STATS = 2  # report stage times to rank 0, pass it on
    STOP = 3  # finish and exit, pass it on
    CONFIG = 4  # live settings (extra: steps, sink_threshold, lora_scales), in stream order, pass it on
    MOVE = 5  # extra {block, src, dst}: the block moves between neighbouring ranks here in the stream
    TIMES = 6  # report the stage seconds since the last TIMES (the block scheduler's window), pass it on


@dataclass
class Header:
    """What the tensors after it are. `chunks[j]` is the chunk in row j, at step `first_step + j`."""

    kind: Kind
    tick: int = 0
    first_step: int = 0
    frames: int = 0  # latent frames per row
    chunks: tuple[int, ...] = ()
    flags: int = 0
    context_len: int = 0
    out_frames: int = 0  # pixel frames of the chunk that leaves with a return message (0: none)
    extra: dict = field(default_factory=dict)  # small host-side payload (stage times)

    @property
    def rows(self) -> int:
        return len(self.chunks)


class PeerGone(RuntimeError):
    """The rank a message was expected from closed its end (it exited or crashed)."""


class Link:
    """One rank's ends: header pipes to and from its neighbours, tensors through torch.distributed."""

    def __init__(self, device: torch.device, return_group: dist.ProcessGroup | None) -> None:
        self.device = device
        self.return_group = return_group
        cuda = device.type == "cuda"
        self.send_stream = torch.cuda.Stream(device) if cuda else None
        self.recv_stream = torch.cuda.Stream(device) if cuda else None
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []

    # ----- headers ----------------------------------------------------------------------
    @staticmethod
    def send_header(conn: Connection, header: Header) -> None:
        conn.send(header)

    @staticmethod
    def recv_header(conn: Connection, check: Callable[[], None] | None = None,
                    waiting: Callable[[], None] | None = None) -> Header:
        """Wait for a header; `check()` runs every POLL_S and may raise (a peer died); `waiting()`, when
        given, between looks every WAIT_LOOK_S once the spin is over (the caller's own work on time)."""
        spin_until = time.perf_counter() + SPIN_S
        next_check = spin_until + POLL_S
        look_s = POLL_S if waiting is None else WAIT_LOOK_S
        while not conn.poll(0 if time.perf_counter() < spin_until else look_s):
            now = time.perf_counter()
            if now < spin_until:
                continue
            if waiting is not None:
                waiting()
            if check is not None and (waiting is None or now >= next_check):
                check()
                next_check = now + POLL_S
        try:
            return conn.recv()
        except (EOFError, OSError) as exc:
            raise PeerGone("the neighbouring pipeline rank closed its end") from exc

    # ----- tensors ----------------------------------------------------------------------
    def send(self, tensor: torch.Tensor, dst: int, back: bool = False) -> None:
        """Send to rank `dst` (`back`: on the return path, last rank -> rank 0)."""
        tensor = tensor.contiguous()
        group = self.return_group if back else None
        if self.send_stream is not None:
            self.send_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.send_stream):
                work = dist.isend(tensor, dst, group=group)
            tensor.record_stream(self.send_stream)
        else:
            work = dist.isend(tensor, dst, group=group)
        self._sends.append((work, tensor))
        if self.send_stream is not None:
            self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]
        while len(self._sends) > MAX_PENDING_SENDS:
            self._sends.pop(0)[0].wait()

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, back: bool = False) -> torch.Tensor:
        """Receive from rank `src`; on CUDA the current stream is made to wait for the transfer."""
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        group = self.return_group if back else None
        if self.recv_stream is not None:
            with torch.cuda.stream(self.recv_stream):
                dist.irecv(buf, src, group=group).wait()
            torch.cuda.current_stream(self.device).wait_stream(self.recv_stream)
        else:
            dist.irecv(buf, src, group=group).wait()
        return buf

    def flush(self) -> None:
        """Wait for every send posted so far (before exiting)."""
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
