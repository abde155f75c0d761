"""Temporal quality metrics (engine.tools.quality) and the ``loom eval`` command around them."""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np
import pytest

from loom_live.engine.tools import eval as ev
from loom_live.engine.tools.quality import (
    FARNEBACK_PARAMS,
    REPORT_VERSION,
    WINDOW_METRICS,
    QualityMeter,
    QualityReport,
    evaluate_frames,
    plot_reports,
)
from loom_live.plugin.cli import eval as eval_cmd
from loom_live.plugin.media.generated_clip import generate_clip
from tests.fakes.media import noise_clip

SHIFT_PX = 3


def _texture(height: int, width: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    noise = rng.integers(0, 256, (height, width, 3)).astype(np.uint8)
    return cv2.normalize(cv2.GaussianBlur(noise, (0, 0), 2.0), None, 0, 255, cv2.NORM_MINMAX)


def _panning(n: int = 10, height: int = 96, width: int = 128) -> list[np.ndarray]:
    """A camera pan: a textured scene moving SHIFT_PX pixels left per frame (new content enters)."""
    scene = _texture(height + 20, width + SHIFT_PX * n + 20)
    return [np.ascontiguousarray(scene[10:10 + height, 10 + SHIFT_PX * t:10 + SHIFT_PX * t + width])
            for t in range(n)]


def _noisy(frames: list[np.ndarray], amplitude, seed: int = 1) -> list[np.ndarray]:
    """Independent noise per frame (temporal instability); amplitude(t) may grow along the clip."""
    rng = np.random.default_rng(seed)
    out = []
    for t, frame in enumerate(frames):
        a = amplitude(t)
        noise = rng.integers(-a, a + 1, frame.shape) if a else 0
        out.append(np.clip(frame.astype(np.int32) + noise, 0, 255).astype(np.uint8))
    return out


class DelayedIdentity:
    """A stand-in engine with latency: outputs lag inputs by ``lag`` frames until flush()."""

    def __init__(self, lag: int = 3, drop_last: bool = False):
        self.lag, self.drop_last, self.held = lag, drop_last, []

    def push(self, frames: np.ndarray) -> np.ndarray:
        self.held.extend(frames)
        ready, self.held = self.held[:-self.lag], self.held[-self.lag:]
        return np.stack(ready) if ready else np.empty((0, *frames.shape[1:]), np.uint8)

    def flush(self) -> np.ndarray:
        tail, self.held = self.held[:-1] if self.drop_last else self.held, []
        return np.stack(tail)


class Blur:
    """A processor that smooths each frame: less change frame to frame than its input."""

    def push(self, frames: np.ndarray) -> np.ndarray:
        return np.stack([cv2.GaussianBlur(f, (0, 0), 2.0) for f in frames])

    def flush(self) -> np.ndarray:
        return np.empty((0, 1, 1, 3), np.uint8)


# ---------------------------------------------------------------------------------------------
# Metrics


def test_identical_frames_give_zero_warp_error_and_flicker() -> None:
    frames = [_texture(64, 80)] * 5
    report = evaluate_frames(frames, frames)
    assert report.totals["warp_error"] == 0.0
    assert report.totals["flicker"] == 0.0
    assert report.totals["input_diff"] == 0.0


@pytest.mark.parametrize("flow", ["farneback", "dis"])
def test_known_translation_is_compensated_by_flow(flow: str) -> None:
    frames = _panning()
    compensated = evaluate_frames(frames, frames, flow=flow)
    raw = evaluate_frames(frames, frames, flow="none")
    assert compensated.totals["warp_error"] < 1.0, compensated.totals
    assert raw.totals["warp_error"] > 10.0, raw.totals
    assert compensated.mode == flow and raw.mode == "none"


def test_occlusion_mask_drops_pixels_that_leave_the_frame() -> None:
    frames = _panning()
    masked = evaluate_frames(frames, frames, occlusion=True)
    plain = evaluate_frames(frames, frames)
    assert masked.mode == "farneback+occlusion"
    # The strip of SHIFT_PX columns that enters each frame has no source in the previous one.
    assert masked.totals["occluded_fraction"] >= SHIFT_PX / 128 * 0.8
    assert masked.totals["warp_error"] < plain.totals["warp_error"]
    assert masked.totals["warp_error"] < 0.3
    assert plain.totals["occluded_fraction"] is None


def test_unstable_output_scores_worse_than_a_stable_one() -> None:
    frames = _panning()
    stable = evaluate_frames(frames, frames)
    shaky = evaluate_frames(frames, _noisy(frames, lambda t: 30))
    smooth = evaluate_frames(frames, [cv2.GaussianBlur(f, (0, 0), 2.0) for f in frames])
    assert shaky.totals["warp_error"] > stable.totals["warp_error"] + 5
    assert shaky.totals["flicker"] > 3  # changes more than the input does
    assert smooth.totals["flicker"] < 0  # a blurred copy changes less than the input


def test_colour_drift_is_measured_against_the_input() -> None:
    frames = _panning(6)
    darker = [(f * 0.5).astype(np.uint8) for f in frames]
    report = evaluate_frames(frames, darker)
    assert report.totals["luma_shift"] < -40
    assert report.totals["contrast_ratio"] == pytest.approx(0.5, abs=0.05)
    flat = [np.zeros((32, 32, 3), np.uint8)] * 3
    assert evaluate_frames(flat, flat).totals["contrast_ratio"] == 1.0


# ---------------------------------------------------------------------------------------------
# Report, windows, drift, plot


def test_report_schema() -> None:
    frames = _panning(12)
    report = evaluate_frames(frames, frames, window=5)
    data = json.loads(report.to_json())
    assert set(data) == {"version", "mode", "flow", "window", "frames", "pairs", "width", "height", "totals",
                         "windows", "trend", "meta"}
    assert data["version"] == REPORT_VERSION and isinstance(data["version"], int)
    assert data["mode"] == "farneback"
    assert data["flow"] == {"method": "farneback", **FARNEBACK_PARAMS}
    assert FARNEBACK_PARAMS == {"pyr_scale": 0.5, "levels": 3, "winsize": 15, "iterations": 3, "poly_n": 5,
                                "poly_sigma": 1.2}
    assert (data["frames"], data["pairs"], data["width"], data["height"]) == (12, 11, 128, 96)
    assert set(data["totals"]) == set(WINDOW_METRICS)
    assert all(isinstance(data["totals"][k], float) for k in WINDOW_METRICS if k != "occluded_fraction")
    assert data["windows"]["start_frame"] == [0, 5, 10]
    assert data["windows"]["end_frame"] == [5, 10, 12]
    assert data["windows"]["pairs"] == [4, 5, 2]
    for key in WINDOW_METRICS:
        assert len(data["windows"][key]) == 3
        assert set(data["trend"][key]) == {"slope_per_1000_frames", "first", "last"}
    assert all(isinstance(v, float) for v in data["windows"]["warp_error"])
    assert isinstance(data["trend"]["warp_error"]["slope_per_1000_frames"], float)


def test_report_written_to_file(tmp_path: Path) -> None:
    frames = _panning(4)
    evaluate_frames(frames, frames).to_json(tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text())["frames"] == 4


def test_drift_shows_as_a_rising_trend_and_a_plot(tmp_path: Path) -> None:
    frames = _panning(40, 64, 80)
    drifting = _noisy(frames, lambda t: t)  # noise grows by one level per frame
    meter = QualityMeter(window=10)
    for i, o in zip(frames, drifting):
        meter.update(i, o)
    drift = meter.report({"clip": "synthetic"})
    steady = evaluate_frames(frames, _noisy(frames, lambda t: 20), window=10)
    assert drift.windows["start_frame"] == [0, 10, 20, 30]
    errors = drift.windows["warp_error"]
    assert errors == sorted(errors) and errors[-1] > errors[0] + 10
    assert drift.trend["warp_error"]["slope_per_1000_frames"] > 300
    assert abs(steady.trend["warp_error"]["slope_per_1000_frames"]) < 50
    assert drift.meta == {"clip": "synthetic"}

    path = plot_reports([("drifting", drift), ("steady", steady)], tmp_path / "drift.png", title="drift")
    image = cv2.imread(str(path))
    assert image is not None and image.shape[1] == 1000 and image.shape[0] > 600
    # Both series are drawn (matplotlib's first two colours, blue and orange, in BGR).
    for bgr in ((180, 119, 31), (14, 127, 255)):
        assert np.any(np.all(image == bgr, axis=-1))


def test_meter_reports_mid_stream_and_resets() -> None:
    frames = _panning(6)
    meter = QualityMeter(window=4)
    for frame in frames[:3]:
        meter.update(frame, frame)
    assert meter.report().frames == 3
    for frame in frames[3:]:
        meter.update(frame, frame)
    assert meter.report().frames == 6
    meter.reset()
    assert meter.frames == 0


# ---------------------------------------------------------------------------------------------
# Bad inputs


def test_fewer_than_two_frames() -> None:
    frame = _texture(32, 32)
    with pytest.raises(ValueError, match="need at least 2 frames.*got 1"):
        evaluate_frames([frame], [frame])
    with pytest.raises(ValueError, match="need at least 2 frames.*got 0"):
        QualityMeter().report()


def test_mismatched_sizes() -> None:
    a, b = _texture(32, 48), _texture(48, 32)
    with pytest.raises(ValueError, match="frame 0: input 48x32 and output 32x48 differ in size"):
        QualityMeter().update(a, b)
    meter = QualityMeter()
    meter.update(a, a)
    with pytest.raises(ValueError, match="frame 1: size 32x48 differs from the stream's 48x32"):
        meter.update(b, b)
    with pytest.raises(ValueError, match="same number of frames, got 2 and 1"):
        evaluate_frames([a, a], [a])


@pytest.mark.parametrize(("frame", "message"), [
    (np.zeros((32, 32, 3), np.float32), "must be uint8"),
    (np.zeros((32, 32), np.uint8), r"must be RGB \[H, W, 3\]"),
    (np.zeros((32, 32, 4), np.uint8), r"must be RGB \[H, W, 3\]"),
    ([[0]], "must be a numpy array"),
])
def test_bad_frames(frame, message: str) -> None:
    good = np.zeros((32, 32, 3), np.uint8)
    with pytest.raises(ValueError, match=f"output frame 0 {message}"):
        QualityMeter().update(good, frame)


def test_bad_settings() -> None:
    with pytest.raises(ValueError, match="flow method 'raft' is not one of farneback, dis, none"):
        QualityMeter(flow="raft")
    with pytest.raises(ValueError, match="window must be an integer >= 2"):
        QualityMeter(window=1)
    with pytest.raises(ValueError, match="occlusion mask needs a flow method"):
        QualityMeter(flow="none", occlusion=True)


# ---------------------------------------------------------------------------------------------
# loom eval


def test_eval_pairs_outputs_with_inputs_through_engine_latency() -> None:
    frames = _panning(11)
    settings = ev.EvalSettings(window=5, chunk=4)
    lagged = ev.measure_clip(DelayedIdentity(lag=3), iter(frames), settings)
    direct = evaluate_frames(frames, frames, window=5)
    assert lagged.frames == 11
    assert lagged.totals == direct.totals and lagged.windows == direct.windows
    assert lagged.meta["engine_fps"] > 0


def test_eval_refuses_an_engine_that_loses_frames() -> None:
    settings = ev.EvalSettings(chunk=4)
    with pytest.raises(ev.EvalError, match="returned 9 frames for 10 inputs"):
        ev.measure_clip(DelayedIdentity(drop_last=True), iter(_panning(10)), settings)


def test_eval_compares_two_processors(tmp_path: Path) -> None:
    clip = ev.Clip("gen", "generated", lambda: iter(generate_clip(24, (96, 64), seed=5)))
    runs = [ev.EvalRun("identity", ev.IdentityProcessor), ev.EvalRun("blur", Blur)]
    report = ev.evaluate(runs, [clip], ev.EvalSettings(window=8), tmp_path, log=lambda m: None)
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved == json.loads(json.dumps(report))
    assert [r["label"] for r in saved["runs"]] == ["identity", "blur"]
    results = saved["clips"][0]["results"]
    assert set(results) == {"identity", "blur"} and results["blur"]["windows"]["start_frame"] == [0, 8, 16]
    assert saved["summary"]["identity"]["flicker"] == 0.0
    assert saved["summary"]["blur"]["flicker"] < 0
    assert (tmp_path / saved["clips"][0]["plot"]).stat().st_size > 1000
    QualityReport(**results["blur"])  # the stored report is a QualityReport again


def test_ping_pong_loops_without_a_cut() -> None:
    assert list(ev.ping_pong(iter([0, 1, 2]), 9)) == [0, 1, 2, 1, 0, 1, 2, 1, 0]
    assert list(ev.ping_pong(iter([0, 1, 2, 3]), 2)) == [0, 1]


def test_loom_eval_identity_on_a_real_clip(media_dir: Path, tmp_path: Path, capsys) -> None:
    code = eval_cmd.main([str(media_dir / "davis512_libby.mp4"), "--frames", "60",
                          "--size", "128x128", "--window", "20", "--flow", "dis", "-o", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "report.json").read_text())
    result = report["clips"][0]["results"]["as-is"]
    assert (result["frames"], result["width"], result["mode"]) == (60, 128, "dis")
    assert result["windows"]["start_frame"] == [0, 20, 40]
    assert result["totals"]["flicker"] is None and 0 < result["totals"]["warp_error"] < 20
    assert (tmp_path / "davis512_libby.png").is_file()
    assert "davis512_libby.mp4" in capsys.readouterr().out


def test_loom_eval_without_clips_uses_the_generated_clip(tmp_path: Path, capsys) -> None:
    assert eval_cmd.main(["--frames", "12", "--size", "64x48", "-o", str(tmp_path)]) == 0
    out = capsys.readouterr().out  # under the table, what each column means
    assert "A soft or blurred output scores low too" in out and "negative changes less" in out
    assert "sharpness: mean Sobel gradient" in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["clips"][0]["clip"] == "generated"
    result = report["clips"][0]["results"]["as-is"]
    assert result["frames"] == 12
    assert len(result["windows"]["start_frame"]) >= 6, "the window fits a short clip: a line, not a point"


@pytest.mark.parametrize(("argv", "message"), [
    (["/no/such/clip.mp4"], "clip not found: /no/such/clip.mp4"),
    (["--window", "1"], "--window must be at least 2"),
    (["--restyle", "--config", "/no/such.yaml"], "/no/such.yaml: config file not found"),
])
def test_loom_eval_bad_input_exits_2_with_a_message(tmp_path: Path, capsys, argv, message) -> None:
    assert eval_cmd.main([*argv, "-o", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"loom eval: error: {message}" in err and "Traceback" not in err


def test_loom_eval_out_that_is_a_file_is_refused_saying_it_is_the_folder(tmp_path: Path, capsys) -> None:
    """`-o render.mp4` (as for `loom play`) ended in "[Errno 17] File exists: 'render.mp4'"; the file stays."""
    render = tmp_path / "render.mp4"
    render.write_bytes(b"a user's render")
    for out in (render, render / "sub"):
        assert eval_cmd.main(["--frames", "12", "--size", "64x48", "-o", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"loom eval: error: --out {out}: {render} is a file; --out is the folder report.json" in err, err
    assert render.read_bytes() == b"a user's render"


def test_a_file_scored_as_it_is_reports_what_it_does_not_measure_as_null_not_zero(tmp_path: Path, capsys) -> None:
    """The table printed flicker as '-' while report.json said 0.0, which reads as measured: output = input
    compares nothing, so flicker and the colour shifts are null in the report, '-' in the table."""
    assert eval_cmd.main(["--frames", "12", "--size", "64x48", "-q", "-o", str(tmp_path)]) == 0
    row = capsys.readouterr().out.splitlines()[2].split()
    report = json.loads((tmp_path / "report.json").read_text())
    result = report["clips"][0]["results"]["as-is"]
    for key in ev.INPUT_COMPARISONS:
        assert result["totals"][key] is None and set(result["windows"][key]) == {None}, key
        assert set(result["trend"][key].values()) == {None}, key
    assert [report["summary"]["as-is"][key] for key in ("flicker", "luma_shift", "saturation_shift")] == [None] * 3
    assert result["totals"]["warp_error"] > 0 and result["totals"]["sharpness"] > 0  # measured: numbers
    assert row[:2] == ["generated", "as-is"] and row[5] == "-"


def test_a_second_eval_into_the_same_folder_is_refused_and_y_leaves_no_plot_of_the_first(tmp_path: Path,
                                                                                         capsys) -> None:
    """A second run replaced report.json without a word, beside the first run's plots it no longer names. It is
    refused before any work, naming the file; -y removes the earlier report's plots and keeps the user's files."""
    clip = noise_clip(tmp_path / "first.mp4", 12)
    out = tmp_path / "out"
    assert eval_cmd.main([str(clip), "--size", "64x48", "-q", "-o", str(out)]) == 0
    mine = [out / "notes.txt", out / "mine.png"]
    for path in mine:
        path.write_text("the user's")
    before = (out / "report.json").read_bytes()
    capsys.readouterr()
    assert eval_cmd.main(["--frames", "12", "--size", "64x48", "-q", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"loom eval: error: --out {out}: {out / 'report.json'} exists; give --overwrite (-y)" in err, err
    assert (out / "report.json").read_bytes() == before and (out / "first.png").is_file()
    assert eval_cmd.main(["--frames", "12", "--size", "64x48", "-q", "-y", "-o", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert [c["plot"] for c in report["clips"]] == ["generated.png"]
    assert sorted(p.name for p in out.iterdir()) == ["generated.png", "mine.png", "notes.txt", "report.json"]
    assert all(path.read_text() == "the user's" for path in mine)
    (out / "report.json").unlink()  # a plot the run would write, with no report: refused by its own name
    assert eval_cmd.main(["--frames", "12", "--size", "64x48", "-q", "-o", str(out)]) == 2
    assert f"--out {out}: {out / 'generated.png'} exists" in capsys.readouterr().err


def test_a_y_run_that_fails_midway_leaves_the_earlier_report_and_its_plots_as_they_were(tmp_path: Path, capsys,
                                                                                          monkeypatch) -> None:
    """Plots were drawn straight into --out, so a -y run that failed after its first plot left the earlier
    report.json beside a plot of the new run. They are drawn into a hidden folder there and moved in only
    once the whole report is written; a failed run removes that folder, and a whole one replaces them."""
    import errno

    clips = [noise_clip(tmp_path / f"{name}.mp4", 12, seed=i) for i, name in enumerate(("a", "b", "gone"))]
    out = tmp_path / "out"
    assert eval_cmd.main([*map(str, clips), "-q", "-o", str(out)]) == 0
    (out / "a.png").write_bytes(b"the earlier plot of a")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    drawn: list[Path] = []
    draw = ev.plot_reports

    def full_disk_at_the_second_plot(runs, path, **kwargs):
        if drawn:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        drawn.append(Path(path))
        return draw(runs, path, **kwargs)

    monkeypatch.setattr(ev, "plot_reports", full_disk_at_the_second_plot)
    assert eval_cmd.main([*map(str, clips[:2]), "-q", "-y", "-o", str(out)]) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no hidden folder left either
    assert drawn[0].name == "a.png" and drawn[0].parent.parent == out and not drawn[0].parent.exists()
    monkeypatch.undo()
    assert eval_cmd.main([*map(str, clips[:2]), "-q", "-y", "-o", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["a.png", "b.png", "report.json"]  # gone.png: stale, removed
    assert (out / "a.png").read_bytes().startswith(b"\x89PNG")
    assert [c["plot"] for c in json.loads((out / "report.json").read_text())["clips"]] == ["a.png", "b.png"]


def test_without_matplotlib_an_earlier_plot_is_not_among_the_files_eval_would_write(tmp_path: Path, capsys,
                                                                                      monkeypatch) -> None:
    """No plot is written without matplotlib, yet an earlier generated.png was refused as a file the run would
    replace: the run goes on, leaves it as it was and its report names no plot."""
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    (tmp_path / "generated.png").write_text("an earlier plot")
    assert eval_cmd.main(["--frames", "12", "--size", "64x48", "-q", "-o", str(tmp_path)]) == 0, \
        capsys.readouterr().err
    assert json.loads((tmp_path / "report.json").read_text())["clips"][0]["plot"] is None
    assert (tmp_path / "generated.png").read_text() == "an earlier plot"


def test_loom_eval_folder_without_clips(tmp_path: Path, capsys) -> None:
    (tmp_path / "notes.txt").write_text("no video here")
    assert eval_cmd.main([str(tmp_path), "-o", str(tmp_path / "out")]) == 2
    assert f"folder {tmp_path} holds no video clips" in capsys.readouterr().err


def test_loom_eval_bad_size_is_an_argument_error(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        eval_cmd.main(["--size", "big"])
    assert exit_info.value.code == 2
    assert "size must look like 832x480" in capsys.readouterr().err


def test_loom_eval_runs_the_engine_and_compares_two_configs(tmp_path: Path) -> None:
    small = ["--set", "resolution.width=32", "--set", "resolution.height=32"]
    argv = ["--restyle", "--frames", "13", "--size", "32x32", "--compare", "tiny-random", *small,
            "--set", "stream.steps=[700]", "-o", str(tmp_path)]
    assert eval_cmd.main(argv) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    results = report["clips"][0]["results"]
    assert len(results) == 2 and all(r["frames"] == 13 for r in results.values())
    assert (tmp_path / "generated.png").stat().st_size > 0


def test_sharpness_falls_when_the_output_is_smoothed_even_as_warp_error_improves():
    frames = _panning()
    noisy = _noisy(frames, lambda t: 12)
    blurred = [cv2.GaussianBlur(f, (0, 0), 3.0) for f in noisy]
    sharp, smooth = evaluate_frames(frames, noisy), evaluate_frames(frames, blurred)
    assert smooth.totals["warp_error"] < sharp.totals["warp_error"]  # the smoothing warp error rewards ...
    assert smooth.totals["sharpness"] < 0.5 * sharp.totals["sharpness"]  # ... and sharpness exposes
    flat = [np.full((32, 32, 3), 90, np.uint8)] * 3
    assert evaluate_frames(flat, flat).totals["sharpness"] == 0.0


def test_the_window_fits_the_clip() -> None:
    assert ev.fit_window(None) == 100 and ev.fit_window(3000) == 100
    assert ev.fit_window(49) == 6 and ev.fit_window(5) == 2


def test_sharpness_is_reported_beside_warp_error_and_falls_with_blur() -> None:
    frames = _panning(8)
    blurred = [cv2.GaussianBlur(f, (0, 0), 3.0) for f in frames]
    sharp, soft = evaluate_frames(frames, frames, window=4), evaluate_frames(frames, blurred, window=4)
    assert sharp.totals["sharpness"] > 2 * soft.totals["sharpness"] > 0
    assert soft.totals["input_sharpness"] == sharp.totals["sharpness"]
    assert len(soft.windows["sharpness"]) == 2


def test_a_restyle_of_a_preset_without_weights_fails_before_loading(tmp_path: Path, capsys) -> None:
    assert eval_cmd.main(["--restyle", "-c", "wan2.1-1.3b", "-o", str(tmp_path)]) == 2
    assert "loom pull wan2.1-1.3b" in capsys.readouterr().err


def test_a_clip_whose_frame_size_changes_midway_is_refused_naming_the_clip_and_where():
    """Joined segments of two sizes: the measure between frames of two sizes means nothing, and numpy's
    own words would name neither the clip nor the frame."""
    frames = [np.zeros((48, 64, 3), np.uint8)] * 3 + [np.zeros((64, 96, 3), np.uint8)]
    with pytest.raises(ValueError, match=r"joined.ts: frame 3 is 96x64 after 3 frames of 64x48"):
        list(ev.one_size(iter(frames), "joined.ts"))
    assert len(list(ev.one_size(iter(frames[:3]), "joined.ts"))) == 3
