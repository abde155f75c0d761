"""The embedded model's structure control: the input's edges it reads, scaled live by
`control.context_scale` (0 = the input's structure is not given, 1 = as trained), on the default preset
with its shipped weights; the sources and the reference only a VACE model can take are refused in one line."""

from __future__ import annotations

import numpy as np
import pytest

from loom_live.engine.config import EDGE_PRESETS, ConfigError, load_config
from loom_live.engine.models.wan_dit import DIT_PRESETS
from loom_live.engine.stream.session import StreamSession
from tests.fakes.media import panning_clip

SMALL = ["resolution.width=64", "resolution.height=64", "model.dtype=float32", "prompt.text=neon edges"]


@pytest.fixture(scope="module")
def models():
    from loom_live.engine.models.loading import load_models

    return load_models(load_config("default", SMALL))


def session(models, *overrides: str) -> StreamSession:
    return StreamSession(load_config("default", [*SMALL, *overrides]), models)


def test_the_config_names_the_presets_whose_dit_reads_edges():
    assert set(EDGE_PRESETS) == {name for name, cfg in DIT_PRESETS.items() if cfg.source_edges}
    cfg = load_config("default")
    assert cfg.structure_control and cfg.source_edges and not cfg.vace
    assert load_config("tiny-vace").structure_control and not load_config("tiny-random").structure_control


def test_a_live_edge_scale_change_leaves_earlier_chunks_and_changes_later_ones(models):
    """Switched at a chunk boundary: the frames before equal the unswitched stream's, the rest differ
    (scale 0: the model is given no structure); the stats say the control."""
    frames = panning_clip(13, 64, 64, 0, shift=3)
    steady, switched = session(models), session(models)
    assert steady.stats()["control"] == {"source": "edges", "context_scale": 1.0, "reference": None, "edges_only": True}
    a = [steady.push(frames[:5]), steady.push(frames[5:9]), steady.push(frames[9:]), steady.flush()]
    b = [switched.push(frames[:5]), switched.push(frames[5:9])]
    switched.set_params(context_scale=0.0)
    b += [switched.push(frames[9:]), switched.flush()]
    a, b = np.concatenate([o for o in a if len(o)]), np.concatenate([o for o in b if len(o)])
    assert a.shape == b.shape == frames.shape
    assert np.array_equal(a[:9], b[:9])
    assert np.abs(a[9:].astype(int) - b[9:].astype(int)).max() > 0
    assert switched.stats()["control"]["context_scale"] == 0.0
    with pytest.raises(ValueError, match="context_scale"):
        switched.set_params(context_scale=3.0)
    assert switched.stats()["control"]["context_scale"] == 0.0


def test_sources_and_a_reference_the_embedded_model_cannot_take_are_refused_in_one_line(models, tmp_path):
    for override in ("control.control_source=grey", f"control.reference={tmp_path / 'r.png'}",
                     "control.control_source=video"):
        with pytest.raises(ConfigError, match=r"takes only its input's edges .* need a \*vace\* preset") as info:
            load_config("default", [override])
        assert "\n" not in str(info.value)
    s = session(models)
    with pytest.raises(ValueError, match=r"control.control_source=flow: model preset 'embedded' takes only"):
        s.set_params(control_source="flow")
    s.set_params(control_source="edges", context_scale=0.5)
    assert s.stats()["control"]["source"] == "edges" and s.cfg.control.context_scale == 0.5
    with pytest.raises(ValueError, match="no VACE control blocks"):
        s.set_reference(np.zeros((8, 8, 3), np.uint8))
