"""Restyle a video file with the engine in this process (no bridge, no second process).

The in-process API for scripts and notebooks: `open_session(cfg)` opens the session the config
names (`StreamSession` for the Wan family and the embedded default, `EditSession` for the edit
presets, `PipelineSession` with `parallel.gpus` > 1). Its `push()` takes frames as they come
and returns the restyled frames that are finished, in order; on a GPU the newest chunk may still
be running when a push returns (so the next chunk's encode overlaps it), and `poll()` picks its
frames up without new input; `flush()` ends the stream and returns the rest.

    python examples/restyle_in_process.py INPUT.mp4 OUTPUT.mp4 [--config wan2.1-1.3b --set ...]

With no --config it uses the embedded default (a tiny model: it shows the mechanics, not the art).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from loom_live.engine.config import load_config
from loom_live.engine.session_api import open_session
from loom_live.plugin.media.sinks import FrameSink, open_sink
from loom_live.plugin.media.sources import open_source

PUSH_FRAMES = 4  # one latent frame's worth, the Wan session's steady chunk (a push takes any count)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("input", help="video file, camera index or stream URL")
    ap.add_argument("output", help=".mp4/.mkv/.mov file")
    ap.add_argument("--config", default=None, help="preset name or YAML file (default: the embedded default)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--prompt", default=None, help="text prompt (the config's prompt otherwise)")
    args = ap.parse_args(argv)

    session = open_session(load_config(args.config, args.overrides))
    if args.prompt:
        session.set_prompt(args.prompt)
    written, start = 0, time.perf_counter()
    with open_source(args.input) as source:
        sink = open_sink(args.output, source.fps, (source.width - source.width % 2, source.height - source.height % 2))
        try:
            batch: list[np.ndarray] = []
            for frame in source:
                batch.append(frame)
                if len(batch) == PUSH_FRAMES:
                    written += _write(sink, session.push(np.stack(batch)))
                    batch = []
            if batch:
                written += _write(sink, session.push(np.stack(batch)))
            written += _write(sink, session.flush())
            stats = session.stats()
        finally:
            sink.close()
            session.close()
    p50 = stats["latency_ms"].get("p50")
    print(f"{written} frames to {args.output} by {type(session).__name__} in {time.perf_counter() - start:.1f} s; "
          f"dropped {stats['dropped']}"
          + (f", latency p50 {p50:.0f} ms" if p50 is not None else ""))
    return 0


def _write(sink: FrameSink, frames: np.ndarray) -> int:
    for f in frames:
        sink.write(np.ascontiguousarray(f[: sink.size[1], : sink.size[0]]))
    return len(frames)


if __name__ == "__main__":
    sys.exit(main())
