"""The player path on a CPU: file-run FPS after the first restyled frame, and live-mode drops at 10 FPS.

Runs the real `loom play` player in this process (engine process, bridge, encoder, all as a user
runs them) on the built-in generated clip:
- file runs (lossless), pass-through engine and the configured model: FPS after the first
  restyled frame, as the progress bar shows it ((frames - 1) / time from the first frame to the
  last), and the rate over the second half of the run (a player that sends frames in batches
  gets its first batch back in one burst, which flatters the first figure);
- a live run with the clip coming in at `--live-fps` on its own thread, as a camera's frames do
  (frames the player is not ready for are replaced by newer ones): the share of the frames the
  source produced after the first restyled frame that never came back restyled.

Prints one table; `--json` writes every figure. The issue's targets (issue 29, 2-core CPU box,
embedded model at 256x256): file run >= 8 FPS; live keeps a 10 FPS source dropping <= 1/3.

    python benchmarks/bench_player.py --json /tmp/bench_player.json
    python benchmarks/bench_player.py --set resolution.width=256 --set resolution.height=256 --frames 97
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loom_live.engine.config import load_config  # noqa: E402
from loom_live.plugin.media.base import FrameSource  # noqa: E402
from loom_live.plugin.media.generated_clip import generate_clip  # noqa: E402
from loom_live.plugin.player.app import Player  # noqa: E402
from loom_live.plugin.player.options import PlayerOptions  # noqa: E402
from loom_live.plugin.player.status import StatusPrinter  # noqa: E402


class TimingPrinter(StatusPrinter):
    """Silent; remembers when each restyled frame of a file run was written."""

    def __init__(self) -> None:
        super().__init__(quiet=True)
        self.times: list[tuple[float, int]] = []

    def progress(self, done: int, total: int | None) -> None:
        self.times.append((time.perf_counter(), done))


class PacedCamera(FrameSource):
    """The generated clip delivered like a camera: one frame every 1/fps s, whether or not it is read
    in time; the run stops when it ends. Frames are rendered beforehand (a camera costs no drawing)."""

    def __init__(self, frames: list, fps: float, on_end: Any) -> None:
        h, w = frames[0].shape[:2]
        super().__init__("paced camera", fps, w, h, None, is_live=True)
        self._frames, self._on_end = frames, on_end
        self.produced: list[float] = []
        self._t0: float | None = None

    def _read(self) -> Any:
        if self._t0 is None:
            self._t0 = time.perf_counter()
        i = len(self.produced)
        if i >= len(self._frames):
            self._on_end()
            return None
        delay = self._t0 + i / self.fps - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        self.produced.append(time.perf_counter())
        return self._frames[i]


class MeasuredPlayer(Player):
    """A Player that keeps the bridge's counters: when the first restyled frame came, and at the end."""

    first: dict[str, Any] | None = None
    last: dict[str, Any] | None = None
    first_t = last_t = 0.0
    camera: PacedCamera | None = None

    def _open_source(self) -> None:
        if self.camera is None:
            super()._open_source()
            return
        self.source, self.size = self.camera, self.camera.size

    def _start_engine(self) -> None:
        super()._start_engine()
        latest = self.bridge.latest

        def watched() -> Any:
            out, status = latest()
            if self.first is None and status.seq >= 0:
                self.first, self.first_t = self._counts(), time.perf_counter()
            return out, status

        self.bridge.latest = watched

    def _counts(self) -> dict[str, Any]:
        s = self.bridge.stats()
        return {"submitted": s["submitted"], "received": s["received"], "frames_out": self.frames_out}

    def _close(self, keep: bool) -> None:
        if self.bridge is not None:
            self.last, self.last_t = self._counts(), time.perf_counter()
        super()._close(keep)


def options(args: argparse.Namespace, out: Path, **kw: Any) -> PlayerOptions:
    cfg = load_config(args.config, args.overrides)
    return PlayerOptions(outputs=[str(out)], config=args.config, overrides=list(args.overrides),
                         default_prompt=cfg.prompt.text, size=args.size, quiet=True, overwrite=True,
                         startup_timeout_s=600.0, **kw)


def file_run(args: argparse.Namespace, out: Path, passthrough: bool) -> dict[str, Any]:
    printer = TimingPrinter()
    t0 = time.perf_counter()
    code = Player(options(args, out, max_frames=args.frames, passthrough=passthrough), printer).run()
    wall = time.perf_counter() - t0
    times = printer.times
    if code != 0 or len(times) < 2:
        return {"exit_code": code, "frames": len(times)}
    (t_first, _), (t_last, n) = times[0], times[-1]
    half = len(times) // 2  # the second half: the rate once the stream is under way, however the start went
    return {"exit_code": code, "frames": n, "wall_s": round(wall, 2),
            "startup_s": round(t_first - t0, 2),
            "fps_after_first": round((n - 1) / max(t_last - t_first, 1e-9), 2),
            "fps_second_half": round((n - times[half - 1][1]) / max(t_last - times[half - 1][0], 1e-9), 2)}


def live_run(args: argparse.Namespace, out: Path, passthrough: bool) -> dict[str, Any]:
    n = int(args.live_seconds * args.live_fps)
    player = MeasuredPlayer(options(args, out, passthrough=passthrough), TimingPrinter())
    frames = list(generate_clip(n, size=args.size, fps=args.live_fps))
    player.camera = camera = PacedCamera(frames, args.live_fps, lambda: setattr(player.controls.state, "quit", True))
    code = player.run()
    if code != 0 or player.first is None or player.last is None:
        return {"exit_code": code, "restyled": 0}
    produced = sum(1 for t in camera.produced if player.first_t <= t <= player.last_t)
    restyled = player.last["received"] - player.first["received"]
    seconds = player.last_t - player.first_t
    return {"exit_code": code, "input_fps": args.live_fps, "produced": produced, "steady_s": round(seconds, 2),
            "submitted": player.last["submitted"] - player.first["submitted"], "restyled": restyled,
            "drop_rate": round(max(0.0, 1 - restyled / max(produced, 1)), 3),
            "restyled_fps": round(restyled / max(seconds, 1e-9), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-c", "--config", default="default")
    ap.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
    ap.add_argument("--size", default="256x256", help="generated clip WxH (default 256x256)")
    ap.add_argument("--frames", type=int, default=97, help="frames of each file run (default 97)")
    ap.add_argument("--live-fps", type=float, default=10.0)
    ap.add_argument("--live-seconds", type=float, default=20.0)
    ap.add_argument("--runs", default="file-passthrough,file-model,live-passthrough,live-model",
                    help="comma-separated subset of the four runs")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args()
    args.size = tuple(int(v) for v in args.size.lower().split("x"))
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.runs.split(","):
            kind, engine = name.split("-")
            run = file_run if kind == "file" else live_run
            results[name] = run(args, Path(tmp) / f"{name}.mp4", passthrough=engine == "passthrough")
            print(f"{name}: {results[name]}", file=sys.stderr)
    w, h = args.size
    print(f"\nplayer path, generated clip {w}x{h}, config {args.config} {' '.join(args.overrides)}, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    print(f"{'run':18} {'FPS after first':>16} {'2nd half FPS':>16} {'startup s':>10} "
          f"{'live drops':>11} {'restyled FPS':>13}")
    for name, r in results.items():
        cells = [f"{r[k]:>{width}}" if r.get(k) is not None else f"{'-':>{width}}" for k, width in
                 (("fps_after_first", 16), ("fps_second_half", 16), ("startup_s", 10), ("drop_rate", 11),
                  ("restyled_fps", 13))]
        print(f"{name:18} {' '.join(cells)}")
    if args.json:
        meta = {"config": args.config, "overrides": args.overrides, "size": [w, h], "frames": args.frames,
                "cpus": os.cpu_count(), "load_1min": os.getloadavg()[0], "python": platform.python_version()}
        Path(args.json).write_text(json.dumps({"meta": meta, "runs": results}, indent=2))


if __name__ == "__main__":
    main()
