"""Nearest x2 upsampling followed by a 3x3 conv, computed on the low-resolution input.

After a nearest x2 upsample, the 3x3 window of each output pixel covers only 2x2 distinct
input pixels, and which of the nine taps fall on which of them depends only on the output
pixel's parity along H and W (its phase). So the pair equals four 2x2 convs on the input, one
per phase, whose taps are sums of the 3x3 taps: 16 instead of 36 multiply-adds per input pixel
and no 4x larger upsampled tensor. Zero padding agrees too: the upsampled map's padding row is
the input's padding row repeated.

Two ways to run the four phases, both exact up to float rounding (the summed taps are rounded
once, to the weight's dtype):
- `phase`: one conv with 4x the output channels and 2x2 taps over the input padded by 1, then
  each phase's map is placed at its parity in the output (one strided copy per phase);
- `transposed`: the same taps as one stride-2 transposed conv with a 4x4 kernel, which writes
  the interleaved output itself (cuDNN runs it as its data-gradient kernel).
Which is faster depends on the kernels the GPU library picks for each form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

UPSAMPLE_KINDS = ("nearest", "phase", "transposed")

# _TAPS[a, u, k]: how much 3x3 row (or column) tap k adds to 2x2 tap u of phase a. Phase 0 (even
# output rows) reads input rows i-1 (tap 0) and i (taps 1 and 2); phase 1 reads i (taps 0 and 1)
# and i+1 (tap 2).
_TAPS = (((1, 0, 0), (0, 1, 1)), ((1, 1, 0), (0, 0, 1)))
# The transposed conv's 4x4 kernel index of 2x2 tap u of phase a (output 2i+a = 2*input - 1 + k).
_TRANSPOSED_INDEX = ((3, 1), (2, 0))


def phase_kernels(weight: torch.Tensor) -> torch.Tensor:
    """[C_out, C_in, 3, 3] -> [2, 2, C_out, C_in, 2, 2]: the 2x2 taps of each (row, column) phase."""
    taps = torch.tensor(_TAPS, dtype=torch.float64, device=weight.device)
    summed = torch.einsum("aui,bvj,ocij->abocuv", taps, taps, weight.to(torch.float64))
    return summed.to(weight.dtype)


def stacked_kernel(weight: torch.Tensor) -> torch.Tensor:
    """The four phases as one conv's weight: [4 * C_out, C_in, 2, 2], phase-major (row, column)."""
    k = phase_kernels(weight)
    return k.reshape(4 * k.shape[2], *k.shape[3:])


def transposed_kernel(weight: torch.Tensor) -> torch.Tensor:
    """The four phases as one stride-2 transposed conv's weight: [C_in, C_out, 4, 4]."""
    k = phase_kernels(weight)
    out = k.new_zeros(weight.shape[1], weight.shape[0], 4, 4)
    for a in range(2):
        for b in range(2):
            for u in range(2):
                for v in range(2):
                    ky, kx = _TRANSPOSED_INDEX[a][u], _TRANSPOSED_INDEX[b][v]
                    out[:, :, ky, kx] = k[a, b, :, :, u, v].transpose(0, 1)
    return out


def interleave_phases(y: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[N, 4C, H+1, W+1] phase maps (phase-major) -> [N, C, 2H, 2W], in `y`'s memory layout.

    Phase (a, b) of output pixel (2i+a, 2j+b) was computed at (i+a, j+b) of the padded conv.
    """
    n, c4 = y.shape[:2]
    c = c4 // 4
    channels_last = y.is_contiguous(memory_format=torch.channels_last) and not y.is_contiguous()
    layout = torch.channels_last if channels_last else torch.contiguous_format
    out = torch.empty((n, c, 2 * height, 2 * width), dtype=y.dtype, device=y.device, memory_format=layout)
    grid = out.view(n, c, height, 2, width, 2)
    for a in range(2):
        for b in range(2):
            phase = y[:, (2 * a + b) * c:(2 * a + b + 1) * c, a:a + height, b:b + width]
            grid[:, :, :, a, :, b].copy_(phase)
    return out


class PhaseUpsampleConv(nn.Module):
    """`conv(nearest_x2(x))` for a 3x3, padding-1 `conv`, run as phase convolutions.

    The phase weights are derived from `conv` once, here, so build this after the weights are
    final (loading does); later changes to `conv` are not seen. They are non-persistent buffers:
    checkpoints keep the original 3x3 weights and names, and `.to()` moves them with the model.
    """

    def __init__(self, conv: nn.Conv2d, kind: str = "phase") -> None:
        super().__init__()
        if kind not in UPSAMPLE_KINDS[1:]:
            raise ValueError(f"PhaseUpsampleConv kind {kind!r}; allowed: {UPSAMPLE_KINDS[1:]}")
        if conv.kernel_size != (3, 3) or conv.padding != (1, 1) or conv.stride != (1, 1) or conv.groups != 1:
            raise ValueError("PhaseUpsampleConv needs a 3x3 conv with padding 1, stride 1 and one group")
        self.kind = kind
        with torch.no_grad():
            weight = conv.weight.detach()
            if kind == "phase":
                kernel, bias = stacked_kernel(weight), None if conv.bias is None else conv.bias.detach().repeat(4)
            else:
                kernel, bias = transposed_kernel(weight), None if conv.bias is None else conv.bias.detach().clone()
            if weight.is_contiguous(memory_format=torch.channels_last) and not weight.is_contiguous():
                kernel = kernel.contiguous(memory_format=torch.channels_last)
        self.register_buffer("kernel", kernel, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "transposed":
            return F.conv_transpose2d(x, self.kernel, self.bias, stride=2, padding=1)
        return interleave_phases(F.conv2d(x, self.kernel, self.bias, padding=1), x.shape[2], x.shape[3])
