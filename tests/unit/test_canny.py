"""The device Canny (engine/stream/canny.py) draws OpenCV's edges: the VACE edges source uses it on a GPU."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
import torch

from loom_live.engine.stream.canny import DEVICE_STEPS, canny
from loom_live.engine.stream.control_frames import CANNY_HIGH, CANNY_LOW, ControlFrames


def _images(n: int = 6) -> np.ndarray:
    """Discs of many greys, sharp to blurred, clean to noisy: every gradient direction and tie."""
    rng = np.random.default_rng(0)
    out = []
    for k in range(n):
        img = np.zeros((96, 128), np.uint8)
        for _ in range(8):
            centre = (int(rng.integers(0, 128)), int(rng.integers(0, 96)))
            cv2.circle(img, centre, int(rng.integers(5, 40)), int(rng.integers(0, 256)), -1)
        img = cv2.GaussianBlur(img, (5, 5), 1.0 * (k % 3)) if k % 3 else img
        noise = rng.integers(-20 * (k // 3), 20 * (k // 3) + 1, img.shape)
        out.append(np.clip(img.astype(int) + noise, 0, 255).astype(np.uint8))
    return np.stack(out)


@pytest.mark.parametrize("steps", [None, DEVICE_STEPS])
def test_the_edges_equal_opencv_canny(steps):
    images = _images()
    want = np.stack([cv2.Canny(g, CANNY_LOW, CANNY_HIGH) > 0 for g in images])
    got = canny(torch.from_numpy(images), CANNY_LOW, CANNY_HIGH, steps=steps).numpy()
    assert want.sum() > 1000 and np.array_equal(got, want)


def test_a_bounded_hysteresis_stops_a_long_chain():
    """A faint ramp edge leaving one strong pixel: OpenCV follows it to its end, 4 steps reach 4 pixels."""
    img = np.zeros((8, 40), np.uint8)
    img[4:, :] = 40  # a step of 40: magnitude 160, above the low threshold only
    img[4:, 0] = 120  # the strong start (magnitude above 200)
    full = canny(torch.from_numpy(img)[None], CANNY_LOW, CANNY_HIGH)[0]
    assert np.array_equal(full.numpy(), cv2.Canny(img, CANNY_LOW, CANNY_HIGH) > 0)
    short = canny(torch.from_numpy(img)[None], CANNY_LOW, CANNY_HIGH, steps=4)[0]
    assert full.sum() > short.sum() > 0


def test_a_wrong_shape_is_refused():
    with pytest.raises(ValueError, match=r"grey images \[N, H, W\]"):
        canny(torch.zeros(1, 1, 8, 8), CANNY_LOW, CANNY_HIGH)


@pytest.mark.gpu
def test_the_edges_source_on_a_gpu_equals_the_cpu_one():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run on the GPU machine)")
    rgb = torch.from_numpy(_images()).float()[:, None].expand(-1, 3, -1, -1) / 127.5 - 1.0
    cpu = ControlFrames(torch.device("cpu")).make("edges", rgb)
    gpu = ControlFrames(torch.device("cuda")).make("edges", rgb.cuda())
    assert torch.equal(gpu.cpu(), cpu)
