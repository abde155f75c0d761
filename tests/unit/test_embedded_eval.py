"""The embedded model card's structure measure (engine/train/evaluate.py): the edge correlation of an
output with its input, and the card's tables with it (and from a report made before it)."""

from __future__ import annotations

import json

import cv2
import numpy as np
import pytest

from loom_live.engine.train.evaluate import (
    block_grid,
    edge_correlation,
    looped,
    refresh_change,
    refresh_frames,
    summary,
    tables,
)
from tests.fakes.disk import fill_the_disk


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
    assert "edge corr. with input" in text and text.splitlines()[-1].endswith("| - | 1.00x | - | - |")


def test_the_refresh_measure_sees_a_jump_at_the_refresh_and_not_one_elsewhere():
    """Frames that change by 1 grey level per frame, with one jump of 20: at the first frame of
    latent 50 (frame 197) it is the refresh's; at latent 30's it is outside the window."""
    n = refresh_frames(50)
    assert n == 213  # latents 0-52: 5 frames, then 4 a latent

    def ramp(jump_at: int) -> np.ndarray:
        level = np.arange(n, dtype=np.float32) + 20.0 * (np.arange(n) >= jump_at)
        return np.broadcast_to(level[:, None, None, None], (n, 4, 4, 3)).astype(np.uint8)

    at_refresh, elsewhere = refresh_change(ramp(197), 50), refresh_change(ramp(4 * 30 - 3), 50)
    assert at_refresh > 10 and elsewhere == pytest.approx(1.0, abs=0.1)
    with pytest.raises(ValueError, match="do not reach the refresh"):
        refresh_change(ramp(197)[:150], 50)


def test_a_looped_clip_turns_without_a_jump():
    clip = shapes(7)
    out = looped(clip, 20)
    assert len(out) == 20 and np.array_equal(out[:7], clip) and np.array_equal(out[7:12], clip[5:0:-1])
    assert np.array_equal(out[12:19], clip) and np.array_equal(out[19], clip[5])


def test_the_looped_run_shows_its_refresh_figures_in_the_runs_table():
    rows = [{**row("ink", 0.6), "refresh_change": 1.2}, {**row("toon", 0.6), "refresh_change": 1.8}]
    report = {"frames": 25, "runs": {
        "default": {"styles": ["ink", "toon"], "rows": rows[:1], "summary": summary(rows[:1])},
        "looped past a RoPE refresh": {"styles": ["ink", "toon"], "frames": 213, "rows": rows,
                                       "summary": summary(rows)}}}
    assert "| 1.00x (1.50x, 1.80x) | - | 213 |" in tables(report)


def test_the_block_grid_tells_a_latent_block_texture_from_real_detail_and_skips_styles_drawn_in_blocks():
    """Detail at any place scores about 1; blobs on the decoder's 8x8 pixel blocks (what a model may buy
    Sobel sharpness with) score far above, though their sharpness is no higher than the detail's."""
    rng = np.random.default_rng(0)
    detail = np.stack([cv2.GaussianBlur(rng.integers(0, 256, (64, 64, 3)).astype(np.uint8), (3, 3), 0)
                       for _ in range(3)])
    blobs = np.repeat(np.repeat(rng.integers(60, 200, (3, 8, 8, 3)).astype(np.uint8), 8, 1), 8, 2)
    shifted = np.roll(blobs, 4, axis=(1, 2))  # the same blobs off the grid
    assert block_grid(detail) == pytest.approx(1.0, abs=0.1)
    assert block_grid(blobs) > 10 and block_grid(shifted) < 0.5
    rows = [{**row("ink", 0.6), "block_grid": 2.0, "target_block_grid": 1.0},
            {**row("pixel_art", 0.6), "block_grid": 9.0, "target_block_grid": 30.0}]
    s = summary(rows)
    assert (s["block_grid"], s["target_block_grid"]) == (2.0, 1.0)  # pixel art's blocks are its style
    report = {"runs": {"default": {"styles": ["ink", "pixel_art"], "rows": rows, "summary": s}}}
    assert "| 2.00 (1.00) |" in tables(report)


def test_a_stopped_evaluation_leaves_the_earlier_report_whole(tmp_path, monkeypatch):
    """`loom train eval` writes each run's rows as it goes, beside the report: stopped midway (its default
    --out is the model card's data), the earlier complete report stays; a finished one replaces it."""
    from loom_live.engine.train import evaluate

    out = tmp_path / "eval.json"
    out.write_text('{"runs": {"earlier": "complete"}}')
    monkeypatch.setattr(evaluate, "held_out", lambda frames: {"clip": shapes(frames)})
    calls = []

    def measure(clips, overrides, styles, weights, refresh_at):
        calls.append(overrides)
        if len(calls) == 3:
            raise KeyboardInterrupt  # Ctrl-C during the third run
        return [{"clip": "clip", "style": "ink", "warp_error": 1.0}]

    monkeypatch.setattr(evaluate, "measure", measure)
    monkeypatch.setattr(evaluate, "summary", lambda rows: {"rows": len(rows)})
    with pytest.raises(KeyboardInterrupt):
        evaluate.main(None, str(out), frames=5, ablation_frames=5)
    assert out.read_text() == '{"runs": {"earlier": "complete"}}'
    monkeypatch.setattr(evaluate, "measure", lambda *a: [{"clip": "clip"}])
    report = evaluate.main(None, str(out), frames=5, ablation_frames=5)
    assert json.loads(out.read_text())["runs"].keys() == report["runs"].keys() and "earlier" not in report["runs"]
    assert not out.with_name("eval.json.partial").exists()


def test_a_picture_the_disk_cannot_hold_leaves_the_earlier_one_whole(tmp_path, monkeypatch):
    """`python -m loom_live.engine.train picture` writes over the README's picture: a full disk midway leaves
    the earlier picture as it was, and no half-written file beside it."""
    from loom_live.engine.train import evaluate

    monkeypatch.setattr(evaluate, "read_clip", lambda path, size, limit: np.stack(
        [cv2.resize(f, (size, size)) for f in shapes(limit)]))
    monkeypatch.setattr(evaluate, "stylise", lambda frames, prompt: 255 - frames)
    out = tmp_path / "styles.png"
    evaluate.picture(str(out))
    earlier = out.read_bytes()
    assert cv2.imread(str(out)).shape[:2] == (22 + 3 * (evaluate.SIZE + 4), 5 * (evaluate.SIZE + 4))
    fill_the_disk(monkeypatch)
    with pytest.raises(OSError, match="No space left on device"):
        evaluate.picture(str(out), styles=("ink",))
    assert out.read_bytes() == earlier and [p.name for p in tmp_path.iterdir()] == ["styles.png"]
