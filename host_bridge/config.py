"""The bridge's settings (host side), validated by the same strict rules as the engine's YAML.

`BridgeConfig(...)` validates on construction too, so a host script that passes a bad value gets
the same message (key, value, what is allowed) as a YAML file would.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import Any

from loom_live.host_bridge.wire.protocol import ENCODINGS, MAX_FRAME_SIDE, MAX_SLOTS, TRANSPORTS
from loom_live.host_bridge.wire.typed_config import ConfigError, build, spec

FALLBACKS = ("passthrough", "last")
MAX_HANG_TIMEOUT_S = 2.0  # the promise: a dead or hung engine is noticed within 2 s
_building = threading.local()


@dataclass
class BridgeConfig:
    """How the host reaches (and optionally launches) the engine."""

    transport: str = spec("shm", choices=TRANSPORTS, doc="frame transport: shared memory, CUDA IPC or ZMQ over tcp")
    launch: bool = spec(True, doc="start the engine process here; false = connect to a running engine at endpoint")
    engine_python: str | None = spec(None, doc="interpreter with torch and Loom installed; none = this one")
    engine_config: str = spec("default", min_len=1, doc="engine preset name or YAML path")
    engine_overrides: list[str] = spec(default_factory=list, doc="engine `--set key=value` overrides")
    engine_args: list[str] = spec(default_factory=list, doc="more `loom serve` arguments")
    engine_cwd: str | None = spec(None, doc="working directory of the launched engine")
    passthrough: bool = spec(False, doc="engine returns its input unchanged (tests, latency checks)")
    endpoint: str | None = spec(None, doc="engine control endpoint (tcp://HOST:PORT or ipc://PATH); none = private")
    fallback: str = spec("passthrough", choices=FALLBACKS, doc="shown while the engine is not delivering")
    ring_slots: int = spec(3, min=2, max=MAX_SLOTS, doc="frame slots per direction")
    max_frame_side: int = spec(4096, min=16, max=MAX_FRAME_SIDE,
                               doc="longest frame side handed to the engine: larger host frames are shrunk by a "
                                   "whole factor first (outputs come back at that size); larger device frames "
                                   "(submit_cuda) are refused")
    handshake_timeout_s: float = spec(20.0, min=0.5, max=600.0, doc="engine start to its hello")
    load_timeout_s: float = spec(900.0, min=1.0, max=7200.0, doc="hello to ready (model loading)")
    heartbeat_s: float = spec(0.2, min=0.01, max=1.0, doc="heartbeat interval, both ways")
    hang_timeout_s: float = spec(1.5, min=0.05, max=MAX_HANG_TIMEOUT_S, doc="silence that counts as a hang")
    loading_hang_timeout_s: float = spec(30.0, min=0.05, max=600.0,
                                         doc="the same while the engine loads: reading a checkpoint and compiling "
                                             "can hold Python's GIL, and so its heartbeats, for seconds")
    restart: bool = spec(True, doc="restart (or reconnect) after a crash or hang")
    standby: bool = spec(False, doc="keep a second launched engine loaded (and warmed) to take over at once when "
                                    "the one in use dies or hangs; costs a second engine's memory (launch only)")
    standby_start: str = spec("together", choices=("together", "after"),
                              doc="with standby: launch the first standby together with the engine in use (both "
                                  "ready sooner, the first frame a few seconds later: the two load side by side, "
                                  "so the GPU must hold both loads at once) or after that one serves (a standby "
                                  "that finds no room then fails alone and is retried)")
    engine_warmup: bool = spec(False, doc="launched engines warm up (compile, capture graphs) before they say "
                                          "ready, so the first frames do not stall")
    standby_warmup_share: float = spec(0.3, min=0.05, max=1.0,
                                       doc="with standby: the share of the time a standby launched while an engine "
                                           "serves may take the GPU for its warm-up (it rests "
                                           "between chunks, so the show keeps its frame rate; the standby is ready "
                                           "later); 1: no rests")
    hold_cpu_awake: bool = spec(False, doc="while started, keep the machine's CPUs out of deep idle states (Linux: "
                                           "/dev/cpu_dma_latency, writable by root or a udev rule), so frames "
                                           "handed over at the host's pace do not wait for sleeping cores; idle "
                                           "cores then poll, costing power. Where it cannot be held it runs on, "
                                           "and stats()['cpu_awake'] says why")
    restart_backoff_s: float = spec(0.5, min=0.0, max=60.0, doc="first restart delay; doubles per failure")
    restart_backoff_max_s: float = spec(10.0, min=0.0, max=600.0)
    stop_timeout_s: float = spec(2.0, min=0.1, max=60.0, doc="wait after bye and after terminate")
    request_timeout_s: float = spec(10.0, min=0.1, max=600.0, doc="wait for an engine reply (set_params(wait=True))")
    encoding: str = spec("raw", choices=ENCODINGS, doc="tcp frames: raw bytes or JPEG")
    jpeg_quality: int = spec(90, min=1, max=100)
    cuda_device: int = spec(0, min=0, max=64, doc="GPU for cuda-ipc rings when frames come from host memory")
    curve_secret_file: str | None = spec(None, doc="host certificate (zmq.auth) for CurveZMQ")
    curve_server_public_file: str | None = spec(None, doc="engine public key certificate for CurveZMQ")
    secret_file: str | None = spec(None, doc="a served engine's session secret (`loom serve --secret-file`, mode "
                                             "600), for launch=false on a loopback or ipc endpoint without CurveZMQ")

    def __post_init__(self) -> None:
        if not getattr(_building, "active", False):
            _building.active = True
            try:
                build(BridgeConfig, asdict(self), source="BridgeConfig")
            finally:
                _building.active = False
        if not self.launch and not self.endpoint:
            raise ValueError("endpoint: required when launch is false (the running engine's tcp:// or ipc:// address)")
        if self.encoding == "jpeg" and self.transport != "tcp":
            raise ValueError(f"encoding: 'jpeg' needs transport 'tcp', not {self.transport!r}")
        if self.standby and not self.launch:
            raise ValueError("standby: needs launch=true (the bridge starts the standby engine itself)")
        if self.secret_file is not None and (self.launch or self.curve_secret_file is not None):
            raise ValueError("secret_file: only for launch=false without CurveZMQ keys (a launched engine gets a "
                             "fresh token; Curve keys authenticate on their own)")
        if not self.launch and self.secret_file is None and self.curve_secret_file is None and _local(self.endpoint):
            # `loom serve` on this machine always holds a session secret: without it this host would only
            # ever be turned away by ZMQ's handshake, which says nothing
            from loom_live.host_bridge.reach import secret_needed
            raise ValueError(secret_needed(self.endpoint))
        if (self.curve_secret_file is None) != (self.curve_server_public_file is None):
            raise ValueError("curve_secret_file and curve_server_public_file: give both or neither")
        if self.hang_timeout_s < 2 * self.heartbeat_s:
            raise ValueError(f"hang_timeout_s: {self.hang_timeout_s} must be at least twice heartbeat_s "
                             f"({self.heartbeat_s})")
        if self.loading_hang_timeout_s < self.hang_timeout_s:
            raise ValueError(f"loading_hang_timeout_s: {self.loading_hang_timeout_s} must be at least hang_timeout_s "
                             f"({self.hang_timeout_s})")

    @classmethod
    def from_dict(cls, data: Any, source: str = "bridge config") -> BridgeConfig:
        return build(cls, data, source=source)


def _local(endpoint: str) -> bool:
    from loom_live.host_bridge.wire.channel import EndpointError, is_loopback

    try:
        return is_loopback(endpoint)
    except EndpointError:
        return False  # malformed: the channel says so when the bridge opens it


__all__ = ["BridgeConfig", "ConfigError", "FALLBACKS"]
