"""`loom serve` / `python -m loom_live.engine serve`: run an engine behind the bridge protocol.

The launcher starts engines with `python -m loom_live.engine serve`, which needs only this module: the
engine process never imports the host adapters.
"""

from __future__ import annotations

import argparse
import os
import sys

from loom_live.host_bridge.launcher import TOKEN_ENV
from loom_live.host_bridge.wire import logs
from loom_live.host_bridge.wire.errors import EXIT_USER_ERROR, SERVE_ERROR_PREFIX, OneLineParser, UserError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the engine for a host (TouchDesigner, ComfyUI, player) over the bridge")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--connect", metavar="ENDPOINT", help="connect to the host that launched this engine")
    where.add_argument("--bind", metavar="ENDPOINT", help="serve hosts at this endpoint (tcp://0.0.0.0:5555 ...)")
    # The same -c/--set as every `loom` command that runs a model (plugin.cli.common, which engine cannot import).
    p.add_argument("-c", "--config", default="default", metavar="PRESET_OR_YAML",
                   help="preset name (see `loom info --presets`) or YAML file (default: default, the embedded "
                        "model that runs anywhere)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set stream.steps=[700]; repeatable")
    p.add_argument("--lora", action="append", default=[], dest="loras", metavar="PATH[:SCALE]",
                   help="a style LoRA file and its scale (default 1.0); repeat for several")
    p.add_argument("--passthrough", action="store_true", help="return input frames unchanged (no model)")
    p.add_argument("--gpus", type=int, default=None, metavar="N",
                   help="split the DiT over N GPUs (sets parallel.gpus; on a CPU device: N processes)")
    p.add_argument("--warmup", action="store_true",
                   help="run synthetic streams through the session (compile, capture graphs) before saying ready")
    p.add_argument("--warmup-share", type=float, default=1.0, metavar="SHARE",
                   help="the share of the time the warm-up (on a GPU, or with --warmup) may take the GPU, above 0 "
                        "up to 1 (a standby launched beside a show: it rests between chunks; default 1)")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    p.add_argument("--heartbeat", type=float, default=0.2, help="heartbeat interval in seconds")
    p.add_argument("--host-timeout", type=float, default=5.0, help="host silence after which the engine gives up")
    p.add_argument("--handshake-timeout", type=float, default=20.0, help="wait this long for the host's hello")
    p.add_argument("--curve-secret-file", help="this engine's CurveZMQ certificate (zmq.auth format)")
    p.add_argument("--curve-authorized", metavar="DIR", help="directory of authorised host public keys")
    p.add_argument("--secret-file", metavar="FILE",
                   help="--bind on a loopback or ipc endpoint without CurveZMQ: the session secret hosts must hold "
                        "(a file of mode 600, created with a random secret if missing; hosts name it as secret_file)")
    p.add_argument("--stall-after", type=int, default=None, help=argparse.SUPPRESS)  # tests: stall after N frames
    logs.add_option(p, default=argparse.SUPPRESS)  # else the global option of `loom` / `python -m loom_live.engine`
    p.set_defaults(func=run)


def _session_factory(args: argparse.Namespace):
    """The session's builder, and what the session starts on (its config's prompt and live parameters,
    `LoomConfig.start_settings`) for the ready message; the pass-through session names its config's too."""
    from loom_live.engine.config import load_config
    from loom_live.engine.host_overrides import lora_override

    if not 0.0 < args.warmup_share <= 1.0:
        raise UserError(f"--warmup-share {args.warmup_share:g}: allowed above 0 up to 1")
    overrides = [*args.overrides, *lora_override(args.loras)]
    if args.gpus is not None:
        overrides.append(f"parallel.gpus={args.gpus}")
    config = load_config(args.config, overrides)  # validate now: a bad key fails before serving
    if not args.passthrough:  # and weights, before a host waits for a model load that must fail
        from loom_live.engine.models.loading import check_weight_files
        from loom_live.engine.models.weights import missing_weights, pull_name

        check_weight_files(config)  # the files given first: a mistyped path is said as such (a ValueError)
        missing = missing_weights(config)
        if missing:
            raise UserError(f"preset {pull_name(config)!r} needs weights that are not here: {'; '.join(missing)}. "
                            f"Run `loom pull {pull_name(config)}`, or give the paths with --set KEY=PATH")
        from loom_live.engine.session_api import check_devices

        check_devices(config)  # and GPUs that are not here, a pipeline split its blocks do not allow

    def build():
        if args.passthrough:
            from loom_live.engine.server.passthrough import PassthroughSession
            return PassthroughSession()
        try:
            from loom_live.engine.models.loading import resolve_device
            from loom_live.engine.session_api import open_session
            from loom_live.engine.stream.cpu_threads import apply_cpu_threads
        except ImportError as exc:
            raise RuntimeError(f"the engine's sessions are not available ({exc}); use --passthrough") from exc
        apply_cpu_threads(config.model.cpu_threads, resolve_device(config.model.device))  # the host keeps a core
        # --warmup: warm once, on any device (else on a GPU only)
        session = open_session(config, warmup=not args.warmup, warmup_share=args.warmup_share)
        if args.warmup:
            session.warmup(share=args.warmup_share)
        return session

    return build, config.start_settings()


def _session_secret(args: argparse.Namespace):
    """A served engine without Curve keys takes only hosts that hold its session secret: any local
    process could otherwise reach a loopback endpoint and drive it."""
    from loom_live.host_bridge.wire.channel import SharedSecret, is_loopback, read_secret_file

    if args.secret_file and not args.bind:
        raise UserError("--secret-file is for --bind (a launched engine gets its token from the host)")
    if not args.bind or not is_loopback(args.bind):
        return None  # a remote endpoint needs Curve keys: the channel says so
    if not args.secret_file:
        raise UserError(f"--bind {args.bind}: without CurveZMQ keys a served engine needs --secret-file FILE "
                        "(mode 600, created if missing); hosts give the same file as secret_file")
    return SharedSecret(read_secret_file(args.secret_file, create=True), server=True)


def run(args: argparse.Namespace) -> int:
    from loom_live.engine.server.core import EngineServer
    from loom_live.host_bridge.wire.channel import CurveServer, EndpointError

    if bool(args.curve_secret_file) != bool(args.curve_authorized):
        raise UserError("--curve-secret-file and --curve-authorized go together")
    curve = CurveServer(args.curve_secret_file, args.curve_authorized) if args.curve_secret_file else None
    factory, start = _session_factory(args)  # a bad config is named before anything about endpoints
    try:
        curve = curve or _session_secret(args)
        server = EngineServer(factory, connect=args.connect, bind=args.bind,
                              token=os.environ.get(TOKEN_ENV, ""), parent_pid=args.parent_pid,
                              heartbeat_s=args.heartbeat, host_timeout_s=args.host_timeout,
                              handshake_timeout_s=args.handshake_timeout, curve=curve, stall_after=args.stall_after,
                              start=start)
        code = server.run()
    except EndpointError as exc:
        raise UserError(str(exc)) from exc
    if server.refusal:  # the session could not be built from its inputs: a refusal, not a crash
        raise UserError(server.refusal)
    return code


def main(argv: list[str] | None = None) -> int:
    """`python -m loom_live.engine serve ...`: the same parser and exit codes as `loom serve`."""
    from loom_live.host_bridge.wire.typed_config import ConfigError

    parser = OneLineParser(prog="python -m loom_live.engine")
    logs.add_option(parser)
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    logs.configure(args.log_level)
    try:
        return int(args.func(args) or 0)
    except (ConfigError, UserError, FileNotFoundError, ValueError) as exc:
        print(f"{SERVE_ERROR_PREFIX}{exc}", file=sys.stderr)
        return EXIT_USER_ERROR
