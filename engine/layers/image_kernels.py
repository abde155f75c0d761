"""The small fixed kernels the edge measures share: the luma weights and OpenCV's 3x3 Sobel pair.

The DiT's edge source (engine/models/dit_source.py), the VACE grey and edges sources
(engine/stream/control_frames.py) and the device Canny (engine/stream/canny.py) all read them. Each
is made once per device: a tensor built from Python numbers on a GPU is a blocking host-to-device
copy, which per chunk would wait for the GPU's queue and stall the session's overlapped streams.
They are made outside inference mode whoever asks first, so the training losses (engine/train/losses.py)
can read the same cached tensors under autograd.
"""

from __future__ import annotations

import functools

import torch

LUMA = (0.299, 0.587, 0.114)  # ITU-R BT.601, as OpenCV's RGB-to-grey


@functools.cache
def luma(device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The luma weights [1, 3, 1, 1], to multiply frames [N, 3, H, W] by and sum over channels."""
    with torch.inference_mode(False):  # cached for training too: never an inference tensor
        return torch.tensor(LUMA, dtype=dtype).view(1, 3, 1, 1).to(device)


@functools.cache
def sobel(device: torch.device) -> torch.Tensor:
    """OpenCV's 3x3 Sobel d/dx and d/dy as one conv2d weight [2, 1, 3, 3] (float32, exact integers)."""
    with torch.inference_mode(False):
        d, s = torch.tensor([-1.0, 0.0, 1.0]), torch.tensor([1.0, 2.0, 1.0])
        return torch.stack([s[:, None] * d[None, :], d[:, None] * s[None, :]])[:, None].to(device)
