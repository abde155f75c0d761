"""The ComfyUI nodes under the failures a workflow meets: bad values, unusual batches, a dead engine,
ComfyUI's Cancel. The node package is loaded the way ComfyUI loads it; the engine process is real.
"""

from __future__ import annotations

import pytest
import torch
from test_comfyui import PACKAGE_DIR, _engine, _image_batch, _load_like_comfyui, _run


@pytest.fixture(scope="module")
def nodes_pkg():
    module = _load_like_comfyui(PACKAGE_DIR)
    yield module
    module.nodes.ENGINES.close_all()


def test_a_refused_prompt_is_not_kept_and_later_runs_still_stream(nodes_pkg):
    handle, _ = _engine(nodes_pkg, passthrough=True)
    with pytest.raises(ValueError, match="Loom Prompt: prompt: 5000 characters is too long; at most 4096"):
        _run(nodes_pkg, "LoomPrompt", engine=handle, prompt="x" * 5000, steps=2, noise_scale=0.8,
             motion_aware=True, transition_chunks=4)
    images = _image_batch(3, 16, 24)
    out, _ = _run(nodes_pkg, "LoomStream", engine=handle, images=images)
    assert torch.equal(out, images)
