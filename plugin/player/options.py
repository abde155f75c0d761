"""What a player run is asked to do, checked before anything is opened."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loom_live.host_bridge.wire.params import LIVE, PROMPT, whole_chunks
from loom_live.plugin.media.app_io import APP_OUTPUT_SCHEMES, VIRTUALCAM, is_app_output
from loom_live.plugin.media.base import MediaError
from loom_live.plugin.media.sinks import SINK_FPS_RANGE, check_output_file

DEFAULT_OUTPUT = "loom_out.mp4"
WINDOW_OUTPUT = "window"
GENERATED_INPUT = "generated"
WEB_CAMERA_INPUT = "web-camera"  # `loom web`: the driving page's camera (plugin/web)
DEFAULT_GENERATED_FRAMES = whole_chunks(12)  # whole engine chunks: no partial last chunk
DEFAULT_GENERATED_SIZE = (256, 256)
DEFAULT_GENERATED_FPS = 24.0
NETWORK_OUTPUT_SCHEMES = ("udp", "srt", "rtmp", "rtmps")
MODES = ("auto", "lossless", "live")
TRANSPORTS = ("shm", "tcp", "cuda-ipc")
DEFAULT_STARTUP_TIMEOUT_S = 300.0  # --startup-timeout: a first start may download, compile and load a model

EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_ENGINE_FAILED = 3
EXIT_INTERRUPTED = 130


class PlayerError(Exception):
    """A failure the user can act on: printed as one line (plus the engine's log tail), no traceback."""

    def __init__(self, message: str, exit_code: int = EXIT_BAD_INPUT, detail: str = "") -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.detail = detail


@dataclass
class PlayerOptions:
    """A player run. `input=None` means the built-in generated clip."""

    input: str | None = None
    outputs: list[str] = field(default_factory=lambda: [DEFAULT_OUTPUT])
    config: str = "default"
    overrides: list[str] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)
    default_prompt: str = PROMPT.default
    # the config's model family (model.family): a prompt sent live is refused in its words (a served engine's own
    # once it says it: --endpoint)
    family: str = "wan"
    # the live parameters -c's config takes: a launched engine's until it says its own (a command for another one is
    # refused in the player from the start, and the page never offers it); None: any may be sent
    takes: tuple[str, ...] | None = None
    steps: int = len(LIVE["steps"].default)
    noise_scale: float = LIVE["noise_scale"].default
    motion_aware: bool = LIVE["motion_aware"].default
    lora_scales: dict[str, float] = field(default_factory=dict)  # the config's LoRAs, by name
    # the live parameters the command line set (--set, --lora, --control), by name as the wire takes them: an engine
    # served with its own config (--endpoint) is told those it takes, and keeps its own values for the rest
    given_params: dict[str, Any] = field(default_factory=dict)
    # the control sources this run can make, () = no structure control, and with them whether the model takes a
    # reference image (VACE, not the edges-only embedded model): -c's; a served engine's once it says them
    control_sources: tuple[str, ...] = ()
    takes_reference: bool = True
    control_source: str = LIVE["control_source"].default
    context_scale: float = LIVE["context_scale"].default
    adapter_strength: float = LIVE["adapter_strength"].default  # the edit family's (edit.adapter_strength)
    # VACE: the reference image file (--reference), read again with the r key; sent to a served engine once ready
    reference: str | None = None
    control_input: str | None = None  # VACE: a second input (camera, file, stream, generated) as the control video
    control: str | None = None  # --control as given: a refusal of its source names it (not --set's)
    max_frames: int | None = None
    size: tuple[int, int] | None = None  # the generated clip's (default DEFAULT_GENERATED_SIZE), or an input scaled
    fps: float = DEFAULT_GENERATED_FPS
    seed: int = 0
    mode: str = "auto"
    loop: bool = False
    transport: str = "shm"
    endpoint: str | None = None
    secret_file: str | None = None  # a served engine's session secret (with endpoint)
    engine_python: str | None = None
    passthrough: bool = False
    standby: bool = False  # a second launched engine kept loaded to take over (BridgeConfig.standby)
    hold_cpu_awake: bool = False  # CPUs kept out of deep idle states (BridgeConfig.hold_cpu_awake)
    osc_port: int | None = None
    osc_host: str = "127.0.0.1"
    web: str | None = None  # [HOST:]PORT of the page (plugin/web); None: no page
    web_token_file: str | None = None
    web_cert: str | None = None
    web_key: str | None = None
    web_proxy: bool = False  # the user's own HTTPS proxy fronts the page
    ice_servers: list[str] = field(default_factory=list)  # STUN/TURN URLs for the page's video (plugin/web/ice.py)
    ice_username: str | None = None
    ice_credential_file: str | None = None
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S
    quiet: bool = False
    overwrite: bool = False

    @property
    def command(self) -> str:
        """The command that runs it, as its lines name it: `loom web` is the player on the page's camera."""
        return "loom web" if self.input == WEB_CAMERA_INPUT else "loom play"

    def check(self) -> None:
        """Reject impossible combinations before opening anything."""
        if self.mode not in MODES:
            raise PlayerError(f"mode: {self.mode!r} is not allowed; expected one of {', '.join(MODES)}")
        if self.transport not in TRANSPORTS:
            raise PlayerError(f"transport: {self.transport!r} is not allowed; expected {', '.join(TRANSPORTS)}")
        if self.max_frames is not None and self.max_frames < 1:
            raise PlayerError(f"--frames: {self.max_frames} must be at least 1")
        if not SINK_FPS_RANGE[0] <= self.fps <= SINK_FPS_RANGE[1]:  # NaN too
            raise PlayerError(f"--fps: {self.fps:g} is not allowed; expected {SINK_FPS_RANGE[0]:g} to "
                              f"{SINK_FPS_RANGE[1]:g} frames a second")
        if not self.outputs and self.web is None:
            raise PlayerError("no output given; use -o FILE.mp4, -o udp://HOST:PORT or -o window")
        if self.uses_web_camera and self.web is None:
            raise PlayerError(f"input {WEB_CAMERA_INPUT!r} is the web page's camera: it needs the page (--web)")
        if (self.ice_servers or self.ice_username or self.ice_credential_file) and self.web is None:
            raise PlayerError("--ice-server, --ice-username and --ice-credential-file are for the page's video: "
                              "they need the page (--web)")
        if not self.startup_timeout_s > 0:  # NaN too; 0 or less failed as if the engine had (exit code 3)
            raise PlayerError(f"--startup-timeout: {self.startup_timeout_s:g} is not allowed; expected a number of "
                              "seconds above 0")
        if self.osc_port is not None and not 0 <= self.osc_port <= 65535:
            raise PlayerError(f"--osc-port: {self.osc_port} is not a UDP port (0..65535)")
        inputs = [] if self.uses_generated_clip or self.uses_web_camera else [self.input]
        files: dict[Path, str] = {}
        for spec in self.outputs:
            if output_kind(spec) != "file":
                continue
            try:
                check_output_file(spec, inputs, self.overwrite)
            except MediaError as exc:
                raise PlayerError(str(exc)) from None
            same = files.setdefault(Path(spec).expanduser().resolve(), spec)
            if same != spec or sum(s == spec for s in self.outputs) > 1:
                raise PlayerError(f"output {spec} is given twice{f' (as {same})' if same != spec else ''}; "
                                  "each -o file is written once")

    @property
    def uses_generated_clip(self) -> bool:
        return self.input is None or self.input == GENERATED_INPUT

    @property
    def uses_web_camera(self) -> bool:
        return self.input == WEB_CAMERA_INPUT


def output_kind(spec: str) -> str:
    """'window', 'app' (NDI, Spout, Syphon, virtual camera), 'network' or 'file'; an unknown URL
    scheme is refused with the allowed ones."""
    if spec == WINDOW_OUTPUT:
        return "window"
    if is_app_output(spec):
        return "app"
    if "://" in spec:
        scheme = spec.split("://", 1)[0].lower()
        if scheme not in NETWORK_OUTPUT_SCHEMES:
            raise PlayerError(f"output {spec!r}: unsupported URL scheme {scheme!r}; allowed: "
                              f"{', '.join(s + '://' for s in NETWORK_OUTPUT_SCHEMES + APP_OUTPUT_SCHEMES[:-1])}, "
                              f"'{VIRTUALCAM}', a .mp4/.mkv/.mov file or '{WINDOW_OUTPUT}'")
        return "network"
    return "file"


def read_prompt_file(path: str | Path, option: str = "--prompts") -> list[str]:
    """One prompt per line; blank lines and lines starting with # are skipped. `option` names the file in
    errors (the command-line option that gave it)."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise PlayerError(f"{option}: {p} is a folder; give a text file with one prompt per line")
    if not p.is_file():
        raise PlayerError(f"{option}: file not found: {p}")
    try:
        lines = p.read_text(encoding="utf-8-sig").splitlines()  # Notepad's UTF-8 starts with a byte-order mark
    except (OSError, UnicodeDecodeError) as exc:
        raise PlayerError(f"{option}: cannot read {p}: {exc}") from exc
    prompts = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    if not prompts:
        raise PlayerError(f"{option}: {p} holds no prompt (one per line; # starts a comment)")
    return prompts
