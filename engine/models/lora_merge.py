"""The LoRA merge as one fixed device program, with the scales in a device tensor.

Why: a live scale change must not stall the stream. Recomputing each adapted weight from Python,
with the scale as a host number in every kernel call, costs a loop over hundreds of weights per
change. Here every adapted weight's factors sit concatenated once, W = W0 + [B_1 .. B_n] @
[s_1 a_1 A_1; ...; s_n a_n A_n], and the scales s_i are read from a small device tensor. A change
writes the new scales into that tensor and runs the same kernels on the same tensors again; on
CUDA those kernels are captured once as a CUDA graph and replayed, so a change is a few tiny
writes and one graph launch. Nothing a captured DiT graph or a compiled region reads changes
address or shape: no recapture, no recompile.

The down factors of all weights with the same input width are stacked in one buffer, so scaling
them is one kernel per width; each weight then takes one `addmm` from its kept original straight
into the parameter (in place: the tensors captured graphs read stay valid). Scaled factors are
rounded to the weight's dtype once, the sum over LoRAs accumulates in the matmul's float32; with
every scale at 0 each weight is its original again (W0 + 0). A LoRA's full weight delta (`.diff`)
is added after the `addmm`, times its scale read from the same tensor: one more rounding there.
A vector parameter (a linear layer's bias, a norm's weight and bias) takes no factors: it is its
original plus its LoRAs' full deltas times their scales, summed in float32 and rounded once.

The layers can be split into `parts` runs of about equal size, each its own graph, so a caller can
spread one change over several steps of a stream (`run(part)`): a part scales only its own rows of
the stacked factors, so running every part once is the whole merge.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loom_live.engine.graphs.capture_clock import CAPTURES


@dataclass
class MergeTarget:
    """One adapted layer: its parameters, their originals, and per LoRA (lora index, down, up, alpha, bias
    delta, weight delta); the deltas are None where a LoRA has none. A linear layer's weight is a matrix its
    factors multiply to; a norm's weight is a vector, changed by its full deltas alone (down and up None)."""

    weight: torch.Tensor
    base: torch.Tensor
    parts: Sequence[tuple[int, torch.Tensor | None, torch.Tensor | None, float, torch.Tensor | None,
                          torch.Tensor | None]]
    bias: torch.Tensor | None = None
    base_bias: torch.Tensor | None = None


@dataclass
class _Group:
    """The down factors of every weight of one input width, stacked, with each row's LoRA and alpha."""

    down: torch.Tensor  # [R, in], the weights' dtype
    lora: torch.Tensor  # [R] long: which scale each row takes
    alpha: torch.Tensor  # [R] float32
    scaled: torch.Tensor  # [R, in]: down * s * alpha, written by each run


@dataclass
class _Part:
    """A run of consecutive layers and, per input width, the rows of the stacked factors they use."""

    targets: range  # the layers' indices among the targets, in build order
    layers: list[_Layer]
    rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]  # (down, lora, alpha, scaled) views


@dataclass
class _Matrix:
    """A linear layer's weight: its original plus the LoRAs' up factors times their scaled down rows (one
    addmm), plus the LoRAs' full deltas."""

    base: torch.Tensor
    up: torch.Tensor  # [out, K]: the LoRAs' up factors side by side
    width: int  # the group holding its down rows
    rows: slice
    deltas: list[tuple[torch.Tensor, torch.Tensor]]  # (its LoRA's scale: a view of `scales`, [out, in])
    ranks: list[int]  # of its parts, in order


@dataclass
class _Sum:
    """A vector parameter: its original plus each LoRA's full delta times that LoRA's scale, in float32."""

    param: torch.Tensor
    base: torch.Tensor
    deltas: torch.Tensor  # [m, n] float32
    lora: torch.Tensor  # [m] long: which scale each delta takes

    def run(self, scales: torch.Tensor) -> None:
        self.param.copy_(self.base.float() + (scales[self.lora][:, None] * self.deltas).sum(0))


def _sums(param: torch.Tensor | None, base: torch.Tensor | None,
          deltas: list[tuple[int, torch.Tensor]]) -> list[_Sum]:
    """The merge of a vector parameter from its LoRAs' (index, delta) pairs: one, or none where it has no
    deltas (then `param` may be None: a layer without a bias)."""
    if not deltas:
        return []
    stacked = torch.stack([d.float() for _, d in deltas]).to(param.device)
    return [_Sum(param, base, stacked, torch.tensor([i for i, _ in deltas], device=param.device))]


@dataclass
class _Layer:
    """One target, written in place: a linear layer's weight by its matrix merge, a norm's weight by a sum."""

    weight: torch.Tensor
    matrix: _Matrix | None  # a linear layer's weight; None for a norm's (a vector: among `sums`)
    sums: list[_Sum]  # its vector parameters with deltas: a bias, a norm's weight


class MergeProgram:
    """Merges every target at the scales in `scales` (a float32 device tensor, one entry per LoRA).

    `set_scale` writes one entry (no host synchronisation); `run` merges, all of it or one of its
    `parts`; `capture` (CUDA) records each part as a CUDA graph that later runs replay. Rebuild the
    program when the set of LoRAs or layers changes (loading, a pipeline block move); never for a
    scale change.
    """

    def __init__(self, targets: Sequence[MergeTarget], scales: Sequence[float], device: torch.device,
                 parts: int = 1) -> None:
        if parts < 1:
            raise ValueError(f"parts: {parts} is not allowed; expected 1 or more")
        self.scales = torch.tensor(list(scales), dtype=torch.float32, device=device)
        self.captures = 0
        self._graphs: list[torch.cuda.CUDAGraph] = []
        self._groups: dict[int, _Group] = {}
        self._layers: list[_Layer] = []
        self._build(targets)
        self._parts = self._split(min(parts, len(self._layers)))

    @property
    def parts(self) -> int:
        return len(self._parts)

    def _build(self, targets: Sequence[MergeTarget]) -> None:
        rows: dict[int, list[tuple[int, torch.Tensor, float]]] = {}
        for t in targets:
            full = [(i, d) for i, _, _, _, _, d in t.parts if d is not None]
            sums = _sums(t.bias, t.base_bias, [(i, b) for i, _, _, _, b, _ in t.parts if b is not None])
            if t.weight.ndim == 1:  # a norm's weight
                self._layers.append(_Layer(t.weight, None, _sums(t.weight, t.base, full) + sums))
                continue
            width = t.weight.shape[1]
            group = rows.setdefault(width, [])
            start = sum(d.shape[0] for _, d, _ in group)
            group += [(i, down, alpha) for i, down, _, alpha, _, _ in t.parts]
            stop = start + sum(down.shape[0] for _, down, _, _, _, _ in t.parts)
            up = torch.cat([u for _, _, u, _, _, _ in t.parts], dim=1)
            matrix = _Matrix(t.base, up, width, slice(start, stop), [(self.scales[i], d) for i, d in full],
                             [d.shape[0] for _, d, _, _, _, _ in t.parts])
            self._layers.append(_Layer(t.weight, matrix, sums))
        for width, group in rows.items():
            down = torch.cat([d for _, d, _ in group])
            lora = torch.tensor([i for i, d, _ in group for _ in range(d.shape[0])], dtype=torch.long,
                                device=down.device)  # long even when empty (layers changed by full deltas alone)
            alpha = torch.tensor([a for _, d, a in group for _ in range(d.shape[0])], dtype=torch.float32,
                                 device=down.device)
            self._groups[width] = _Group(down, lora, alpha, torch.empty_like(down))

    def _split(self, parts: int) -> list[_Part]:
        """`parts` runs of consecutive layers, cut where the weights' running size passes each equal
        share; with each run, per width, the contiguous rows its layers hold in that width's group."""
        sizes = [layer.weight.numel() for layer in self._layers]
        total, runs, start, acc = sum(sizes), [], 0, 0
        for i, size in enumerate(sizes):
            acc += size
            if acc * parts >= total * (len(runs) + 1) and len(runs) < parts - 1:
                runs.append(self._layers[start:i + 1])
                start = i + 1
        runs.append(self._layers[start:])
        out, first = [], 0
        for layers in (r for r in runs if r):
            targets, first = range(first, first + len(layers)), first + len(layers)
            rows = []
            matrices = [layer.matrix for layer in layers if layer.matrix is not None]
            for width in dict.fromkeys(m.width for m in matrices):
                mine = [m.rows for m in matrices if m.width == width]
                g, span = self._groups[width], slice(mine[0].start, mine[-1].stop)
                rows.append((g.down[span], g.lora[span], g.alpha[span], g.scaled[span]))
            out.append(_Part(targets, layers, rows))
        return out

    def part_targets(self, part: int | None = None) -> range:
        """The targets (their indices, in the order given) that `run(part)` rewrites; None: every one."""
        return range(len(self._layers)) if part is None else self._parts[part].targets

    def factor_views(self) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Per target (in build order), per part: (down, up) as views into the program's buffers, so
        the caller can let go of its own copies (a norm's target: none, it has no factors)."""
        views = []
        for m in (layer.matrix for layer in self._layers):
            parts = []
            if m is not None:
                down, start = self._groups[m.width].down, m.rows.start
                for rank in m.ranks:
                    k = start - m.rows.start
                    parts.append((down[start:start + rank], m.up[:, k:k + rank]))
                    start += rank
            views.append(parts)
        return views

    def set_scale(self, index: int, value: float) -> None:
        """One LoRA's scale, written on the device in stream order (no host synchronisation)."""
        self.scales[index].fill_(float(value))

    @torch.no_grad()
    def run(self, part: int | None = None) -> None:
        """Merge the layers of one part (None: every part) at the current scales, replaying the
        captured graphs where there are some."""
        for i in range(self.parts) if part is None else (part,):
            if self._graphs:
                self._graphs[i].replay()
            else:
                self._run_part(self._parts[i])

    def _run_part(self, part: _Part) -> None:
        for down, lora, alpha, scaled in part.rows:
            scaled.copy_(down * (self.scales[lora] * alpha)[:, None])
        for layer in part.layers:
            m = layer.matrix
            if m is not None:
                torch.addmm(m.base, m.up, self._groups[m.width].scaled[m.rows], out=layer.weight)
                for scale, delta in m.deltas:
                    layer.weight.addcmul_(delta, scale)
            for vector in layer.sums:
                vector.run(self.scales)

    @torch.no_grad()
    def capture(self) -> None:
        """Record each part as a CUDA graph (CUDA only; a no-op elsewhere). Runs them once first."""
        if self.scales.device.type != "cuda" or self._graphs:
            return
        self.run()  # eager run: kernels chosen and workspaces allocated before the capture
        graphs = []
        for part in self._parts:
            graph = torch.cuda.CUDAGraph()
            with CAPTURES.timed(), torch.cuda.graph(graph):
                self._run_part(part)
            graphs.append(graph)
        self._graphs = graphs
        self.captures += 1

    @property
    def captured(self) -> bool:
        return bool(self._graphs)
