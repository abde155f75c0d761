"""The Loom ComfyUI nodes. Each node is thin: it converts ComfyUI's IMAGE and calls host_bridge.

`IMAGE` is a float32 tensor [B, H, W, 3] in 0..1, rows top-down. Engines started by the Engine
node live in `ENGINES` (keyed by their settings) across queue runs, so re-running a workflow does
not start a second engine; they are closed when ComfyUI exits.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

CATEGORY = "Loom"
ENGINE_TYPE = "LOOM_ENGINE"
TRANSPORTS = ["shm", "tcp", "cuda-ipc"]
FALLBACKS = ["passthrough", "last"]
# Seconds per frame a batch may take before the engine is declared stuck, plus start-up time.
TIMEOUT_PER_FRAME_S = 30.0
STARTUP_TIMEOUT_S = 300.0
CANCEL_POLL_S = 0.05  # how often a run waiting for its engine looks at its state and ComfyUI's Cancel


@dataclass
class EngineHandle:
    """What flows along a LOOM_ENGINE wire: the bridge (which remembers the prompt and params) and its settings."""

    key: str
    bridge: Any
    settings: dict[str, Any]
    interrupted: bool = False  # the last stream run was cancelled or failed: the next one resets and waits

    def status_text(self) -> str:
        _, status = self.bridge.latest()
        return (f"engine {status.state}  {status.fps:.1f} fps  latency {status.latency_ms:.0f} ms  "
                f"dropped {status.dropped}" + (f"  ({status.message})" if status.message else ""))


class EngineRegistry:
    """Engines by settings key; `get_or_start` reuses a live one, `close_all` stops every one."""

    def __init__(self) -> None:
        self._engines: dict[str, EngineHandle] = {}
        self._lock = threading.Lock()

    def get_or_start(self, settings: dict[str, Any]) -> EngineHandle:
        key = settings_key(settings)
        if self.ended(key):  # e.g. refused for missing weights, now pulled: the next queue run tries a fresh engine
            self.close(key)
        with self._lock:
            handle = self._engines.get(key)
            if handle is None:
                handle = EngineHandle(key, _start_bridge(settings), dict(settings))
                self._engines[key] = handle
            return handle

    def ended(self, key: str) -> bool:
        """Whether the engine of these settings was started and is now dead (it is not restarted)."""
        with self._lock:
            handle = self._engines.get(key)
        return handle is not None and handle.bridge.status().state.ended

    def close(self, key: str) -> None:
        with self._lock:
            handle = self._engines.pop(key, None)
        if handle is not None:
            handle.bridge.close()

    def close_all(self) -> None:
        for key in list(self._engines):
            self.close(key)

    def __len__(self) -> int:
        return len(self._engines)


ENGINES = EngineRegistry()
atexit.register(ENGINES.close_all)


def settings_key(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def _start_bridge(settings: dict[str, Any]) -> Any:
    try:
        from host_bridge import Bridge, BridgeConfig
    except ImportError as exc:
        raise RuntimeError(f"Loom: cannot import host_bridge ({exc}); link this folder from a Loom checkout "
                           "into custom_nodes, or pip install the Loom repository into ComfyUI's Python") from exc
    endpoint = settings["endpoint"].strip() or None
    overrides = [line.strip() for line in settings["overrides"].splitlines() if line.strip()]
    cfg = BridgeConfig(transport=settings["transport"], launch=endpoint is None,
                       engine_python=settings["engine_python"].strip() or sys.executable,
                       engine_config=settings["config"], engine_overrides=overrides, endpoint=endpoint,
                       fallback=settings["fallback"], passthrough=settings["passthrough"])
    bridge = Bridge(cfg)
    bridge.start()
    return bridge


def _images_to_frames(images: Any) -> np.ndarray:
    """ComfyUI IMAGE (torch tensor or array) to engine uint8 [B, H, W, 3]."""
    from .pixels import from_comfy

    array = images.detach().cpu().numpy() if hasattr(images, "detach") else np.asarray(images)
    return from_comfy(array)


def _frames_to_images(frames: list[np.ndarray] | np.ndarray) -> Any:
    import torch

    from .pixels import to_comfy

    return torch.from_numpy(to_comfy(frames if isinstance(frames, np.ndarray) else np.stack(frames)))


class LoomEngine:
    """Start a local engine (or connect to a running one) and hand it on as LOOM_ENGINE."""

    CATEGORY = CATEGORY
    RETURN_TYPES = (ENGINE_TYPE, "STRING")
    RETURN_NAMES = ("engine", "status")
    FUNCTION = "start"
    DESCRIPTION = "Starts a Loom engine process (or connects to one) that restyles frames with streaming diffusion."

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        return {
            "required": {
                "config": ("STRING", {"default": "default", "tooltip": "preset name or YAML file of the engine"}),
                "transport": (TRANSPORTS, {"default": "shm"}),
                "fallback": (FALLBACKS, {"default": "passthrough"}),
            },
            "optional": {
                "engine_python": ("STRING", {"default": "", "tooltip": "python with torch and Loom; empty: ComfyUI's"}),
                "endpoint": ("STRING", {"default": "", "tooltip": "empty: start a local engine; else its address"}),
                "overrides": ("STRING", {"default": "", "multiline": True, "tooltip": "key=value per line"}),
                "passthrough": ("BOOLEAN", {"default": False, "tooltip": "engine returns frames unchanged"}),
            },
        }

    @classmethod
    def IS_CHANGED(cls, **settings: Any) -> str:
        """Same settings, same engine: re-run only when a setting changes, or when that engine has ended
        (then the node runs again and starts a fresh one)."""
        key = settings_key(_engine_settings(**settings))
        return f"{key}:ended" if ENGINES.ended(key) else key

    def start(self, config: str, transport: str, fallback: str, engine_python: str = "", endpoint: str = "",
              overrides: str = "", passthrough: bool = False) -> tuple[EngineHandle, str]:
        handle = ENGINES.get_or_start(_engine_settings(config=config, transport=transport, fallback=fallback,
                                                       engine_python=engine_python, endpoint=endpoint,
                                                       overrides=overrides, passthrough=passthrough))
        return handle, handle.status_text()


def _engine_settings(config: str = "default", transport: str = "shm", fallback: str = "passthrough",
                     engine_python: str = "", endpoint: str = "", overrides: str = "",
                     passthrough: bool = False) -> dict[str, Any]:
    return {"config": config, "transport": transport, "fallback": fallback, "engine_python": engine_python,
            "endpoint": endpoint, "overrides": overrides, "passthrough": bool(passthrough)}


class LoomPrompt:
    """Set the prompt and the live parameters of an engine; passes the engine on."""

    CATEGORY = CATEGORY
    RETURN_TYPES = (ENGINE_TYPE,)
    RETURN_NAMES = ("engine",)
    FUNCTION = "apply"
    DESCRIPTION = "Prompt and parameters for a Loom engine; a prompt change blends over transition_chunks chunks."

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        from host_bridge.wire.params import LIVE, PROMPT, STEP_LISTS

        return {
            "required": {
                "engine": (ENGINE_TYPE,),
                "prompt": ("STRING", {"default": PROMPT.default, "multiline": True}),
                "steps": ("INT", {"default": len(LIVE["steps"].default), "min": min(STEP_LISTS),
                                  "max": max(STEP_LISTS), "tooltip": "denoising steps"}),
                "noise_scale": _live_input("noise_scale"),
                "motion_aware": _live_input("motion_aware"),
                "transition_chunks": _live_input("transition_chunks"),
            },
        }

    def apply(self, engine: EngineHandle, prompt: str, steps: int, noise_scale: float, motion_aware: bool,
              transition_chunks: int) -> tuple[EngineHandle]:
        from host_bridge.wire.params import LIVE, check_prompt_request, steps_for

        try:  # all checked before any is sent: a refused node changes nothing
            text, chunks = check_prompt_request(prompt, transition_chunks)
            params = LIVE.check({"steps": steps_for(steps), "noise_scale": noise_scale, "motion_aware": motion_aware})
        except ValueError as exc:
            raise ValueError(f"Loom Prompt: {exc}") from None
        # the bridge remembers both: the engine is told now if it runs, else as soon as it does
        engine.bridge.set_prompt(text, transition_chunks=chunks)
        engine.bridge.set_params(**params)
        return (engine,)


class LoomStream:
    """Stream an IMAGE batch through the engine; every frame comes back restyled, in order."""

    CATEGORY = CATEGORY
    RETURN_TYPES = ("IMAGE", "STRING")
    RETURN_NAMES = ("images", "status")
    FUNCTION = "stream"
    DESCRIPTION = ("Sends the frames of an IMAGE batch (a video) through the engine's stream; returns one "
                   "restyled frame per input frame. Each run is one stream, flushed at its end.")

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        return {
            "required": {
                "engine": (ENGINE_TYPE,),
                "images": ("IMAGE",),
            },
            "optional": {
                "timeout_s": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 36000.0,
                                        "tooltip": "0: a limit from the batch size"}),
            },
        }

    @classmethod
    def IS_CHANGED(cls, **_: Any) -> float:
        """NaN never equals itself: the stream is live, so the node runs every time."""
        return float("nan")

    def stream(self, engine: EngineHandle, images: Any, timeout_s: float = 0.0) -> tuple[Any, str]:
        frames = _images_to_frames(images)
        if not len(frames):  # an empty batch (a video loader past the last frame): nothing to stream
            return _frames_to_images(frames), engine.status_text()
        limit = timeout_s or (TIMEOUT_PER_FRAME_S * len(frames) + STARTUP_TIMEOUT_S)
        cancelled = _cancel_check()
        _wait_running(engine.bridge, limit, cancelled)
        if engine.interrupted:  # the engine confirms the new stream before this run's first frame goes
            engine.bridge.reset(wait=True)
            engine.interrupted = False
        try:
            outs = engine.bridge.process(_until_cancelled(frames, cancelled), timeout_s=limit)
        except BaseException:
            # Cancel (or a failure) mid-batch: process() has put the engine back in live mode; the frames
            # it still holds of this batch's stream go too, so the next run starts a stream of its own
            engine.interrupted = True
            engine.bridge.reset()
            raise
        if len(outs) != len(frames):
            raise RuntimeError(f"Loom Stream: the engine returned {len(outs)} frames for {len(frames)}")
        return _frames_to_images(outs), engine.status_text()


_INPUT_KINDS = {"int": "INT", "float": "FLOAT", "bool": "BOOLEAN"}


def _live_input(name: str) -> tuple[str, dict[str, Any]]:
    """A ComfyUI input for one live parameter: type, default, range and step from the schema (a widget
    stops at the schema's `ui_max` where the allowed maximum is far beyond useful values)."""
    from host_bridge.wire.params import LIVE

    p = LIVE[name]
    options: dict[str, Any] = {"default": p.default, "tooltip": p.doc}
    if p.min is not None:
        options["min"] = p.min
    if p.max is not None:
        options["max"] = p.ui_max if p.ui_max is not None else p.max
    if p.ui_step is not None:
        options["step"] = p.ui_step
    return _INPUT_KINDS[p.kind], options


def _cancel_check() -> Callable[[], None]:
    """ComfyUI's Cancel sets a flag that `comfy.model_management.throw_exception_if_processing_interrupted`
    turns into InterruptProcessingException (what ComfyUI expects a cancelled node to raise). Outside
    ComfyUI (scripts, tests) there is nothing to check."""
    try:
        from comfy.model_management import throw_exception_if_processing_interrupted
    except ImportError:
        return lambda: None
    return throw_exception_if_processing_interrupted


def _until_cancelled(frames: np.ndarray, cancelled: Callable[[], None]) -> Iterator[np.ndarray]:
    """The batch's frames, checking for Cancel before each: a cancelled run stops within a few frames
    (the ones in the engine's slots) instead of after the whole batch."""
    for frame in frames:
        cancelled()
        yield frame


def _wait_running(bridge: Any, limit_s: float, cancelled: Callable[[], None]) -> None:
    """Wait for the engine (loading a model takes a while), answering Cancel meanwhile."""
    from host_bridge import EngineState

    deadline = time.monotonic() + limit_s
    while (status := bridge.status()).state != EngineState.RUNNING:
        cancelled()
        if status.refusal:  # the engine refused its settings (config, weights): its own message says what to fix
            raise RuntimeError(f"Loom Stream: the engine refused to start: {status.refusal}")
        gone = status.state in (EngineState.DEAD, EngineState.STOPPED)
        if gone or time.monotonic() > deadline:
            tail = "\n".join(status.log_tail or [])
            raise RuntimeError(f"Loom Stream: the engine is {status.state}{'' if gone else f' after {limit_s:.0f} s'}"
                               f": {status.message}" + (f"\n{tail}" if tail else ""))
        time.sleep(CANCEL_POLL_S)


NODE_CLASS_MAPPINGS = {"LoomEngine": LoomEngine, "LoomPrompt": LoomPrompt, "LoomStream": LoomStream}
NODE_DISPLAY_NAME_MAPPINGS = {"LoomEngine": "Loom Engine", "LoomPrompt": "Loom Prompt & Params",
                              "LoomStream": "Loom Stream Images"}
