"""The embedded model card's structure measure (engine/train/evaluate.py): the edge correlation of an
output with its input, and the card's tables with it (and from a report made before it)."""

from __future__ import annotations

import cv2
import numpy as np

from loom_live.engine.train.evaluate import edge_correlation, summary, tables


def shapes(n: int, seed: int = 0) -> np.ndarray:
    """[n, 64, 64, 3] frames of a few filled circles, moving."""
    rng = np.random.default_rng(seed)
    centres, colours = rng.integers(10, 54, (3, 2)), rng.integers(0, 255, (3, 3))
    out = np.full((n, 64, 64, 3), 40, np.uint8)
    for t in range(n):
        for (x, y), c in zip(centres, colours):
            cv2.circle(out[t], (int(x) + t, int(y)), 9, tuple(int(v) for v in c), -1)
    return out


def test_edge_correlation_is_one_for_the_input_itself_and_its_restyles_and_low_for_other_structure():
    clip = shapes(5)
    assert abs(edge_correlation(clip, clip) - 1.0) < 1e-6
    inverted = 255 - clip  # other colours, the same edges
    assert edge_correlation(inverted, clip) > 0.99
    assert edge_correlation(shapes(5, seed=1), clip) < 0.3  # circles elsewhere
    assert edge_correlation(np.full_like(clip, 128), clip) == 0.0  # a flat output has no structure to share
    assert edge_correlation(clip, np.zeros_like(clip)) == 0.0


def row(style: str, corr: float | None) -> dict:
    r = {"clip": "davis512_a", "style": style, "nearest": style, "mae": 1.0, "ssim": 0.5, "warp_error": 2.0,
         "target_warp_error": 2.0, "sharpness": 10.0, "target_sharpness": 20.0, "boundary_change": 1.0,
         "max_change": 2.0}
    return r if corr is None else {**r, "edge_correlation": corr, "target_edge_correlation": 0.9}


def test_the_tables_give_the_edge_correlation_per_run_and_a_report_without_it_still_renders():
    runs = {name: [row("ink", c), row("toon", c + 0.1)] for name, c in (("default", 0.6), ("control off", 0.2))}
    report = {"runs": {name: {"styles": ["ink", "toon"], "rows": rows, "summary": summary(rows)}
                       for name, rows in runs.items()}}
    report["runs"]["sinks off"] = report["runs"]["control off"]
    text = tables(report)
    assert "| ink | yes | 0.50 |" in text and "| 0.60 (0.90) |" in text
    assert "| control off | ink, toon | 2 |" in text and "| 0.25 (0.90) |" in text
    old = [row("ink", None)]
    text = tables({"runs": {"default": {"rows": old, "summary": summary(old)}}})
    assert "edge corr. with input" in text and text.splitlines()[-1].endswith("| - | - |")
