"""`loom play`: the Loom player (plugin.player) from the command line.

This module only parses arguments and checks the engine configuration (so a bad `--set` fails
here, with the config's own message, before an engine process is started). The player itself
lives in `plugin.player` and is imported inside `run`: nothing in `engine` imports `plugin` at
import time.
"""

from __future__ import annotations

import argparse
import sys

from engine.config import load_config, lora_override

EPILOG = """\
inputs:   a video file, a camera index (0, 1, ...), a stream URL (rtsp:// srt:// udp:// rtmp:// http://),
          or nothing for a built-in generated clip
outputs:  -o FILE.mp4|.mkv|.mov, -o udp://HOST:PORT or srt://HOST:PORT (MPEG-TS), -o rtmp://..., -o window
          (repeat -o for several); default: loom_out.mp4
keys in the window: q/Esc quit, space pause, Enter/t type a prompt, n/b next/previous prompt,
          1-4 steps, [ ] noise scale, m motion-aware noise, h overlay, f full screen
OSC (--osc-port): /loom/prompt s [i], /loom/prompt/next, /loom/prompt/prev, /loom/prompt/index i,
          /loom/steps i, /loom/noise_scale f, /loom/motion_aware [i], /loom/pause [i], /loom/quit
exit codes: 0 done, 2 bad input/output/option, 3 engine failed, 130 stopped with Ctrl-C
"""


def _size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not WIDTHxHEIGHT, e.g. 256x256") from None
    if w < 16 or h < 16 or w % 2 or h % 2:
        raise argparse.ArgumentTypeError(f"{text!r}: width and height must be even and at least 16")
    return w, h


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("play", help="restyle a video file, camera or stream live (the Loom player)",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-i", "--input", default=None, metavar="INPUT",
                   help="video file, camera index, or stream URL (default: a generated clip)")
    p.add_argument("-o", "--output", action="append", dest="outputs", metavar="OUTPUT",
                   help="file, udp:// srt:// rtmp:// URL, or 'window'; repeatable (default: loom_out.mp4)")
    p.add_argument("-c", "--config", default="default", help="preset name or YAML file (default: default)")
    p.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE",
                   help="override a config key, e.g. --set stream.steps=[700]")
    p.add_argument("--lora", action="append", default=[], dest="loras", metavar="PATH[:SCALE]",
                   help="a style LoRA file and its scale (default 1.0); repeat for several")
    p.add_argument("-p", "--prompt", action="append", default=[], dest="prompts", metavar="TEXT",
                   help="style prompt; repeat for a list to step through with n/b or OSC")
    p.add_argument("--prompts", dest="prompt_file", metavar="FILE", help="file with one prompt per line")
    p.add_argument("-n", "--frames", type=int, default=None, dest="max_frames", metavar="N",
                   help="stop after N frames (the generated clip has 49 by default)")
    p.add_argument("--size", type=_size, default=(256, 256), metavar="WxH",
                   help="generated clip size WxH (default 256x256)")
    p.add_argument("--fps", type=float, default=24.0, help="generated clip frame rate (default 24)")
    p.add_argument("--mode", choices=("auto", "lossless", "live"), default="auto",
                   help="lossless: every frame, in order (default for files); live: latest frame wins, "
                        "input at its own rate (default for cameras and streams)")
    p.add_argument("--loop", action="store_true", help="loop a file input (stop with q or Ctrl-C)")
    p.add_argument("--transport", choices=("shm", "tcp", "cuda-ipc"), default="shm",
                   help="frame transport to the engine (default shm)")
    p.add_argument("--endpoint", default=None, metavar="URL",
                   help="connect to a running engine instead of starting one")
    p.add_argument("--engine-python", default=None, metavar="PATH",
                   help="Python that runs the engine (default: this one)")
    p.add_argument("--passthrough", action="store_true",
                   help="engine returns its input unchanged (tests the plumbing without a model)")
    p.add_argument("--osc-port", type=int, default=None, metavar="PORT", help="listen for OSC control on this UDP port")
    p.add_argument("--osc-host", default="127.0.0.1", metavar="HOST", help="OSC listen address (default 127.0.0.1)")
    p.add_argument("--startup-timeout", type=float, default=300.0, metavar="S", help="seconds to wait for the engine")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress or status line")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    args.overrides = [*args.overrides, *lora_override(args.loras)]
    cfg = load_config(args.config, args.overrides)  # fails here, before an engine starts, on a bad key
    from plugin.player import PlayerOptions, read_prompt_file, run_player
    from plugin.player.options import PlayerError

    prompts = list(args.prompts)
    if args.prompt_file:
        try:
            prompts += read_prompt_file(args.prompt_file)
        except PlayerError as exc:
            print(f"loom play: error: {exc}", file=sys.stderr)
            return exc.exit_code
    options = PlayerOptions(
        input=args.input, outputs=args.outputs or ["loom_out.mp4"], config=args.config,
        overrides=list(args.overrides), prompts=prompts, default_prompt=cfg.prompt.text,
        steps=len(cfg.stream.steps), noise_scale=cfg.noise.noise_scale, motion_aware=cfg.noise.motion_aware,
        lora_scales={e.key: e.scale for e in cfg.lora},
        max_frames=args.max_frames, size=args.size, fps=args.fps, mode=args.mode, loop=args.loop,
        transport=args.transport, endpoint=args.endpoint, engine_python=args.engine_python,
        passthrough=args.passthrough, osc_port=args.osc_port, osc_host=args.osc_host,
        startup_timeout_s=args.startup_timeout, quiet=args.quiet)
    return run_player(options)
