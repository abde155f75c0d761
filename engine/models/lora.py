"""Style LoRAs for the Wan DiT: read the layouts people share, merge them into the weights in place.

A LoRA adds `scale * (alpha / rank) * up @ down` to a linear layer's weight. Loom merges that
sum straight into the parameters the forward (and its CUDA graphs) already reads, so the hot
path is the same with or without LoRAs: no extra matmuls, no recapture. A live scale change
recomputes only the weights that LoRA touches, from a kept copy of the original weight, so any
mix of scales is exact to one rounding and all scales at 0 restore the original bit for bit.

Layouts read (every key is translated on its own, names checked against the model):
- diffusers / PEFT: `transformer.blocks.N.attn1.to_q.lora_A.weight` / `lora_B` (diffusers names);
- the original Wan layout: `diffusion_model.blocks.N.self_attn.q.lora_A.weight` (or
  `lora_down`/`lora_up`), with optional `.alpha` and `.diff_b` (a bias delta);
- kohya / musubi-tuner: `lora_unet_blocks_N_self_attn_q.lora_down.weight`, `.lora_up`, `.alpha`.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from loom_live.engine.models.checkpoint_io import CheckpointError, checkpoint_files, iter_tensors
from loom_live.engine.models.dit_convert import to_wan_key

log = logging.getLogger(__name__)

PREFIXES = ("base_model.model.", "model.diffusion_model.", "diffusion_model.", "transformer.")
KOHYA_PREFIX = "lora_unet_"
# suffix -> role; the PEFT adapter-name form (`lora_A.default.weight`) is accepted too
ROLES = {"lora_A": "down", "lora_down": "down", "lora_B": "up", "lora_up": "up"}
_ROLE_RE = re.compile(r"^(?P<module>.+?)\.(?P<role>lora_A|lora_B|lora_down|lora_up)(?:\.[\w-]+)?\.weight$")
MAX_LISTED = 8


class LoraError(CheckpointError):
    """A LoRA file that does not fit the model: names the file, the keys and the shapes."""


@dataclass
class LowRank:
    """One adapted weight: delta = alpha_scale * up @ down, plus an optional bias delta."""

    down: torch.Tensor  # [rank, in]
    up: torch.Tensor  # [out, rank]
    alpha_scale: float = 1.0
    bias: torch.Tensor | None = None

    def delta(self) -> torch.Tensor:
        return (self.up.float() @ self.down.float()) * self.alpha_scale


@dataclass
class LoraFile:
    """A parsed LoRA: per WanDiT parameter name (`blocks.3.self_attn.q`), its low-rank update."""

    name: str
    path: Path
    modules: dict[str, LowRank] = field(default_factory=dict)

    @property
    def ranks(self) -> list[int]:
        return sorted({m.down.shape[0] for m in self.modules.values()})


def _linear_names(model: nn.Module) -> dict[str, nn.Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def _module_name(raw: str, kohya: dict[str, str]) -> str:
    """A file's module path in any layout -> WanDiT's module name (unknown names pass through)."""
    if raw.startswith(KOHYA_PREFIX):
        return kohya.get(raw[len(KOHYA_PREFIX):], raw)
    for prefix in PREFIXES:
        if raw.startswith(prefix):
            raw = raw[len(prefix):]
            break
    return to_wan_key(raw + ".weight").removesuffix(".weight")


def _group(path: Path, tensors: dict[str, torch.Tensor], kohya: dict[str, str]) -> tuple[dict, list[str]]:
    """Tensors by target module and role ('down', 'up', 'alpha', 'bias'); keys not understood."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    unknown: list[str] = []
    for key, t in tensors.items():
        m = _ROLE_RE.match(key)
        if m:
            module, role = m["module"], ROLES[m["role"]]
        elif key.endswith(".alpha"):
            module, role = key.removesuffix(".alpha"), "alpha"
        elif key.endswith(".diff_b"):
            module, role = key.removesuffix(".diff_b"), "bias"
        else:
            unknown.append(key)
            continue
        parts.setdefault(_module_name(module, kohya), {})[role] = t
    return parts, unknown


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
    tensors = {k: t for k, t, _ in iter_tensors(checkpoint_files(path), meta=meta)}
    if not tensors:
        raise LoraError(f"{path}: no tensors in the file")
    linears = _linear_names(model)
    kohya = {n.replace(".", "_"): n for n in linears}
    parts, unknown = _group(path, tensors, kohya)
    lora = LoraFile(name or path.stem, path)
    not_in_model, mismatched = [], []
    for module, roles in parts.items():
        if "down" not in roles or "up" not in roles:
            unknown.append(f"{module} (has {', '.join(sorted(roles))}; needs both down/A and up/B)")
            continue
        if module not in linears:
            not_in_model.append(module)
            continue
        down, up, weight = roles["down"], roles["up"], linears[module].weight
        if down.ndim != 2 or up.ndim != 2 or down.shape[0] != up.shape[1] or \
                (up.shape[0], down.shape[1]) != tuple(weight.shape):
            mismatched.append(f"{module} down {tuple(down.shape)} up {tuple(up.shape)} vs weight {tuple(weight.shape)}")
            continue
        alpha = float(roles["alpha"]) / down.shape[0] if "alpha" in roles and not meta else 1.0
        lora.modules[module] = LowRank(down, up, alpha, roles.get("bias"))
    if unknown:
        raise _fail(path, "keys that are not LoRA weights of a Wan2.1 DiT", unknown)
    if not_in_model:
        raise _fail(path, "modules this model does not have", not_in_model)
    if mismatched:
        raise _fail(path, "shapes that do not fit this model (a LoRA for another model size?)", mismatched)
    return lora


class LoraMerger:
    """Owns the merged LoRAs of one model: their scales and the original weights they replace.

    The original of each adapted weight is kept (on `keep_device`: the CPU in low-VRAM mode) the
    first time a LoRA touches it; every merge recomputes W = W0 + sum_i s_i * delta_i from it
    and copies the result into the parameter in place, so tensors captured by CUDA graphs stay
    valid. Call it between forwards on the stream that runs them. Blocks a pipeline rank does not
    hold (meta tensors) are skipped, so each rank merges only its own.
    """

    def __init__(self, model: nn.Module, keep_device: torch.device | str | None = None) -> None:
        self.model = model
        self.keep_device = keep_device
        self._linears = _linear_names(model)
        self._loras: dict[str, LoraFile] = {}
        self._scales: dict[str, float] = {}
        self._base_weight: dict[str, torch.Tensor] = {}
        self._base_bias: dict[str, torch.Tensor | None] = {}
        self._elsewhere: dict[str, dict[str, LowRank]] = {}  # LoRA -> its layers in blocks another rank holds

    @property
    def scales(self) -> dict[str, float]:
        return dict(self._scales)

    def add(self, lora: LoraFile, scale: float = 1.0) -> None:
        if lora.name in self._loras:
            raise ValueError(f"lora: a LoRA named {lora.name!r} is loaded already; give it another name")
        self._elsewhere[lora.name] = {m: u for m, u in lora.modules.items() if self._linears[m].weight.is_meta}
        lora.modules = {m: u for m, u in lora.modules.items() if not self._linears[m].weight.is_meta}
        for module, update in lora.modules.items():
            self._hold(lora, module, update)
        self._loras[lora.name] = lora
        self._scales[lora.name] = float(scale)
        self._merge(lora.modules)
        log.info("LoRA %s: %d layers, rank %s, scale %g", lora.name, len(lora.modules), lora.ranks, scale)

    def _hold(self, lora: LoraFile, module: str, update: LowRank) -> None:
        """Keep the original of `module` and put the update where merges compute."""
        target = self._linears[module]
        if module not in self._base_weight:
            self._base_weight[module] = target.weight.detach().to(self.keep_device, copy=True)
            bias = target.bias
            self._base_bias[module] = None if bias is None else bias.detach().to(self.keep_device, copy=True)
        if update.bias is not None and target.bias is None:
            raise LoraError(f"{lora.path}: {module} has a bias delta but the layer has no bias")
        if self.keep_device is None:  # merged on the device by addmm: in the weight's own dtype, once
            update.down = update.down.to(target.weight.device, target.weight.dtype)
            update.up = update.up.to(target.weight.device, target.weight.dtype)
        else:
            update.down, update.up = update.down.to(self.keep_device), update.up.to(self.keep_device)

    @torch.no_grad()
    def forget(self, prefix: str) -> None:
        """A pipeline rank hands the layers under `prefix` (a block) to another rank: their original
        weights go back into the layers (what is sent), and their updates wait for a later `adopt`."""
        for module in [m for m in self._base_weight if m.startswith(prefix)]:
            target = self._linears[module]
            target.weight.copy_(self._base_weight.pop(module))
            bias = self._base_bias.pop(module)
            if bias is not None:
                target.bias.copy_(bias)
        for name, lora in self._loras.items():
            moved = {m: u for m, u in lora.modules.items() if m.startswith(prefix)}
            self._elsewhere[name].update(moved)
            lora.modules = {m: u for m, u in lora.modules.items() if m not in moved}

    def adopt(self, prefix: str) -> None:
        """The layers under `prefix` arrived from another rank with their original weights: merge
        every loaded LoRA into them at its current scale."""
        touched: dict[str, LowRank] = {}
        for name, lora in self._loras.items():
            arrived = {m: u for m, u in self._elsewhere[name].items() if m.startswith(prefix)}
            for module, update in arrived.items():
                self._hold(lora, module, update)
                del self._elsewhere[name][module]
            lora.modules.update(arrived)
            touched.update(arrived)
        self._merge(touched)

    def set_scale(self, name: str, scale: float) -> None:
        """Change one LoRA's scale; only the weights it touches are recomputed."""
        if name not in self._loras:
            raise ValueError(f"lora: no LoRA named {name!r}; loaded: {', '.join(self._loras) or 'none'}")
        if self._scales[name] == float(scale):
            return
        self._scales[name] = float(scale)
        self._merge(self._loras[name].modules)

    @torch.no_grad()
    def _merge(self, modules: dict[str, LowRank]) -> None:
        for module in modules:
            target = self._linears[module]
            parts = [(self._scales[n], lora.modules[module]) for n, lora in self._loras.items()
                     if module in lora.modules and self._scales[n] != 0.0]
            base = self._base_weight[module]
            if not parts:  # exactly the original, not original + 0
                target.weight.copy_(base)
                if target.bias is not None:
                    target.bias.copy_(self._base_bias[module])
                continue
            self._merge_weight(target.weight, base, parts)
            biases = [(s, u.bias) for s, u in parts if u.bias is not None]
            if biases:
                bias = self._base_bias[module].float() + sum(s * b.to(base.device).float() for s, b in biases)
                target.bias.copy_(bias.to(target.bias.dtype))

    @staticmethod
    def _merge_weight(weight: torch.Tensor, base: torch.Tensor, parts: list[tuple[float, LowRank]]) -> None:
        """W = W0 + sum_i (s_i a_i) B_i A_i: where W0 sits beside the weight, one addmm per LoRA written
        straight into the parameter, the scale as the matmul's own float alpha (no temporaries, so a live
        change costs a few kernel launches per layer); otherwise (W0 kept on the CPU in low-VRAM mode) in
        float32 and copied over."""
        if base.device == weight.device and base.dtype == weight.dtype:
            (s, first), rest = parts[0], parts[1:]
            torch.addmm(base, first.up, first.down, alpha=s * first.alpha_scale, out=weight)
            for s, u in rest:
                weight.addmm_(u.up, u.down, alpha=s * u.alpha_scale)
            return
        merged = base.float() + sum(s * u.delta() for s, u in parts)
        weight.copy_(merged.to(weight.dtype))
