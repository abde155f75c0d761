"""Spatially tiled streaming VAE: encode/decode on overlapping tiles to cap activation memory.

Why: a video VAE's activations grow with the frame area (the Wan2.1 decoder's last level
alone holds 96-channel tensors of every output frame at full resolution, plus their causal
histories), and with the weights being small (a few hundred MB) they decide the VAE's share of a
small card. Cutting the frame into tiles that run one after the other bounds the largest
activation by the tile area instead (and the mid-block attention's score matrix by its square).

How: the latent grid is covered by overlapping tiles of at most `tile_latents` cells a side
(one latent cell is `LATENT_SCALE` pixels for both the Wan2.1 VAE and TAEHV). Each tile is its own
stream over its crop of the latents (decode) or pixels (encode), with its own `VAEStreamState`
that persists across chunks, so streaming stays exact per tile: a tiled stream equals the
tiled one-shot result. Tile outputs are blended with linear ramps across each overlap; the
per-axis weights are normalised so that they sum to 1 at every position, and are exactly 1
where only one tile covers a position. A frame that fits in one tile is passed to the model
untouched, which gives exactly the untiled result.

What is not exact: tiles see zero padding at their borders instead of their neighbours, and
the Wan VAE's mid-block attention spans the whole (tile) frame; both reach beyond any finite
overlap. The overlap ramps hide the seams; a larger overlap brings the result closer to the
untiled one at the price of more computation.

CUDA graphs: the state's `encoder` / `decoder` expose `started` and `buffers` like a
`FrameCache`, so `VAEGraphs` / `GraphedStep` can capture a whole tiled step. The tiling plan and
its weight maps are built on the first (eager) chunk and kept across `reset()` while the frame
size stays the same, so captured graphs stay valid.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from loom_live.engine.cache.vae_cache import VAEStreamState, check_signature
from loom_live.engine.models.wan_vae import SPACE_STRIDE, decode_in_pieces, encode_in_pieces

LATENT_SCALE = SPACE_STRIDE  # pixels per latent cell along H and W (Wan2.1 VAE and TAEHV alike)
DEFAULT_TILE_LATENTS = 32  # 256 px
DEFAULT_OVERLAP_LATENTS = 8  # 64 px

Span = tuple[int, int]  # [start, end) in latent cells


class StreamingVAE(Protocol):
    """What `TiledVAE` wraps: the stream interface of `WanVAE` and `TinyVAE`."""

    def new_stream_state(self) -> VAEStreamState: ...
    def encode_stream(self, x: torch.Tensor, state: VAEStreamState) -> torch.Tensor: ...
    def decode_stream(self, z: torch.Tensor, state: VAEStreamState) -> torch.Tensor: ...


def tile_spans(length: int, tile: int, overlap: int) -> list[Span]:
    """Cover [0, length) with as few tiles of at most `tile` cells as an `overlap` allows.

    All tiles along an axis get one size (one compiled shape), the smallest that covers with
    that many tiles, and are spread evenly from 0 to `length`, so every overlap is at least
    `overlap` and no more cells are computed twice than needed. A length that fits in one tile
    gives one tile of that length.
    """
    if length <= tile:
        return [(0, length)]
    count = math.ceil((length - overlap) / (tile - overlap))
    size = math.ceil((length + (count - 1) * overlap) / count)
    return [(s, s + size) for s in (i * (length - size) // (count - 1) for i in range(count))]


def blend_weights(spans: list[Span], scale: int) -> list[torch.Tensor]:
    """Per-tile float32 weights along one axis, in output units (`scale` per latent cell).

    Each tile's weight ramps linearly across its overlap with the previous and the next tile
    (at sample centres, so two tiles sharing an overlap have weights summing to 1), is 1
    elsewhere, and the weights are then divided by their sum so they total 1 at every position
    even where more than two tiles meet.
    """
    raw = []
    for i, (start, end) in enumerate(spans):
        pos = torch.arange(start * scale, end * scale, dtype=torch.float64) + 0.5
        w = torch.ones_like(pos)
        if i > 0 and spans[i - 1][1] > start:
            w = torch.minimum(w, (pos - start * scale) / ((spans[i - 1][1] - start) * scale))
        if i + 1 < len(spans) and spans[i + 1][0] < end:
            w = torch.minimum(w, (end * scale - pos) / ((end - spans[i + 1][0]) * scale))
        raw.append(w)
    total = torch.zeros(spans[-1][1] * scale, dtype=torch.float64)
    for (start, end), w in zip(spans, raw):
        total[start * scale:end * scale] += w
    return [(w / total[s * scale:e * scale]).float() for (s, e), w in zip(spans, raw)]


@dataclass
class TilePlan:
    """Where the tiles of one direction lie (latent cells) and their 2D output weight maps."""

    rows: list[Span]
    cols: list[Span]
    out_scale: int  # output units per latent cell: LATENT_SCALE for decode, 1 for encode
    weights: list[torch.Tensor] = field(default_factory=list)  # [1, 1, 1, h, w] per tile, row-major
    device: torch.device | None = None

    @property
    def tiles(self) -> list[tuple[Span, Span]]:
        return [(r, c) for r in self.rows for c in self.cols]

    def build_weights(self, device: torch.device) -> None:
        self.device = device
        if len(self.rows) * len(self.cols) == 1:
            return  # one tile is passed through as is: no blending
        wr, wc = blend_weights(self.rows, self.out_scale), blend_weights(self.cols, self.out_scale)
        self.weights = [(a[:, None] * b[None, :]).to(device)[None, None, None] for a in wr for b in wc]

    def nbytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in self.weights)


class TiledCache:
    """One direction's tiled stream: the plan and one inner stream state per tile.

    Looks like a `FrameCache` to `VAEGraphs` / `GraphedStep` (`started`, `buffers`,
    `signature`), so a tiled step can be captured and its histories restored.
    """

    def __init__(self, direction: str, new_state: Callable[[], VAEStreamState]) -> None:
        self.direction = direction  # "encoder" or "decoder": which cache of each tile state
        self.new_state = new_state
        self.plan: TilePlan | None = None
        self.signature: tuple | None = None
        self.states: list[VAEStreamState] = []

    @property
    def started(self) -> bool:
        return bool(self.states) and all(getattr(s, self.direction).started for s in self.states)

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        return {f"tile{i}.{key}": buf for i, s in enumerate(self.states)
                for key, buf in getattr(s, self.direction).buffers.items()}

    def start(self, plan: TilePlan, device: torch.device) -> None:
        """Adopt the first chunk's plan; an unchanged plan is kept (its weights may be in a graph)."""
        old = self.plan
        if old is None or (old.rows, old.cols, old.out_scale, old.device) != (plan.rows, plan.cols,
                                                                             plan.out_scale, device):
            plan.build_weights(device)
            self.plan = plan
        count = len(plan.rows) * len(plan.cols)
        self.states = self.states[:count] + [self.new_state() for _ in range(count - len(self.states))]

    def reset(self) -> None:
        """Start a new stream: tile histories zeroed in place; a new frame size is accepted."""
        for s in self.states:
            getattr(s, self.direction).reset()
        self.signature = None

    def copy(self) -> TiledCache:
        other = TiledCache(self.direction, self.new_state)
        other.plan, other.signature = self.plan, self.signature  # the plan is never mutated once built
        other.states = [s.copy() for s in self.states]
        return other

    def nbytes(self) -> int:
        history = sum(getattr(s, self.direction).nbytes() for s in self.states)
        return history + (self.plan.nbytes() if self.plan is not None else 0)


class TiledStreamState:
    """A tiled stream's state: an encode and a decode `TiledCache` (like `VAEStreamState`)."""

    def __init__(self, new_state: Callable[[], VAEStreamState]) -> None:
        self.encoder = TiledCache("encoder", new_state)
        self.decoder = TiledCache("decoder", new_state)

    def reset(self) -> None:
        self.encoder.reset()
        self.decoder.reset()

    def copy(self) -> TiledStreamState:
        """An independent snapshot: continuing either stream leaves the other untouched."""
        other = TiledStreamState(self.encoder.new_state)
        other.encoder, other.decoder = self.encoder.copy(), self.decoder.copy()
        return other

    def nbytes(self) -> int:
        """Bytes held: every tile's frame histories plus the blend weight maps."""
        return self.encoder.nbytes() + self.decoder.nbytes()


class TiledVAE:
    """Runs a streaming VAE (`WanVAE`, `TinyVAE`) on overlapping spatial tiles; same stream API.

    `tile_latents`: the largest tile side in latent cells (`LATENT_SCALE` pixels each; the
    activation memory bound); `overlap_latents`: the least overlap between neighbouring tiles,
    in latent cells. The defaults are the tile and overlap diffusers' AutoencoderKLWan tiling
    uses (256 px tiles, 64 px overlap). Frames no larger than one tile run untiled (exactly the
    wrapped model's result).
    """

    def __init__(self, vae: StreamingVAE, tile_latents: int = DEFAULT_TILE_LATENTS,
                 overlap_latents: int = DEFAULT_OVERLAP_LATENTS) -> None:
        for name, value in (("tile_latents", tile_latents), ("overlap_latents", overlap_latents)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"TiledVAE: {name} must be an int (latent cells of {LATENT_SCALE} pixels), "
                                 f"got {value!r}")
        if not tile_latents > overlap_latents >= 0:
            raise ValueError(f"TiledVAE: need tile_latents > overlap_latents >= 0, got tile_latents="
                             f"{tile_latents}, overlap_latents={overlap_latents}")
        for method in ("encode_stream", "decode_stream", "new_stream_state"):
            if not callable(getattr(vae, method, None)):
                raise ValueError(f"TiledVAE: {type(vae).__name__} has no {method}(); wrap a streaming VAE "
                                 "such as WanVAE or TinyVAE")
        self.vae = vae
        self.tile_latents = tile_latents
        self.overlap_latents = overlap_latents

    @property
    def dtype(self) -> torch.dtype:
        return self.vae.dtype

    def new_stream_state(self) -> TiledStreamState:
        return TiledStreamState(self.vae.new_stream_state)

    def encode_stream(self, x: torch.Tensor, state: TiledStreamState) -> torch.Tensor:
        """Encode the next pixel chunk [B, 3, T, H, W] tile by tile -> latents [B, z, T', H/8, W/8]."""
        _check_chunk(x, LATENT_SCALE, "TiledVAE.encode_stream", "pixels [B, 3, T, H, W]")
        h, w = x.shape[3] // LATENT_SCALE, x.shape[4] // LATENT_SCALE
        return self._run(self.vae.encode_stream, x, state.encoder, (h, w), LATENT_SCALE, 1,
                         "TiledVAE.encode_stream")

    def decode_stream(self, z: torch.Tensor, state: TiledStreamState) -> torch.Tensor:
        """Decode the next latents [B, z, T', h, w] tile by tile -> pixels [B, 3, T, 8h, 8w]."""
        _check_chunk(z, 1, "TiledVAE.decode_stream", "latents [B, z_dim, T, h, w]")
        return self._run(self.vae.decode_stream, z, state.decoder, tuple(z.shape[3:]), 1, LATENT_SCALE,
                         "TiledVAE.decode_stream")

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """One-shot tiled encode of a whole clip (1 + 4k frames), run as a tiled stream."""
        return encode_in_pieces(self.encode_stream, x, self.new_stream_state())

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """One-shot tiled decode of a whole latent clip."""
        return decode_in_pieces(self.decode_stream, z, self.new_stream_state())

    def plan(self, latent_size: tuple[int, int], out_scale: int) -> TilePlan:
        """The tiles for a frame of `latent_size` (h, w) latent cells; `out_scale` is the output's units per cell."""
        rows = tile_spans(latent_size[0], self.tile_latents, self.overlap_latents)
        cols = tile_spans(latent_size[1], self.tile_latents, self.overlap_latents)
        return TilePlan(rows, cols, out_scale)

    def _run(self, step: Callable[[torch.Tensor, VAEStreamState], torch.Tensor], x: torch.Tensor,
             cache: TiledCache, latent_size: tuple[int, int], in_scale: int, out_scale: int,
             what: str) -> torch.Tensor:
        signature = (x.shape[0], *x.shape[3:], x.device)
        if cache.signature is not None:
            check_signature(cache, signature, what)
        else:
            cache.start(self.plan(latent_size, out_scale), x.device)
        plan = cache.plan
        if len(cache.states) == 1:
            out = step(x, cache.states[0])
        else:
            out = None
            layout = _layout(x)
            for ((r0, r1), (c0, c1)), tile_state, weight in zip(plan.tiles, cache.states, plan.weights):
                crop = x[..., r0 * in_scale:r1 * in_scale, c0 * in_scale:c1 * in_scale]
                y = step(crop.contiguous(memory_format=layout), tile_state)
                if out is None:
                    out = y.new_zeros((*y.shape[:3], latent_size[0] * out_scale, latent_size[1] * out_scale),
                                      dtype=torch.float32)
                out[..., r0 * out_scale:r1 * out_scale, c0 * out_scale:c1 * out_scale].add_(y * weight)
            out = out.to(y.dtype)
        cache.signature = signature  # only once the chunk went through: a refused first chunk starts nothing
        return out


def _layout(x: torch.Tensor) -> torch.memory_format:
    """Crops keep the chunk's layout (the session feeds channels-last 3D pixels on CUDA)."""
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d) and not x.is_contiguous():
        return torch.channels_last_3d
    return torch.contiguous_format


def _check_chunk(x: torch.Tensor, multiple: int, what: str, expected: str) -> None:
    """The frame-size checks tiling needs before cutting; channels and frame counts are the model's."""
    if not isinstance(x, torch.Tensor) or x.dim() != 5 or not x.is_floating_point():
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{what}: expected float {expected}, got {got}")
    h, w = x.shape[3:]
    if h == 0 or w == 0 or h % multiple or w % multiple:
        raise ValueError(f"{what}: height and width must be positive multiples of {multiple}, got {h}x{w}")
