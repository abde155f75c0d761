"""The browser host's glass-to-glass latency and where the web path's share of it goes.

Starts `loom web` (a real engine process: the pass-through engine or the configured model) and one
headless Chromium page on this machine, its fake camera playing Loom's generated clip, and reads
what the page measured: each camera frame is stamped with a counter (plugin/web/stamp.py) and timed
from being drawn to its restyled frame's expected display time. Beside it, the pieces:
- the engine's own latency (the bridge's submit to output, p50), and the web path's share per frame
  (the page's glass to glass less the host's submitted-to-sent-back time for the same frame, as the
  page shows it);
- the host's part (the page's state, `host_path`): camera frame decoded to submitted, submitted to
  posted for sending (the engine plus the wait to pick its output up), posted to sent;
- the browser's WebRTC statistics: its encode of the camera, its jitter buffer and decode of the
  restyled stream, and receive to display of each timed frame (requestVideoFrameCallback).

Needs the `web` extra, selenium, and Debian's chromium and chromium-driver. Prints one table per
run; `--json` writes every figure.

    python benchmarks/bench_web_latency.py --passthrough --fps 15 --seconds 40
    python benchmarks/bench_web_latency.py --fps 15 --seconds 60     # the embedded model
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loom_live.plugin.media.generated_clip import generate_clip  # noqa: E402
from tests.fakes.media import write_y4m  # noqa: E402

STATS_JS = """
const done = arguments[arguments.length - 1];
pc.getStats().then((report) => {
  const out = {};
  report.forEach((s) => { if (s.kind === 'video' && (s.type === 'inbound-rtp' || s.type === 'outbound-rtp'))
    out[s.type + (s.type === 'inbound-rtp' ? ':' + s.trackIdentifier : '')] = s; });
  done(out);
});
"""


def _wait(what: str, check: Any, timeout_s: float, proc: subprocess.Popen) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        if proc.poll() is not None:
            raise SystemExit(f"loom web exited with {proc.returncode} while waiting for {what}")
        time.sleep(0.2)
    raise SystemExit(f"timed out after {timeout_s:g} s waiting for {what}")


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    side = args.size
    camera = write_y4m(tmp / "camera.y4m", list(generate_clip(60, size=(side, side), fps=args.fps, seed=1)),
                       fps=args.fps)
    log_path = tmp / "loom.log"
    cmd = [sys.executable, "-m", "loom_live.plugin.cli", "web", "127.0.0.1:0", "--size", f"{side}x{side}",
           "--fps", str(args.fps), "-p", "thermal camera", "--set", f"resolution.width={side}",
           "--set", f"resolution.height={side}", *(["--passthrough"] if args.passthrough else []),
           *sum((["--set", s] for s in args.set), [])]
    with open(log_path, "w+") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        driver = None
        try:
            url = _wait("the page's address", lambda: (m := re.search(r"the page is at (\S+)", log_path.read_text()))
                        and m.group(1), 60, proc)
            options = webdriver.ChromeOptions()
            options.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
            for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                        "--no-first-run", "--disable-background-timer-throttling",
                        "--disable-renderer-backgrounding", "--disable-backgrounding-occluded-windows",
                        "--autoplay-policy=no-user-gesture-required", "--use-fake-ui-for-media-stream",
                        "--use-fake-device-for-media-stream", f"--use-file-for-fake-video-capture={camera}",
                        "--window-size=1100,760", f"--user-data-dir={tmp / 'chromium'}"):
                options.add_argument(arg)
            driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
            driver.set_script_timeout(30)
            driver.get(url)
            js = driver.execute_script
            _wait("the first timed frame", lambda: js("return window.loom.g2g.length") > 0, 300, proc)
            start = js("return performance.now()")
            latencies, shares = [], []
            until = time.monotonic() + args.seconds
            while time.monotonic() < until:
                time.sleep(1.0)
                state = js("return window.loom.state")
                if state and state["engine"].get("latency_ms"):
                    latencies.append(state["engine"]["latency_ms"])
                share = js("return window.loom.webAdds")
                if share is not None:
                    shares.append(share)
            pairs = js("return window.loom.pairs.filter((p) => p.at > arguments[0])"
                       ".map((p) => ({ms: p.ms, shown: p.shown_after_receive}))", start)
            rtc = driver.execute_async_script(STATS_JS)
            state = js("return window.loom.state")
        finally:
            if driver is not None:
                driver.quit()
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    g2g = [p["ms"] for p in pairs]
    shown = [p["shown"] for p in pairs if p.get("shown") is not None]
    out = rtc.get("outbound-rtp", {})
    inbound = [s for k, s in rtc.items() if k.startswith("inbound-rtp")]
    inb = max(inbound, key=lambda s: s.get("framesDecoded", 0)) if inbound else {}

    def per_frame(stats: dict, total: str, count: str) -> float:
        return 1000 * stats.get(total, 0) / stats[count] if stats.get(count) else float("nan")

    engine = float(np.median(latencies)) if latencies else float("nan")
    return {
        "passthrough": args.passthrough, "fps": args.fps, "size": side, "samples": len(g2g),
        "g2g_p50": _pct(g2g, 50), "g2g_p10": _pct(g2g, 10), "g2g_p90": _pct(g2g, 90),
        "engine_latency_p50": engine, "g2g_less_engine_p50": _pct(g2g, 50) - engine,
        "web_adds_per_frame_p50": _pct(shares, 50),
        "engine_fps": state["engine"].get("fps"), "host_path": state.get("host_path"),
        "browser_encode_ms": per_frame(out, "totalEncodeTime", "framesEncoded"),
        "browser_send_delay_ms": per_frame(out, "totalPacketSendDelay", "packetsSent"),
        "browser_jitter_buffer_ms": per_frame(inb, "jitterBufferDelay", "jitterBufferEmittedCount"),
        "browser_decode_ms": per_frame(inb, "totalDecodeTime", "framesDecoded"),
        "browser_receive_to_display_p50": _pct(shown, 50),
        "camera_fps_sent": out.get("framesPerSecond"), "output_fps_received": inb.get("framesPerSecond"),
        "load": os.getloadavg(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--passthrough", action="store_true", help="the pass-through engine (the web path alone)")
    ap.add_argument("--fps", type=int, default=15, help="the page camera's frame rate")
    ap.add_argument("--size", type=int, default=256, help="frame side in pixels")
    ap.add_argument("--seconds", type=float, default=40.0, help="how long to measure after the first timed frame")
    ap.add_argument("--set", action="append", default=[], help="a config override for the engine, as loom's --set")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        figures = run(args, Path(tmp))
    for key, value in figures.items():
        print(f"{key:32} {value if not isinstance(value, float) else round(value, 1)}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
