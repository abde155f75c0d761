"""The stream session's CUDA streams, and the priority of the one a viewer waits on.

A session overlaps three kinds of work: the encode of the next chunk (side stream), the denoise
of this one and the decode of the one before. Only the decode's output is what someone is
waiting to see; the encode and the denoise feed chunks that leave later. So the decode stream
is created at the highest priority torch offers: when SMs free up, the block scheduler hands
them to the decode's waiting blocks before the other streams' (a hint: running blocks are not
preempted and the total work does not change). CUDA graphs replayed on the decode stream take
its priority (graphs are not instantiated with per-node priorities here).

A live LoRA scale change merges the adapted weights between two forwards, and the next forward
waits for it. Beside the VAE's convolutions the merge's short, memory-bound kernels queue for SMs
and the forward behind them waits the longer; so the merge gets a stream of its own at the highest
priority, joined to the denoise stream before and after.

On a CPU there are no streams; with `memory.low_vram` the decode and the merge run on the denoise
stream (one memory pool; the merge's low_vram path allocates on the host side), so there is no
decode or merge stream to raise.

The edit family has the same shape of work with other names: its main stream (UNet and decode) makes
the batch a viewer waits for, while the side stream encodes the next batch and the prompt encoder's
stream refreshes the conditioning now and then, a long call that would otherwise take SMs from the
batch in flight. So its main stream is the one raised.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_PRIORITY = 0  # CUDA's and torch's default: lower numbers are higher priorities


@dataclass(frozen=True)
class SessionStreams:
    """The session's streams; None where the work runs on the caller's (or the denoise) stream."""

    side: torch.cuda.Stream | None
    denoise: torch.cuda.Stream | None
    decode: torch.cuda.Stream | None
    merge: torch.cuda.Stream | None = None


def highest_priority() -> int:
    """The highest stream priority torch's stream pools serve on this device (a negative number).

    `torch.cuda.Stream.priority_range()` gives (least, greatest) as torch serves them, already
    limited to its pools' levels; a value beyond it would be clamped anyway.
    """
    _least, greatest = torch.cuda.Stream.priority_range()
    return int(greatest)


def session_streams(device: torch.device, *, separate_decode: bool, decode_priority: bool,
                    merge_stream: bool = True) -> SessionStreams:
    """The streams a session on `device` runs on.

    `separate_decode`: the decode gets a stream of its own (false with low_vram);
    `decode_priority`: that stream runs at `highest_priority()`, else at the default;
    `merge_stream`: with a separate decode, the LoRA merge gets a stream at `highest_priority()`
    (else it runs on the denoise stream).
    """
    if device.type != "cuda":
        return SessionStreams(None, None, None)
    side = torch.cuda.Stream(device)
    denoise = torch.cuda.Stream(device)
    if not separate_decode:
        return SessionStreams(side, denoise, None)
    decode = torch.cuda.Stream(device, priority=highest_priority() if decode_priority else DEFAULT_PRIORITY)
    merge = torch.cuda.Stream(device, priority=highest_priority()) if merge_stream else None
    return SessionStreams(side, denoise, decode, merge)


@dataclass(frozen=True)
class EditStreams:
    """The edit session's streams; None on a CPU. `side` is `main` itself without two streams."""

    main: torch.cuda.Stream | None
    side: torch.cuda.Stream | None
    encoder: torch.cuda.Stream | None


def edit_streams(device: torch.device, *, two_streams: bool, main_priority: bool) -> EditStreams:
    """The streams an edit session on `device` runs on: `main_priority` puts the main stream at
    `highest_priority()`, the side and the prompt encoder's at the default."""
    if device.type != "cuda":
        return EditStreams(None, None, None)
    main = torch.cuda.Stream(device, priority=highest_priority() if main_priority else DEFAULT_PRIORITY)
    side = torch.cuda.Stream(device) if two_streams else main
    return EditStreams(main, side, torch.cuda.Stream(device))
