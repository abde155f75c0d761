"""Opening one link to an engine: sockets, and the engine process when the bridge launches it.

Launching, the bridge binds the control endpoint (a private endpoint unless the config names one)
and starts the engine with a fresh token in its environment; connecting to a served engine, it
connects the control channel. Frame notices: on shm and cuda-ipc the bridge creates the link's
doorbell segment here (its hello names it); on tcp a launching bridge binds the frame lane next to
the control endpoint, and a connecting one learns the lane from the engine's hello. Whatever was
opened is closed again when a later step fails, so a failed attempt leaves no socket, endpoint
file, segment or process behind; the caller gets a `LinkOpenError` saying what failed.
"""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Iterator

import zmq

from loom_live.host_bridge.config import BridgeConfig
from loom_live.host_bridge.launcher import TOKEN_ENV, EngineProcess, engine_argv, engine_env
from loom_live.host_bridge.link import Link
from loom_live.host_bridge.wire.channel import Channel, CurveClient, PrivateEndpoint, SharedSecret, read_secret_file
from loom_live.host_bridge.wire.doorbell import TRANSPORTS as DOORBELL_TRANSPORTS
from loom_live.host_bridge.wire.doorbell import Doorbell
from loom_live.host_bridge.wire.frame_lane import FrameLane, lane_bind_address

TOKEN_BYTES = 16


class LinkOpenError(Exception):
    """The link could not be opened; the message says what failed."""


def open_link(ctx: zmq.Context, cfg: BridgeConfig, link_ids: Iterator[int], lock: threading.RLock,
              warmup_share: float = 1.0) -> Link:
    """A new `Link` (taking its id from `link_ids` only once it exists); the engine launched if `cfg.launch`,
    its warm-up taking at most `warmup_share` of the time (a standby beside a show)."""
    token = secrets.token_hex(TOKEN_BYTES)
    endpoint = PrivateEndpoint() if cfg.launch and cfg.endpoint is None else None
    curve: CurveClient | SharedSecret | None = (CurveClient(cfg.curve_secret_file, cfg.curve_server_public_file)
                                                 if cfg.curve_secret_file and cfg.curve_server_public_file else None)
    channel = lane = None
    try:
        if cfg.secret_file:
            curve = SharedSecret(read_secret_file(cfg.secret_file), server=False)
        if cfg.launch:
            address = endpoint.address if endpoint else cfg.endpoint
            # ipc lives in a private directory; tcp on 127.0.0.1 is open to every local process: the
            # engine must show the launch token before it is even connected
            guard = SharedSecret(token, server=True) if address is None or address.startswith("tcp://") else None
            channel = Channel(ctx, address, bind=True, curve=guard)
        else:
            channel = Channel(ctx, cfg.endpoint, bind=False, curve=curve)
        if cfg.transport in DOORBELL_TRANSPORTS:
            lane = Doorbell.create()
        elif cfg.launch:  # we bound the control endpoint: the frame lane goes next to it
            lane_address = endpoint.lane_address if endpoint and endpoint.lane_address else \
                lane_bind_address(channel.endpoint)
            lane = FrameLane(ctx, lane_address, bind=True, side="host", curve=guard)
    except Exception as exc:
        for opened in (channel, lane):
            if opened is not None:
                opened.close()
        if endpoint:
            endpoint.remove()
        raise LinkOpenError(f"cannot open the link's endpoints: {exc}") from exc
    proc = None
    if cfg.launch:
        try:
            proc = EngineProcess(engine_argv(cfg.engine_python, *_engine_args(cfg, channel.endpoint, warmup_share)),
                                 cwd=cfg.engine_cwd, env={TOKEN_ENV: token, **engine_env()})
        except OSError as exc:
            channel.close()
            if lane is not None:
                lane.close()
            if endpoint:
                endpoint.remove()
            if cfg.engine_cwd and exc.filename is not None and str(exc.filename) == str(cfg.engine_cwd):
                why = f": engine_cwd {cfg.engine_cwd!r}: {exc.strerror}"  # the folder, not the Python
            else:
                detail = f"{exc.strerror}: {exc.filename}" if exc.strerror and exc.filename else str(exc)
                why = f" with {cfg.engine_python or 'this Python'}: {detail}"
            raise LinkOpenError(f"cannot start the engine{why}") from exc
    return Link(next(link_ids), channel, lane, proc, endpoint, token if cfg.launch else None, cfg, lock,
                curve=curve)


def _engine_args(cfg: BridgeConfig, control_endpoint: str, warmup_share: float = 1.0) -> list[str]:
    """The launched engine's command line: where to connect, its config, and the host's extras."""
    args = ["--connect", control_endpoint, "--config", cfg.engine_config,
            "--heartbeat", str(cfg.heartbeat_s), "--parent-pid", str(os.getpid())]
    for o in cfg.engine_overrides:
        args += ["--set", o]
    if cfg.passthrough:
        args.append("--passthrough")
    if cfg.engine_warmup:
        args.append("--warmup")
    if warmup_share < 1.0:  # an engine on a GPU warms up with or without --warmup
        args += ["--warmup-share", f"{warmup_share:g}"]
    return args + list(cfg.engine_args)
