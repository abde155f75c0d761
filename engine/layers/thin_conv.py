"""A 3x3x3 conv with very few input or output channels, as convs of a shape the GPU fills better.

cuDNN runs a 3D conv as an implicit GEMM: pixels x output channels, reduced over input channels x
27 taps, in tiles 32-256 wide. The Wan VAE's first conv (3 colour channels in) and last conv
(3 out) work at full resolution on every chunk, and there a tile is mostly padding: the library's
best kernel for either runs at a few percent of the card's rate. Two rewrites give the work a
better shape and compute the same sums (exact up to float rounding and summation order):

- `stack` (few inputs): the three frames each output frame reads are stacked along the channels
  (3 x C_in, padded to a multiple of 8: tensor-core aligned, where the 3D conv reads 3 channels
  per tap), and one 2D 3x3 conv per output frame does the rest; the stacked input is small.
- `taps` (few outputs): a conv over time only, kernel (3, 1, 1), gives each pixel the 9 spatial
  taps' partial sums of every output channel (9 x C_out channels, padded to a multiple of 8);
  the output is then the sum of those partials at the 9 neighbouring pixels, a cheap pass.

Both take the frames with the causal history already in front (T + 2 frames in, T out) and pad
space by 1, as the conv they replace. Under the VAE's compiled step, the stacking and the final sum
fuse into neighbouring kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

THIN_KINDS = ("stack", "taps")
THIN_CHANNELS = 4  # at most this many input (stack) or output (taps) channels: the pixel side
_ALIGN = 8  # GEMM widths padded to a multiple of 8 elements (16 bytes of bf16): tensor-core friendly


def _fits(conv: nn.Conv3d) -> bool:
    """A full 3x3x3 conv, stride 1, space padded by 1, one group: what both rewrites compute."""
    return (conv.kernel_size == (3, 3, 3) and conv.stride == (1, 1, 1) and conv.groups == 1
            and conv.padding == (0, 1, 1) and conv.dilation == (1, 1, 1))


def thin_kind(conv: nn.Conv3d, stack_upto: int = THIN_CHANNELS) -> str | None:
    """The rewrite that suits `conv`, or None: `taps` for at most THIN_CHANNELS output channels,
    `stack` for at most `stack_upto` input channels (by default THIN_CHANNELS; wider convs can be
    asked to stack too, where cuDNN's 2D kernels beat its 3D ones at their shape)."""
    if not _fits(conv):
        return None
    if conv.out_channels <= THIN_CHANNELS < conv.in_channels:
        return "taps"
    if conv.in_channels <= max(stack_upto, THIN_CHANNELS):
        return "stack"
    return None


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class ThinConv3d(nn.Module):
    """`conv(x)` for a conv `thin_kind` accepts (or any fitting conv, in a form asked for),
    rewritten as described above.

    The rewritten weights are derived from `conv` once, here (build after the weights are final);
    they are non-persistent buffers, so checkpoints keep the conv's own weights and names.
    """

    def __init__(self, conv: nn.Conv3d, kind: str | None = None) -> None:
        """`kind` forces a form (any fitting conv, for benchmarks); by default `thin_kind`'s."""
        super().__init__()
        kind = kind or thin_kind(conv)
        if kind not in THIN_KINDS or not _fits(conv):
            raise ValueError(
                "ThinConv3d needs a 3x3x3 conv with stride 1, space padding 1 and one group, with at most "
                f"{THIN_CHANNELS} input or output channels unless a kind {THIN_KINDS} is given; got kernel "
                f"{conv.kernel_size}, stride {conv.stride}, padding {conv.padding}, "
                f"{conv.in_channels} -> {conv.out_channels} channels, kind {kind!r}"
            )
        self.kind = kind
        self.out_channels = conv.out_channels
        weight = conv.weight.detach()
        cout, cin = weight.shape[:2]
        with torch.no_grad():
            if kind == "stack":  # [C_out, 3 * C_in (padded), 3, 3], input channels in (dt, c_in) order
                kernel = weight.new_zeros(cout, _round_up(3 * cin), 3, 3)
                kernel[:, : 3 * cin] = weight.transpose(1, 2).reshape(cout, 3 * cin, 3, 3)
                layout = torch.channels_last
            else:  # [9 * C_out (padded), C_in, 3, 1, 1], output channels in (dh, dw, c_out) order
                kernel = weight.new_zeros(_round_up(9 * cout), cin, 3, 1, 1)
                kernel[: 9 * cout] = weight.permute(3, 4, 0, 1, 2).reshape(9 * cout, cin, 3, 1, 1)
                layout = torch.channels_last_3d
            if weight.is_contiguous(memory_format=torch.channels_last_3d) and not weight.is_contiguous():
                kernel = kernel.contiguous(memory_format=layout)
        self.register_buffer("kernel", kernel, persistent=False)
        self.register_buffer("bias", None if conv.bias is None else conv.bias.detach().clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._stack(x) if self.kind == "stack" else self._taps(x)

    def _stack(self, x: torch.Tensor) -> torch.Tensor:
        b, cin, frames, h, w = x.shape
        t = frames - 2
        pad = [x.new_zeros(b, self.kernel.shape[1] - 3 * cin, t, h, w)]
        stacked = torch.cat([x[:, :, dt : dt + t] for dt in range(3)] + pad, dim=1)  # [B, 3 C_in, T, H, W]
        per_frame = stacked.transpose(1, 2).reshape(b * t, -1, h, w)
        if self.kernel.is_contiguous(memory_format=torch.channels_last) and not self.kernel.is_contiguous():
            per_frame = per_frame.contiguous(memory_format=torch.channels_last)
        y = F.conv2d(per_frame, self.kernel, self.bias, padding=1)  # [B*T, C_out, H, W]
        return y.view(b, t, *y.shape[1:]).transpose(1, 2)

    def _taps(self, x: torch.Tensor) -> torch.Tensor:
        b, _, frames, h, w = x.shape
        cout = self.out_channels
        partial = F.conv3d(x, self.kernel)[:, : 9 * cout]  # [B, 9 * C_out, T, H, W]
        partial = F.pad(partial, (1, 1, 1, 1)).unflatten(1, (3, 3, cout))
        out = sum(partial[:, dh, dw, :, :, dh : dh + h, dw : dw + w] for dh in range(3) for dw in range(3))
        out = out if self.bias is None else out + self.bias.view(1, cout, 1, 1, 1)
        if x.is_contiguous(memory_format=torch.channels_last_3d) and not x.is_contiguous():
            out = out.contiguous(memory_format=torch.channels_last_3d)  # the layout the conv would keep
        return out
