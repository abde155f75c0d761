"""A host's frame loop through the bridge: what the TouchDesigner operator and the player do.

The bridge starts the engine in its own process (here the embedded default over shared memory)
and never blocks the loop: `submit()` hands a frame over (latest wins; a busy engine drops
frames and counts them), `latest()` returns the newest restyled frame, or the fallback (the
input) with a status while the engine starts, restarts or is gone. A prompt change and a
parameter change go over the control channel while frames flow; the parameter is one the engine's
model family takes, as the engine refuses another family's.

    python examples/host_frame_loop.py [--seconds 5] [--fps 30] [--transport shm|cuda-ipc]
                                       [--config default|edit-tiny|...|FILE.yaml]
"""

from __future__ import annotations

import argparse
import sys
import time

from loom_live.host_bridge import Bridge, BridgeConfig
from loom_live.plugin.media.generated_clip import generate_clip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0, help="how long to stream")
    ap.add_argument("--fps", type=float, default=30.0, help="the host's frame rate")
    ap.add_argument("--transport", default="shm", choices=("shm", "cuda-ipc"))
    ap.add_argument("--config", default="default", help="engine preset or YAML file")
    args = ap.parse_args(argv)

    clip = list(generate_clip(n_frames=48, size=(128, 128), fps=args.fps))
    period = 1.0 / args.fps
    shown = fallback = 0
    with Bridge(BridgeConfig(transport=args.transport, engine_config=args.config)) as bridge:
        bridge.wait_running(120)  # optional: the loop below would show the fallback until then
        start = next_frame = time.monotonic()
        i = 0
        while time.monotonic() - start < args.seconds:
            bridge.submit(clip[i % len(clip)])
            frame, status = bridge.latest()  # never waits for the engine
            shown += frame is not None and not status.fallback
            fallback += status.fallback
            if i == int(args.fps):  # after a second: a new prompt, blended in over a few chunks
                bridge.set_prompt("ink wash painting")
                # a parameter the engine's model family takes (`engine_family`, once it is ready): the
                # edit model's adapter strength, else the Wan models' noise strength
                edit = bridge.engine_family == "edit"
                bridge.set_params(**({"adapter_strength": 0.8} if edit else {"noise_scale": 0.7}))
            i += 1
            next_frame += period
            time.sleep(max(0.0, next_frame - time.monotonic()))
        stats = bridge.stats()
    print(f"{i} frames submitted, {shown} restyled frames shown, {fallback} fallbacks; engine "
          f"{stats['fps']:.1f} fps, latency p50 {stats['latency_ms_p50']:.0f} ms, dropped {stats['dropped']}, "
          f"restarts {stats['restarts']}, errors {stats['errors']}")
    if stats["last_error"]:
        print(f"last error: {stats['last_error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
