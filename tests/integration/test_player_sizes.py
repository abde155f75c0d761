"""`loom play` sizes: `--size` on an input is applied (never silently ignored), `--resolution` sets the model's.

Pass-through engines make the content exact, so the scaled picture can be compared with the input.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest

from loom_live.plugin.cli.main import main
from tests.fakes.media import write_clip

ROOT = Path(__file__).resolve().parents[2]


def _play(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loom_live.plugin.cli", "play", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _decode(path: Path) -> np.ndarray:
    import av

    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def _smooth_clip(path: Path, n: int, w: int, h: int) -> Path:
    """Soft gradients that move: scaling keeps them recognisable, unlike noise."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    frames = [np.stack([(x * 255 / w + 8 * i) % 256, y * 255 / h, np.full_like(x, 40 + 10 * i)], -1).astype(np.uint8)
              for i in range(n)]
    return write_clip(path, frames)


def test_size_on_a_file_input_scales_every_frame_and_says_so(tmp_path):
    src = _smooth_clip(tmp_path / "in.mp4", 9, 96, 64)
    out = _play("-i", str(src), "--size", "48x32", "-o", "small.mp4", "--passthrough", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "input 96x64 scaled to 48x32 (--size)" in out.stderr
    got, want = _decode(tmp_path / "small.mp4"), _decode(src)
    assert got.shape == (9, 32, 48, 3)
    scaled = np.stack([cv2.resize(f, (48, 32), interpolation=cv2.INTER_AREA) for f in want])
    mse = np.mean((got.astype(np.float64) - scaled) ** 2)
    assert 10 * np.log10(255**2 / max(mse, 1e-9)) > 30, "the output is the input scaled, frame for frame"


def test_resolution_is_the_models_and_is_checked_before_an_engine_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["play", "-n", "5", "--resolution", "250x256"]) == 2
    err = capsys.readouterr().err
    assert "resolution.width: 250 is not allowed; expected a multiple of 16" in err
    with pytest.raises(SystemExit) as exited:
        main(["play", "--resolution", "big"])
    assert exited.value.code == 2 and "'big' is not WIDTHxHEIGHT" in capsys.readouterr().err
    assert not list(tmp_path.iterdir()), "a refused run left a file behind"


def test_help_shows_how_to_set_the_models_resolution(capsys):
    with pytest.raises(SystemExit):
        main(["play", "--help"])
    text = capsys.readouterr().out
    assert "--resolution WxH" in text
    assert "--set resolution.width=W --set resolution.height=H" in text
