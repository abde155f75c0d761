"""Temporal ControlNet-LLLite: a small adapter per hooked attention projection.

Each hooked projection (attn1 q/k/v, attn2 q) gets a conditioning CNN (`conditioning1`) that maps
the condition image (the previous output warped to the current frame by optical flow) to an
embedding at that block's feature-map size, and a per-token path `down` -> concat with the
embedding -> `mid` -> `up`, whose result is added to the projection's input. `up` starts at zero,
so an untrained adapter leaves the UNet exactly as it was.

The edit UNet's features hold [target | source] side by side; the embedding covers the target
half and is zero over the source half, so the source reference gets no temporal push.

Made for one compiled graph with the UNet: the embeddings are fixed-size registered buffers
written in place when the condition is refreshed (every N batches, outside the graph), the
strength is a 0-d buffer, and the per-step forward has no branches. Changing the condition or
the strength therefore never changes what the compiled graph guards on.

Parameter names follow the released temporal-LLLite files: `modules_dict.<hook path with dots as
"__">.{conditioning1.N, down.0, mid.0, up.0}.{weight,bias}`.
"""

from __future__ import annotations

import torch
from torch import nn

HOOK_SUBSETS = ("all", "down", "none")


def select_hooks(points: list[str], subset: str) -> list[str]:
    """The hook points of a subset: all of them, those in the down blocks, or none."""
    if subset not in HOOK_SUBSETS:
        raise ValueError(f"lllite hooks: {subset!r} is not allowed; expected one of {', '.join(HOOK_SUBSETS)}")
    if subset == "none":
        return []
    return [p for p in points if subset == "all" or p.startswith("down_blocks.")]


def module_key(point: str) -> str:
    return point.replace(".", "__")


def conditioning_strides(image_h: int, feature_h: int) -> list[int]:
    """Strides of the conditioning CNN: image height to feature height in steps of 4, then 2."""
    if image_h % feature_h:
        raise ValueError(f"condition image height {image_h} is not a multiple of the feature height {feature_h}")
    total, strides = image_h // feature_h, []
    while total > 1:
        step = 4 if total % 4 == 0 else 2
        if total % step:
            raise ValueError(f"condition image height {image_h} / feature height {feature_h} is not a power of 2")
        strides.append(step)
        total //= step
    return strides or [1]


class LLLiteHook(nn.Module):
    def __init__(self, in_dim: int, cond_dim: int, mlp_dim: int, strides: list[int],
                 batch: int, feature_hw: tuple[int, int]) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        cin = 3
        for i, s in enumerate(strides):
            last = i == len(strides) - 1
            cout = cond_dim if last else cond_dim // 2
            layers.append(nn.Conv2d(cin, cout, kernel_size=s if s > 1 else 3, stride=s, padding=0 if s > 1 else 1))
            if not last:
                layers.append(nn.ReLU())
            cin = cout
        self.conditioning1 = nn.Sequential(*layers)
        self.down = nn.Sequential(nn.Linear(in_dim, mlp_dim), nn.ReLU())
        self.mid = nn.Sequential(nn.Linear(mlp_dim + cond_dim, mlp_dim), nn.ReLU())
        self.up = nn.Sequential(nn.Linear(mlp_dim, in_dim))
        nn.init.zeros_(self.up[0].weight)
        nn.init.zeros_(self.up[0].bias)
        h, w = feature_hw
        self.feature_hw = feature_hw
        # [batch, h * 2w, cond_dim]: the target half written on refresh, the source half stays zero
        self.register_buffer("cond_emb", torch.zeros(batch, h * 2 * w, cond_dim), persistent=False)

    @torch.no_grad()
    def set_condition(self, image: torch.Tensor) -> None:
        """image [B, 3, H, W] in [-1, 1] -> this hook's embedding, written into its buffer."""
        cx = self.conditioning1(image.to(self.cond_emb.dtype))
        b, c, h, w = cx.shape
        if (h, w) != self.feature_hw or b != self.cond_emb.shape[0]:
            raise ValueError(f"condition {tuple(image.shape)} gives features {b}x{h}x{w}; this adapter was "
                             f"built for {self.cond_emb.shape[0]}x{self.feature_hw[0]}x{self.feature_hw[1]}")
        self.cond_emb.view(b, h, 2 * w, c)[:, :, :w].copy_(cx.permute(0, 2, 3, 1))

    def forward(self, x: torch.Tensor, strength: torch.Tensor) -> torch.Tensor:
        """The inference path: x [B, N, in_dim] -> x + delta."""
        merged = self.mid(torch.cat([self.cond_emb, self.down(x)], dim=-1))
        return x + self.up(merged) * strength


class LLLite(nn.Module):
    """The adapters of one UNet at one batch size and resolution; `shift` is the UNet's hook."""

    def __init__(self, hook_sizes: dict[str, tuple[int, int]], points: list[str], image_hw: tuple[int, int],
                 batch: int, cond_dim: int = 32, mlp_dim: int = 64) -> None:
        super().__init__()
        image_h, image_w = image_hw
        self.modules_dict = nn.ModuleDict()
        for point in points:
            in_dim, feat_h = hook_sizes[point]
            feat_w = feat_h * image_w // image_h
            self.modules_dict[module_key(point)] = LLLiteHook(
                in_dim, cond_dim, mlp_dim, conditioning_strides(image_h, feat_h), batch, (feat_h, feat_w))
        self.register_buffer("strength", torch.ones(()), persistent=False)
        self._by_point = {p: module_key(p) for p in points}

    def shift(self, point: str, x: torch.Tensor) -> torch.Tensor:
        key = self._by_point.get(point)
        return x if key is None else self.modules_dict[key](x, self.strength)

    @torch.no_grad()
    def set_condition(self, image: torch.Tensor) -> None:
        for hook in self.modules_dict.values():
            hook.set_condition(image)

    @torch.no_grad()
    def set_strength(self, value: float) -> None:
        self.strength.fill_(value)

    @torch.no_grad()
    def clear_condition(self) -> None:
        for hook in self.modules_dict.values():
            hook.cond_emb.zero_()
