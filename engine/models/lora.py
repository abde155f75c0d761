"""Style LoRAs for the Wan DiT: read the layouts people share, merge them into the weights in place.

A LoRA adds `scale * (alpha / rank) * up @ down` to a linear layer's weight. Loom merges that
sum straight into the parameters the forward (and its CUDA graphs) already reads, so the hot
path is the same with or without LoRAs: no extra matmuls, no recapture. A live scale change
recomputes the adapted weights from kept copies of the originals (`lora_merge`: one device
program with the scales in a device tensor), so any mix of scales is exact to one rounding (one
more for a layer with a full weight delta) and all scales at 0 restore the original values.

Layouts read (each key translated on its own but a block's norms, names checked against the model):
- diffusers / PEFT: `transformer.blocks.N.attn1.to_q.lora_A.weight` / `lora_B` (diffusers names);
- the original Wan layout: `diffusion_model.blocks.N.self_attn.q.lora_A.weight` (or
  `lora_down`/`lora_up`), with optional `.alpha`, `.diff_b` (a bias delta) and `.diff` (a full
  weight delta, taken at the LoRA's scale like the low-rank product, without alpha);
- kohya / musubi-tuner: `lora_unet_blocks_N_self_attn_q.lora_down.weight`, `.lora_up`, `.alpha`.
Linear layers take all of these. Norms with a weight (the attentions' RMSNorms `norm_q`/`norm_k`,
the cross-attention LayerNorm `norm3`) take `.diff` and `.diff_b` too, as ComfyUI adds them:
weight = original + scale * diff. A delta for a norm that only normalises (Wan's norm1, norm2 and
the head's norm: no weight, no bias) or for another parameter (a modulation, the patch embedding)
is refused, naming its keys. A block's norm2 and norm3 are different norms in diffusers' names
than in Wan's, so a file's other keys say which names its norms use.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from loom_live.engine.models.checkpoint_io import CheckpointError, checkpoint_files, iter_tensors
from loom_live.engine.models.dit_convert import to_wan_key
from loom_live.engine.models.lora_merge import MergeProgram, MergeTarget
from loom_live.engine.models.wan_dit import RMSNorm

log = logging.getLogger(__name__)

PREFIXES = ("base_model.model.", "model.diffusion_model.", "diffusion_model.", "transformer.")
KOHYA_PREFIX = "lora_unet_"
# suffix -> role; the PEFT adapter-name form (`lora_A.default.weight`) is accepted too
ROLES = {"lora_A": "down", "lora_down": "down", "lora_B": "up", "lora_up": "up"}
_ROLE_RE = re.compile(r"^(?P<module>.+?)\.(?P<role>lora_A|lora_B|lora_down|lora_up)(?:\.[\w-]+)?\.weight$")
# key suffix -> role of the tensors that are not factors
SUFFIX_ROLES = {".alpha": "alpha", ".diff_b": "bias", ".diff": "diff"}
NAMES = {"down": "lora_down", "up": "lora_up", "diff": "diff", "bias": "diff_b"}  # roles as errors say them
MAX_LISTED = 8
NORMS = (nn.LayerNorm, nn.RMSNorm, RMSNorm)  # norms a LoRA's full deltas merge into, where they have a weight
BLOCK_RE = re.compile(r"^(?:vace_)?blocks\.\d+$")
BLOCK_NORM_RE = re.compile(r"^(?P<block>(?:vace_)?blocks\.\d+\.)(?P<norm>norm[123])$")
# a block's norms in diffusers' names -> Wan's: diffusers' norm2 is the cross-attention norm (Wan's norm3)
DIFFUSERS_BLOCK_NORMS = {"norm1": "norm1", "norm2": "norm3", "norm3": "norm2"}
REFUSALS = {  # why a file is refused, in the order the reasons are said
    "unknown": "keys that are not LoRA weights of a Wan2.1 DiT",
    "missing": "modules this model does not have",
    "weightless": "deltas for norms that only normalise, with no weight or bias to add them to "
                  "(elementwise_affine=False: Wan's norm1, norm2 and the head's norm)",
    "other": "updates for parameters a LoRA does not merge into (linear layers take lora_down/lora_up or "
             "lora_A/lora_B pairs, .diff and .diff_b; norms with a weight take .diff and .diff_b)",
    "shape": "shapes that do not fit this model (a LoRA for another model size?)",
    "rank0": "rank-0 updates (down/A factors with no rows: nothing to merge, and alpha / rank is undefined)",
    "no_bias": "bias deltas for layers that have no bias",
}


class LoraError(CheckpointError):
    """A LoRA file that does not fit the model: names the file, the keys and the shapes."""


@dataclass
class LowRank:
    """One adapted layer: delta = alpha_scale * up @ down (+ diff), plus an optional bias delta. A linear
    layer a file changes by full deltas alone has rank 0 here (down [0, in], up [out, 0]): the merge adds
    nothing for it but the deltas. A norm has no factors (down and up None): its weight, a vector, changes
    by `diff` alone."""

    down: torch.Tensor | None  # [rank, in]
    up: torch.Tensor | None  # [out, rank]
    alpha_scale: float = 1.0
    bias: torch.Tensor | None = None
    diff: torch.Tensor | None = None  # the weight's shape: a full weight delta

    def delta(self) -> torch.Tensor | None:
        """The weight's delta at scale 1, in float32; None for a norm's update of its bias alone."""
        if self.down is None:
            return None if self.diff is None else self.diff.float()
        delta = (self.up.float() @ self.down.float()) * self.alpha_scale
        return delta if self.diff is None else delta + self.diff.float()


@dataclass
class LoraFile:
    """A parsed LoRA: per WanDiT module name (`blocks.3.self_attn.q`), its update."""

    name: str
    path: Path
    modules: dict[str, LowRank] = field(default_factory=dict)

    @property
    def ranks(self) -> list[int]:
        """The ranks of its low-rank updates (a layer changed by full deltas alone has none)."""
        return sorted({m.down.shape[0] for m in self.modules.values() if m.down is not None and m.down.shape[0]})


def _adaptable(model: nn.Module) -> dict[str, nn.Module]:
    """The layers a LoRA merges into: linear layers, and norms with a weight."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, nn.Linear) or isinstance(m, NORMS) and m.weight is not None}


def _bias(layer: nn.Module) -> torch.Tensor | None:
    """The layer's bias, if it has one (an RMSNorm never does)."""
    return None if isinstance(layer, (nn.RMSNorm, RMSNorm)) else layer.bias


def _weightless_norms(model: nn.Module) -> set[str]:
    """The names of the model's norms that only normalise: Wan computes its blocks' norm1 and norm2 and the
    head's norm in the forward (`norm_modulate`), so they are no modules and are known by name here."""
    modules = dict(model.named_modules())
    names = {f"{block}.{norm}" for block in modules if BLOCK_RE.match(block) for norm in ("norm1", "norm2")}
    names |= {n for n, m in modules.items() if isinstance(m, NORMS) and m.weight is None}
    return names | ({"head.norm"} if "head" in modules else set())


def _unprefixed(raw: str) -> str:
    for prefix in PREFIXES:
        if raw.startswith(prefix):
            return raw[len(prefix):]
    return raw


def _diffusers_named(raws: Iterable[str]) -> bool:
    """Whether a file names its layers as diffusers does (attn1.to_q, ffn.net.0.proj); its block norms' names
    are then diffusers' too. A file of norm deltas alone is read in Wan's names (ComfyUI writes those)."""
    names = (_unprefixed(raw) for raw in raws)
    return any(not BLOCK_NORM_RE.match(n) and to_wan_key(n + ".weight") != n + ".weight" for n in names)


def _module_name(raw: str, kohya: dict[str, str], diffusers: bool) -> str:
    """A file's module path in any layout -> WanDiT's module name (unknown names pass through)."""
    if raw.startswith(KOHYA_PREFIX):
        return kohya.get(raw[len(KOHYA_PREFIX):], raw)
    raw = _unprefixed(raw)
    norm = BLOCK_NORM_RE.match(raw)
    if norm:
        return norm["block"] + (DIFFUSERS_BLOCK_NORMS[norm["norm"]] if diffusers else norm["norm"])
    return to_wan_key(raw + ".weight").removesuffix(".weight")


def _group(tensors: dict[str, torch.Tensor], kohya: dict[str, str]) -> tuple[dict, list[str]]:
    """Tensors by target module and role ('down', 'up', 'alpha', 'bias', 'diff'); keys not understood."""
    found: dict[str, tuple[str, str]] = {}  # key -> (module as the file names it, role)
    unknown: list[str] = []
    for key in tensors:
        m = _ROLE_RE.match(key)
        suffix = next((s for s in SUFFIX_ROLES if key.endswith(s)), None)
        if m:
            found[key] = m["module"], ROLES[m["role"]]
        elif suffix:
            found[key] = key.removesuffix(suffix), SUFFIX_ROLES[suffix]
        else:
            unknown.append(key)
    diffusers = _diffusers_named(raw for raw, _ in found.values())
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, (raw, role) in found.items():
        parts.setdefault(_module_name(raw, kohya, diffusers), {})[role] = tensors[key]
    return parts, unknown


def _fits(roles: dict[str, torch.Tensor], down: torch.Tensor | None, up: torch.Tensor | None,
          shape: tuple[int, ...]) -> bool:
    """The factors (a linear layer's) multiply to a weight of `shape` and each full delta is its parameter's
    shape (a bias: the weight's first dimension)."""
    factors = down is None or (down.ndim == up.ndim == 2 and down.shape[0] == up.shape[1]
                               and (up.shape[0], down.shape[1]) == shape)
    return (factors and ("diff" not in roles or tuple(roles["diff"].shape) == shape)
            and ("bias" not in roles or tuple(roles["bias"].shape) == shape[:1]))


def _keys(module: str, roles: Iterable[str]) -> list[str]:
    return [f"{module}.{NAMES[r]}" for r in NAMES if r in roles]


def _update(module: str, roles: dict[str, torch.Tensor], layer: nn.Module,
            meta: bool) -> LowRank | tuple[str, list[str]]:
    """What `roles` do to `layer` (a linear layer or a norm with a weight), or why they are refused (a key of
    REFUSALS) and what to name."""
    pair, weight = "down" in roles, layer.weight
    if pair and not isinstance(layer, nn.Linear):  # a norm's weight is a vector: no low-rank product
        return "other", _keys(module, ("down", "up"))
    down, up = None, None
    if isinstance(layer, nn.Linear):
        out, width = weight.shape
        down, up = (roles["down"], roles["up"]) if pair else (torch.zeros(0, width), torch.zeros(out, 0))
    if not _fits(roles, down, up, tuple(weight.shape)):
        shapes = " ".join(f"{NAMES[r]} {tuple(roles[r].shape)}" for r in NAMES if r in roles)
        return "shape", [f"{module} {shapes} vs weight {tuple(weight.shape)}"]
    if pair and down.shape[0] == 0:
        return "rank0", [module]
    if "bias" in roles and _bias(layer) is None:  # nothing to add it to: refused here, not at load
        return "no_bias", _keys(module, ("bias",))
    alpha = float(roles["alpha"]) / down.shape[0] if "alpha" in roles and pair and not meta else 1.0
    return LowRank(down, up, alpha, roles.get("bias"), roles.get("diff"))


def _fail(path: Path, what: str, items: list[str]) -> LoraError:
    listed = ", ".join(items[:MAX_LISTED]) + (f" (+{len(items) - MAX_LISTED} more)" if len(items) > MAX_LISTED else "")
    return LoraError(f"{path}: {what}: {listed}")


def read_lora(path: str | Path, model: nn.Module, name: str | None = None, *, meta: bool = False) -> LoraFile:
    """Read a LoRA file for this model; raise LoraError naming unknown keys or shape mismatches.

    `model` may hold only some blocks (a pipeline rank, the others on the meta device): every
    update is checked against the full model's shapes; the merger skips the blocks not held.
    `meta`: read only the file's keys and shapes (a check before an engine starts; `model` may be
    meta-built); the updates it returns hold no values.
    """
    path = Path(path)
    files = checkpoint_files(path)
    if len(files) > 1:  # a folder of several LoRAs: read together, their updates would mix into one
        raise _fail(path, f"a folder of {len(files)} weight files, and a LoRA is one (give it by its file)",
                    [f.name for f in files])
    tensors = {k: t for k, t, _ in iter_tensors(files, meta=meta)}
    if not tensors:
        raise LoraError(f"{path}: no tensors in the file")
    layers, weightless = _adaptable(model), _weightless_norms(model)
    parts, unknown = _group(tensors, {n.replace(".", "_"): n for n in (*layers, *weightless)})
    named = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_modules()}
    lora = LoraFile(name or path.stem, path)
    refused: dict[str, list[str]] = {reason: [] for reason in REFUSALS}
    refused["unknown"] = unknown
    for module, roles in parts.items():
        pair, full = "down" in roles and "up" in roles, "diff" in roles or "bias" in roles
        if ("down" in roles) != ("up" in roles) or not (pair or full):
            unknown.append(f"{module} (has {', '.join(sorted(roles))}; needs both down/A and up/B)")
        elif module in weightless:
            refused["weightless"] += _keys(module, roles)
        elif module not in layers and module in named:  # a modulation, the patch embedding (a convolution)
            refused["other"] += _keys(module, roles)
        elif module not in layers:
            refused["missing"].append(module)
        else:
            update = _update(module, roles, layers[module], meta)
            if isinstance(update, LowRank):
                lora.modules[module] = update
            else:
                refused[update[0]] += update[1]
    for reason, items in refused.items():
        if items:
            raise _fail(path, REFUSALS[reason], items)
    return lora


class LoraMerger:
    """Owns the merged LoRAs of one model: their scales and the original weights they replace.

    The original of each adapted weight (a linear layer's or a norm's, and its bias) is kept (on
    `keep_device`: the CPU in low-VRAM mode) the first time a LoRA touches it; every merge computes
    W = W0 + sum_i s_i * delta_i from it into the parameter in place, so tensors captured by CUDA
    graphs stay valid. With the originals beside the weights the merge is one `MergeProgram` over
    every adapted weight, the scales in a device tensor: a live scale change is a write of that
    tensor and a rerun (a graph replay once `capture` was called), never a rebuild. Call it between
    forwards on the stream that runs them. Blocks a pipeline rank does not hold (meta tensors) are
    skipped, so each rank merges only its own.

    With `parts` > 1 a change can be spread (`set_scales(..., spread=True)`): the program merges its
    first part at once and one more at each `step()` until every part has merged since the change,
    so no single step carries the whole merge; meanwhile some layers hold the new scales, the others
    the ones before.
    """

    def __init__(self, model: nn.Module, keep_device: torch.device | str | None = None, parts: int = 1) -> None:
        if parts < 1:
            raise ValueError(f"parts: {parts} is not allowed; expected 1 or more")
        self.model = model
        self.keep_device = keep_device
        self.parts = parts
        self._due = 0  # parts still to merge since the last spread change
        self._next = 0  # the part the next step merges
        self._layers = _adaptable(model)
        self._loras: dict[str, LoraFile] = {}
        self._scales: dict[str, float] = {}
        self._base_weight: dict[str, torch.Tensor] = {}
        self._base_bias: dict[str, torch.Tensor | None] = {}
        self._elsewhere: dict[str, dict[str, LowRank]] = {}  # LoRA -> its layers in blocks another rank holds
        self.program: MergeProgram | None = None  # None: no LoRA, or originals kept off the device
        self.builds = 0  # programs built: loading and block moves, never a scale change

    @property
    def scales(self) -> dict[str, float]:
        return dict(self._scales)

    def add(self, lora: LoraFile, scale: float = 1.0) -> None:
        if lora.name in self._loras:
            raise ValueError(f"lora: a LoRA named {lora.name!r} is loaded already; give it another name")
        self._elsewhere[lora.name] = {m: u for m, u in lora.modules.items() if self._layers[m].weight.is_meta}
        lora.modules = {m: u for m, u in lora.modules.items() if not self._layers[m].weight.is_meta}
        for module, update in lora.modules.items():
            self._hold(module, update)
        self._loras[lora.name] = lora
        self._scales[lora.name] = float(scale)
        self._merge(lora.modules)
        log.info("LoRA %s: %d layers, rank %s, scale %g", lora.name, len(lora.modules), lora.ranks, scale)

    def capture(self) -> None:
        """Replay the merge as a CUDA graph from now on (CUDA, originals on the device; else a no-op).
        Call once the LoRAs are loaded, before the stream: a capture waits for the device and must not
        overlap other threads' CUDA work, so a program rebuilt later (a pipeline block move) runs
        eagerly: the same kernels, launched one by one."""
        if self.program is not None:
            self.program.capture()

    def _hold(self, module: str, update: LowRank) -> None:
        """Keep the original of `module` and put the update where merges compute (`read_lora` refused a
        bias delta for a layer without a bias). A norm's deltas stay as read: merges sum them in float32."""
        target = self._layers[module]
        if module not in self._base_weight:
            self._base_weight[module] = target.weight.detach().to(self.keep_device, copy=True)
            bias = _bias(target)
            self._base_bias[module] = None if bias is None else bias.detach().to(self.keep_device, copy=True)
        if update.down is None:
            return
        if self.keep_device is None:  # merged on the device: in the weight's own dtype, once
            device, dtype = target.weight.device, target.weight.dtype
        else:
            device, dtype = self.keep_device, None
        update.down, update.up = update.down.to(device, dtype), update.up.to(device, dtype)
        if update.diff is not None:
            update.diff = update.diff.to(device, dtype)

    @torch.no_grad()
    def forget(self, prefix: str) -> None:
        """A pipeline rank hands the layers under `prefix` (a block) to another rank: their original
        weights go back into the layers (what is sent), and their updates wait for a later `adopt`."""
        for module in [m for m in self._base_weight if m.startswith(prefix)]:
            target = self._layers[module]
            target.weight.copy_(self._base_weight.pop(module))
            bias = self._base_bias.pop(module)
            if bias is not None:
                _bias(target).copy_(bias)
        for name, lora in self._loras.items():
            moved = {m: u for m, u in lora.modules.items() if m.startswith(prefix)}
            for u in (u for u in moved.values() if u.down is not None):  # views into the program's buffers
                u.down, u.up = u.down.clone(), u.up.clone()  # keep their own copies
            self._elsewhere[name].update(moved)
            lora.modules = {m: u for m, u in lora.modules.items() if m not in moved}
        if self.keep_device is None:
            self._rebuild()

    def adopt(self, prefix: str) -> None:
        """The layers under `prefix` arrived from another rank with their original weights: merge
        every loaded LoRA into them at its current scale."""
        touched: dict[str, LowRank] = {}
        for name, lora in self._loras.items():
            arrived = {m: u for m, u in self._elsewhere[name].items() if m.startswith(prefix)}
            for module, update in arrived.items():
                self._hold(module, update)
                del self._elsewhere[name][module]
            lora.modules.update(arrived)
            touched.update(arrived)
        self._merge(touched)

    def set_scale(self, name: str, scale: float) -> set[str]:
        """Change one LoRA's scale (see `set_scales`)."""
        return self.set_scales({name: scale})

    @property
    def settled(self) -> bool:
        """Every layer holds the current scales (no spread change still merging)."""
        return self._due == 0

    def set_scales(self, scales: dict[str, float], spread: bool = False) -> set[str]:
        """Change LoRA scales by name, all in one merge (`spread`: the program's first part now, the
        rest by `step`). On the device: the scales are written into the program's device tensor and
        the program runs again (no host synchronisation, no rebuild); with the originals off the
        device only the weights the changed LoRAs touch are recomputed, all at once. Returns the layers
        (module names) whose weights it rewrote, so what was computed from them (cross-attention K/V) is
        made again for those alone."""
        for name in scales:
            if name not in self._loras:
                raise ValueError(f"lora: no LoRA named {name!r}; loaded: {', '.join(self._loras) or 'none'}")
        changed = {n: float(s) for n, s in scales.items() if self._scales[n] != float(s)}
        if not changed:
            return set()
        self._scales.update(changed)
        if self.program is not None:
            names = list(self._loras)
            for name, scale in changed.items():
                self.program.set_scale(names.index(name), scale)
            if spread and self.program.parts > 1:
                self._due = self.program.parts
                return self.step()
            self.program.run()
            self._due = 0
            return self._rewritten(None)
        touched: dict[str, LowRank] = {}
        if self.keep_device is not None:
            for name in changed:
                touched.update(self._loras[name].modules)
            self._merge_host(touched)
        return set(touched)

    def step(self) -> set[str]:
        """Merge the next part of a spread change, if one is still due; the layers it rewrote."""
        if self._due == 0 or self.program is None:
            return set()
        part = self._next
        self.program.run(part)
        self._next = (self._next + 1) % self.program.parts
        self._due -= 1
        return self._rewritten(part)

    def _rewritten(self, part: int | None) -> set[str]:
        targets = list(self._base_weight)  # the program's targets, in the order `_rebuild` gave them
        return {targets[i] for i in self.program.part_targets(part)}

    def _merge(self, modules: dict[str, LowRank]) -> None:
        if self.keep_device is None:
            self._rebuild()
        else:
            self._merge_host(modules)

    def _rebuild(self) -> None:
        """A new program over every held adapted weight (the LoRAs or the layers held changed), run once."""
        names, targets, updates = list(self._loras), [], []
        for module, base in self._base_weight.items():
            layer = self._layers[module]
            held = [(i, lora.modules[module]) for i, lora in enumerate(self._loras.values()) if module in lora.modules]
            parts = [(i, u.down, u.up, u.alpha_scale, u.bias, u.diff) for i, u in held]
            targets.append(MergeTarget(layer.weight, base, parts, _bias(layer), self._base_bias[module]))
            updates.append([u for _, u in held])
        self.program, self._due, self._next = None, 0, 0
        if not targets:
            return
        self.program = MergeProgram(targets, [self._scales[n] for n in names], targets[0].weight.device,
                                    self.parts)
        self.builds += 1
        for held, views in zip(updates, self.program.factor_views()):
            for u, (down, up) in zip(held, views):  # one copy of the factors: the program's (a norm has none)
                u.down, u.up = down, up
        self.program.run()

    @torch.no_grad()
    def _merge_host(self, modules: dict[str, LowRank]) -> None:
        """Originals kept off the device (low-VRAM): each parameter in float32 from its original, copied over."""
        for module in modules:
            target, bias = self._layers[module], _bias(self._layers[module])
            parts = [(self._scales[n], lora.modules[module]) for n, lora in self._loras.items()
                     if module in lora.modules and self._scales[n] != 0.0]
            weights = [(s, d) for s, d in ((s, u.delta()) for s, u in parts) if d is not None]
            target.weight.copy_(_summed(self._base_weight[module], weights))
            if bias is not None:
                bias.copy_(_summed(self._base_bias[module], [(s, u.bias) for s, u in parts if u.bias is not None]))


def _summed(base: torch.Tensor, deltas: list[tuple[float, torch.Tensor]]) -> torch.Tensor:
    """base + sum_i s_i * delta_i in float32, back in base's dtype; with no deltas exactly the original (not
    original + 0)."""
    if not deltas:
        return base
    return (base.float() + sum(s * d.to(base.device).float() for s, d in deltas)).to(base.dtype)
