"""`loom play`: the Loom player (plugin.player) from the command line.

This module only parses arguments and checks what needs no engine (the configuration, its weights,
the endpoint, the transport), so those fail here with exit code 2 before an engine process is started. The player itself
lives in `plugin.player` and is imported inside `run`: nothing in `engine` imports `plugin` at
import time.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loom_live.engine.config import load_config
from loom_live.engine.host_overrides import control_override, lora_override, served_overrides
from loom_live.host_bridge.wire.errors import UserError
from loom_live.host_bridge.wire.params import CONTROL, CONTROL_SOURCES, check_prompt_request
from loom_live.plugin.cli.common import add_config_options, add_overwrite_option
from loom_live.plugin.cli.preflight import check_engine_run

EPILOG_TEMPLATE = """\
inputs:   a video file, a camera index (0, 1, ...), a stream URL (rtsp:// srt:// udp:// rtmp:// http://),
          ndi://SOURCE NAME (--list-ndi lists them), or nothing for a built-in generated clip
outputs:  -o FILE.mp4|.mkv|.mov, -o udp://HOST:PORT or srt://HOST:PORT (MPEG-TS), -o rtmp://..., -o window,
          -o ndi://NAME, -o spout://NAME (Windows), -o syphon://NAME (macOS), -o virtualcam
          (repeat -o for several); default: loom_out.mp4
sizes:    --size WxH is the picture's size: the generated clip's (default 256x256), or the size a file,
          camera or stream is scaled to; the outputs are written at it. The model restyles at its own
          resolution, whatever the picture's size: frames are scaled to it and back. Set it with
          --resolution WxH, the same as --set resolution.width=W --set resolution.height=H (multiples
          of 16; the config's resolution.resize, crop, fit or stretch, says how another aspect ratio is fitted)
{keys}
{osc}
web page (--web [HOST:]PORT): the output, the input and these controls in a browser; loom web: the browser's
          camera as the input
outputs are written beside the target under a hidden temporary name and moved into place when finished:
          a failed run leaves an existing file as it was; an existing file is refused without -y/--overwrite,
          and without it one saved there during the run is kept: the run's file goes beside it (NAME.loom-1.mp4)
exit codes: 0 done, 2 bad input/output/option/config or missing weights, 3 engine failed, 130 stopped with Ctrl-C,
          143/129 stopped by SIGTERM/SIGHUP
"""


def epilog() -> str:
    """The help's last part; its keys and OSC addresses from the player's own tables, so none is left out."""
    from loom_live.plugin.player.controls import KEY_HELP
    from loom_live.plugin.player.osc import OSC_ADDRESSES

    osc = [(f"{address} {args}".strip(), what) for address, (args, what) in OSC_ADDRESSES.items()]
    return EPILOG_TEMPLATE.format(keys=_table("keys in the window:", KEY_HELP),
                                  osc=_table("OSC (--osc-port):", osc))


def _table(title: str, rows: Sequence[tuple[str, str]]) -> str:
    width = max(len(name) for name, _ in rows)
    return "\n".join([title, *(f"          {name:<{width}}  {what}" for name, what in rows)])


def _wxh(text: str) -> tuple[int, int]:
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not WIDTHxHEIGHT, e.g. 256x256") from None
    return w, h


def _size(text: str) -> tuple[int, int]:
    w, h = _wxh(text)
    if w < 16 or h < 16 or w % 2 or h % 2:
        raise argparse.ArgumentTypeError(f"{text!r}: width and height must be even and at least 16")
    return w, h


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("play", help="restyle a video file, camera or stream live (the Loom player)",
                       epilog=epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-i", "--input", default=None, metavar="INPUT",
                   help="video file, camera index, stream URL or ndi://SOURCE (default: a generated clip)")
    p.add_argument("-o", "--output", action="append", dest="outputs", metavar="OUTPUT",
                   help="file, udp:// srt:// rtmp:// ndi:// spout:// syphon:// URL, 'virtualcam' or 'window'; "
                        "repeatable (default: loom_out.mp4)")
    p.add_argument("--list-ndi", action="store_true",
                   help="list the NDI sources on the network (for -i ndi://NAME) and exit")
    add_config_options(p)
    add_overwrite_option(p)
    p.add_argument("-n", "--frames", type=int, default=None, dest="max_frames", metavar="N",
                   help="stop after N frames (the generated clip has 49 by default)")
    p.add_argument("--size", type=_size, default=None, metavar="WxH",
                   help="picture size: the generated clip's (default 256x256), or the size an input is scaled to "
                        "(outputs are written at it)")
    p.add_argument("--fps", type=float, default=None,
                   help="generated clip frame rate (default 24); an input keeps its own rate")
    p.add_argument("--mode", choices=("auto", "lossless", "live"), default="auto",
                   help="lossless: every frame, in order (default for files); live: latest frame wins, "
                        "input at its own rate (default for cameras and streams)")
    p.add_argument("--loop", action="store_true", help="loop a file input (stop with q or Ctrl-C)")
    add_run_options(p)
    p.add_argument("--web", default=None, metavar="[HOST:]PORT",
                   help="serve a web page with the output, the input and the controls on this address "
                        "(default host 127.0.0.1; another needs HTTPS or --web-proxy, and gets a token)")
    add_web_options(p)
    p.set_defaults(func=run)


def add_run_options(p: argparse.ArgumentParser) -> None:
    """Prompts, LoRAs, the engine to use and live control: the same on `loom play` and `loom web`."""
    from loom_live.plugin.player.options import DEFAULT_STARTUP_TIMEOUT_S

    p.add_argument("--lora", action="append", default=[], dest="loras", metavar="PATH[:SCALE]",
                   help="a style LoRA file and its scale (default 1.0); repeat for several")
    p.add_argument("-p", "--prompt", action="append", default=[], dest="prompts", metavar="TEXT",
                   help="style prompt; repeat for a list to step through with n/b or OSC")
    p.add_argument("--prompts", dest="prompt_file", metavar="FILE", help="file with one prompt per line")
    p.add_argument("--resolution", type=_wxh, default=None, metavar="WxH",
                   help="the model's resolution, frames are scaled to it and back (the same as --set "
                        "resolution.width=W --set resolution.height=H; default: the config's)")
    p.add_argument("--control", metavar="edges|grey|flow|depth|FILE",
                   help="VACE presets: the control video, made from the input or read from a video FILE (the "
                        "default preset takes edges only: its input's edges, scaled by control.context_scale)")
    p.add_argument("--control-input", metavar="SOURCE",
                   help="VACE presets: a second input as the control video, frame-locked with the input (a camera "
                        "index, a file, a stream URL or 'generated'); scaled to the output size")
    p.add_argument("--reference", metavar="IMAGE", help="VACE presets: a reference image that sets the look")
    p.add_argument("--transport", choices=("shm", "tcp", "cuda-ipc"), default="shm",
                   help="frame transport to the engine (default shm)")
    p.add_argument("--endpoint", default=None, metavar="URL",
                   help="connect to a running engine on this machine (loom serve --bind) instead of starting one")
    p.add_argument("--secret-file", default=None, metavar="FILE",
                   help="with --endpoint: the served engine's session secret (its loom serve --secret-file)")
    p.add_argument("--engine-python", default=None, metavar="PATH",
                   help="Python that runs the engine (default: this one)")
    p.add_argument("--passthrough", action="store_true",
                   help="engine returns its input unchanged (tests the plumbing without a model)")
    p.add_argument("--standby", action="store_true",
                   help="keep a second engine loaded that takes over at once if the one in use stops (a crash, a "
                        "hang): the show goes on within a second instead of a restart's wait; costs a second "
                        "engine's memory")
    p.add_argument("--hold-cpu-awake", action="store_true",
                   help="Linux: keep the CPUs out of deep idle states while the show runs (/dev/cpu_dma_latency; "
                        "root, or a udev rule that lets you write it), so frames handed over at the show's pace do "
                        "not wait for sleeping cores; costs power. Said when it cannot be held")
    p.add_argument("--osc-port", type=int, default=None, metavar="PORT", help="listen for OSC control on this UDP port")
    p.add_argument("--osc-host", default="127.0.0.1", metavar="HOST", help="OSC listen address (default 127.0.0.1)")
    p.add_argument("--startup-timeout", type=float, default=DEFAULT_STARTUP_TIMEOUT_S, metavar="S",
                   help=f"seconds to wait for the engine to be ready (default {DEFAULT_STARTUP_TIMEOUT_S:g})")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="print only the last line (frames, outputs, time), a note that a file input ended short "
                        "of its header's frame count, and errors: no start-up stages, progress bar, status line "
                        "or other notes")


def add_web_options(p: argparse.ArgumentParser) -> None:
    """Who may open the web page (plugin/web/access.py)."""
    p.add_argument("--web-token-file", default=None, metavar="FILE",
                   help="the page's token, in a file of mode 600 (created with a random one if missing); "
                        "with it a token is asked on any address (default: printed at start, off-loopback only)")
    p.add_argument("--web-cert", default=None, metavar="FILE", help="serve the page over HTTPS with this certificate")
    p.add_argument("--web-key", default=None, metavar="FILE", help="the certificate's private key")
    p.add_argument("--web-proxy", action="store_true",
                   help="your own HTTPS proxy fronts the page (off-loopback without --web-cert)")
    p.add_argument("--ice-server", action="append", default=[], metavar="URL", dest="ice_servers",
                   help="a STUN or TURN server for the page's video, for both ends (repeatable): stun:HOST[:PORT], "
                        "turn:HOST[:PORT][?transport=udp|tcp], turns:HOST[:PORT]")
    p.add_argument("--ice-username", default=None, metavar="NAME", help="the TURN server's username")
    p.add_argument("--ice-credential-file", default=None, metavar="FILE",
                   help="the TURN server's credential, in a file of mode 600 (or the LOOM_ICE_CREDENTIAL variable)")


def run(args: argparse.Namespace) -> int:
    from loom_live.plugin.player.options import DEFAULT_GENERATED_FPS, GENERATED_INPUT

    if args.list_ndi:
        return _list_ndi()
    if args.fps is not None and args.input not in (None, GENERATED_INPUT):  # it was dropped without a word
        raise UserError(f"--fps sets the generated clip's frame rate; input {args.input} plays and is written at "
                        "its own rate: leave out --fps (or -i, for the generated clip)")
    args.fps = DEFAULT_GENERATED_FPS if args.fps is None else args.fps
    return run_options(args, input=args.input, outputs=args.outputs or ["loom_out.mp4"], max_frames=args.max_frames,
                       mode=args.mode, loop=args.loop, web=args.web)


def run_options(args: argparse.Namespace, **run: object) -> int:
    """Check the config and engine, then run the player with `run` (input, outputs, ...) and the shared options."""
    if args.control and args.control_input:
        raise UserError("--control and --control-input both name the control video: give one (--control-input "
                        "is a second live input; --control edges|grey|flow|depth makes it from the input, "
                        "--control FILE has the engine read a file)")
    sent = ["control.control_source=video"] if args.control_input else []  # the frames the player sends
    control = [*control_override(args.control, args.reference), *sent]
    if args.endpoint and any(o.startswith("control.video=") for o in control):
        raise UserError(f"--control {args.control}: a served engine (--endpoint) reads only the control video its own "
                        "config names; send this file as the control video with --control-input FILE")
    # a served engine runs its own config, not -c's: the control options are checked against what it says it takes
    # once it is ready (the player), not against -c's here
    args.overrides = [*args.overrides, *lora_override(args.loras), *([] if args.endpoint else control)]
    given: dict[str, Any] = {}
    if args.endpoint and args.resolution is not None:
        raise UserError(f"--resolution {args.resolution[0]}x{args.resolution[1]}: a served engine (--endpoint) "
                        "restyles at its own config's resolution; set it where it is served (loom serve --set "
                        "resolution.width=W --set resolution.height=H), or leave out --endpoint")
    if args.endpoint:  # what it is told, whatever -c's model: -c keeps only what the player itself reads
        args.overrides, given = served_overrides(args.overrides)
    elif args.resolution is not None:  # checked with the config: multiples of 16, in range
        args.overrides += [f"resolution.width={args.resolution[0]}", f"resolution.height={args.resolution[1]}"]
    cfg = load_config(args.config, args.overrides)  # fails here, before an engine starts, on a bad key
    if (args.control or args.control_input or args.reference) and not args.endpoint and not cfg.structure_control:
        raise UserError(f"--control, --control-input and --reference steer a VACE model (--control edges the "
                        f"default one too); preset {cfg.model.preset!r} has no control blocks and reads no edges: "
                        "use -c wan2.1-vace-1.3b (or tiny-vace to try it on a CPU)")
    _check_files_given(args)
    if args.standby and args.endpoint:
        raise UserError("--standby keeps a second engine this command starts; a served engine (--endpoint) is not "
                        "started here: leave out one of them")
    check_engine_run(cfg, passthrough=args.passthrough, endpoint=args.endpoint, secret_file=args.secret_file,
                     transport=args.transport)
    from loom_live.plugin.player import PlayerOptions, read_prompt_file, run_player
    from loom_live.plugin.player.options import PlayerError

    prompts = list(args.prompts)
    if args.prompt_file:
        try:
            prompts += read_prompt_file(args.prompt_file)
        except PlayerError as exc:
            print(f"loom {args.command}: error: {exc}", file=sys.stderr)
            return exc.exit_code
    if args.endpoint and not prompts and args.overrides:  # --set prompt.text, which a served engine never reads
        prompts = [cfg.prompt.text]
    if args.endpoint and (args.control or args.control_input):
        given[CONTROL.name] = "video" if args.control_input else args.control
    # before an engine starts (it was refused once one ran), in its family's words; a served engine (--endpoint)
    # runs its own config, not -c's, and says its family only once reached: what each family takes is said
    family = None if args.endpoint else cfg.model.family
    for text in prompts:
        check_prompt_request(text, family=family)
    options = PlayerOptions(
        config=args.config,
        overrides=list(args.overrides), prompts=prompts, default_prompt=cfg.prompt.text, family=cfg.model.family,
        takes=tuple(p.name for p in cfg.live_params),
        steps=len(cfg.stream.steps), noise_scale=cfg.noise.noise_scale, motion_aware=cfg.noise.motion_aware,
        lora_scales={e.key: e.scale for e in cfg.lora}, given_params=given,
        control_sources=cfg.control_sources, takes_reference=cfg.vace, control_source=cfg.control.control_source,
        context_scale=cfg.control.context_scale, adapter_strength=cfg.edit.adapter_strength,
        control_input=args.control_input, control=args.control,
        # what r reads again: --reference, or the config file's own (a served engine is sent --reference once ready)
        reference=args.reference if args.endpoint else cfg.control.reference,
        size=args.size, fps=args.fps, transport=args.transport, endpoint=args.endpoint, secret_file=args.secret_file,
        engine_python=args.engine_python,
        passthrough=args.passthrough, standby=args.standby, hold_cpu_awake=args.hold_cpu_awake,
        osc_port=args.osc_port, osc_host=args.osc_host,
        startup_timeout_s=args.startup_timeout, quiet=args.quiet, overwrite=args.overwrite,
        web_token_file=args.web_token_file, web_cert=args.web_cert, web_key=args.web_key, web_proxy=args.web_proxy,
        ice_servers=list(args.ice_servers), ice_username=args.ice_username,
        ice_credential_file=args.ice_credential_file,
        **run)
    return run_player(options)


def _check_files_given(args: argparse.Namespace) -> None:
    """--control FILE and --reference IMAGE, which the engine reads only once started: one that is not there is
    said now and as such (the engine could only say that it cannot be opened)."""
    made = [s for s in CONTROL_SOURCES if s != "video"]  # what --control makes from the input, not a file
    if args.control and args.control not in made and not Path(args.control).expanduser().exists():
        raise UserError(f"--control {args.control}: no such file; expected {', '.join(made)} or a video file")
    if args.reference and not Path(args.reference).expanduser().exists():
        raise UserError(f"--reference {args.reference}: no such file; expected an image file (PNG, JPEG, ...)")


def _list_ndi() -> int:
    """Print the NDI sources seen within a few seconds, one a line; exit code 2 when NDI is missing."""
    from loom_live.plugin.media.base import MediaError
    from loom_live.plugin.media.ndi import list_sources

    try:
        names = list_sources()
    except MediaError as exc:
        print(f"loom play: error: {exc}", file=sys.stderr)
        return 2
    for name in names:
        print(name)
    if not names:
        print("loom play: no NDI source found (NDI finds sources by mDNS; see the README's VJ set-up for "
              "other networks)", file=sys.stderr)
    return 0
