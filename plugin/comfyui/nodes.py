"""The Loom ComfyUI nodes. Each node is thin: it converts ComfyUI's IMAGE and calls host_bridge.

`IMAGE` is a float32 tensor [B, H, W, 3] in 0..1, rows top-down. Engines started by the Engine
node live in `ENGINES` (keyed by their settings) across queue runs, so re-running a workflow does
not start a second engine; an engine no Engine node uses any more (its node was given other
settings) is stopped, an engine started for a queued workflow first stops those none of its Engine
nodes uses (another workflow's), and the rest are closed when ComfyUI exits. The Engine node waits for
its engine, so a configuration the engine refuses, or an engine that cannot start, fails on that node.

A queued run is a function of its inputs: the Stream node starts each run on a fresh stream and on
the prompt and parameters of the Prompt and Control nodes on its own wire (no blend carried over from
the run before, nor another branch's prompt), unless the user asks for `blend_from_last_run`. What no
node on its wire sets (no Prompt node: the prompt) is the engine's own, the one its config starts on,
whatever an earlier run or another branch set; a reference image no Control node on the wire sets is
cleared (a Control node without one clears it too).

VACE (*vace* model presets): the Loom Control node sets the control source and scale and a reference
image (the first of an IMAGE batch); the Stream node's optional `control` input is the control video,
one frame per input frame (control_source `video`).

LoRAs: a chain of Loom LoRA nodes builds a `LOOM_LORAS` list of (file, strength) that the Engine
node takes. The files are part of the engine's settings: other files replace the engine with one
started with them (`--lora`); other strengths only go to the running engine as the live
`lora_scales` parameter, without a restart.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

CATEGORY = "Loom"
ENGINE_TYPE = "LOOM_ENGINE"
LORAS_TYPE = "LOOM_LORAS"  # a tuple of (absolute path, strength), one per LoRA, in chain order
NO_LORA_FILE = "(none: use path)"  # the file list's entry when ComfyUI's loras folder is empty or unknown
TRANSPORTS = ["shm", "tcp", "cuda-ipc"]
FALLBACKS = ["passthrough", "last"]
# Seconds per frame a batch may take before the engine is declared stuck, plus start-up time.
TIMEOUT_PER_FRAME_S = 30.0
STARTUP_TIMEOUT_S = 300.0
ENGINE_READY_TIMEOUT_S = 1200.0  # the Engine node's wait; the bridge gives up on a load itself before this
CANCEL_POLL_S = 0.05  # how often a run waiting for its engine looks at its state and ComfyUI's Cancel


@dataclass
class EngineHandle:
    """What flows along a LOOM_ENGINE wire: the bridge and its settings, and what the nodes on this wire
    asked of the engine. One engine serves every branch of a workflow while ComfyUI keeps a node's output
    between runs, so a Prompt or Control node hands on a copy carrying its wishes (the bridge, its
    settings and `shared` stay the engine's own): the Stream node at the end of the wire tells the engine
    them again before its run, and each branch streams on its own prompt whichever node ran last."""

    key: str
    bridge: Any
    settings: dict[str, Any]
    loras: tuple[Any, ...] = ()  # the `host_bridge.loras.LoraChoice`s the engine was started with
    users: set[str] = field(default_factory=set)  # the Engine nodes (ComfyUI's node ids) that use it
    shared: dict[str, Any] = field(default_factory=dict)  # the engine's state, the same object in every copy
    wishes: tuple[tuple[str, Any], ...] = ()  # (kind, value) in wire order: prompt, params, reference

    @property
    def interrupted(self) -> bool:
        """The last stream run on this engine was cancelled or failed: the next one resets and waits."""
        return self.shared.get("interrupted", False)

    @interrupted.setter
    def interrupted(self, value: bool) -> None:
        self.shared["interrupted"] = value

    def wishing(self, *wishes: tuple[str, Any]) -> EngineHandle:
        """A copy of this handle with `wishes` after its own (the engine and its state shared)."""
        return replace(self, wishes=self.wishes + wishes)

    def tell_wishes(self, blend: bool) -> None:
        """Tell the engine this wire's prompt, parameters and reference before a run; with `blend` a prompt
        other than the engine's blends in over its transition, else it takes effect at the run's reset."""
        bridge = self.bridge
        self._back_to_start()
        for kind, value in self.wishes:
            if kind == "prompt":
                text, chunks = value
                wanted = bridge.wanted.prompt
                if wanted is None or wanted.text != text:
                    bridge.set_prompt(text, transition_chunks=chunks if blend else 0, wait=True)
            elif kind == "params":
                bridge.set_params(wait=True, **value)
            elif kind == "reference":
                bridge.set_reference(value, wait=True)

    def _back_to_start(self) -> None:
        """What no node on this wire sets goes back to what the engine started on (its config's), not what an
        earlier run or another branch set: the prompt when no Prompt node is on the wire (without a blend),
        and each parameter no node on it sets. An engine that does not say what it started on (an older
        one) keeps those. A reference image no Control node on the wire sets is cleared, as a Control node
        without one clears it: the bridge can clear a reference but not bring back a config's own file."""
        bridge = self.bridge
        wanted = bridge.wanted
        if not any(kind == "reference" for kind, _ in self.wishes) and wanted.reference is not None:
            bridge.set_reference(None, wait=True)
        start = bridge.engine_start()
        if start is None:
            return
        if not any(kind == "prompt" for kind, _ in self.wishes) and wanted.prompt is not None \
                and wanted.prompt.text != start["prompt"]:
            bridge.set_prompt(start["prompt"], transition_chunks=0, wait=True)
        wished = {name for kind, value in self.wishes if kind == "params" for name in value}
        back = {name: start["params"][name] for name, value in wanted.params.items()
                if name not in wished and name in start["params"] and value != start["params"][name]}
        if back:
            bridge.set_params(wait=True, **back)

    def status_text(self, since: str | None = None) -> str:
        """The engine's state and counters, and its last message unless it is still `since` (the message
        before a run): the bridge keeps a remark until the next one, and an earlier run's is not this run's."""
        _, status = self.bridge.latest()
        message = status.message if status.message != since else ""
        return (f"engine {status.state}  {status.fps:.1f} fps  latency {status.latency_ms:.0f} ms  "
                f"dropped {status.dropped}" + (f"  ({message})" if message else ""))


class EngineRegistry:
    """Engines by settings key; `get_or_start` reuses a live one, `close_all` stops every one.

    Each engine holds a model on the GPU, so the registry keeps only those a workflow uses: an Engine node
    moved to other settings leaves its engine, and starting an engine closes those no Engine node of the
    queued workflow uses (another workflow's, a deleted or muted node's). Re-running a workflow starts
    nothing and closes nothing; two workflows queued in turn restart each other's engines, as two models
    that do not both fit on the GPU would be loaded in turn."""

    def __init__(self) -> None:
        self._engines: dict[str, EngineHandle] = {}
        # Engine nodes whose engine was closed while their workflow was not queued: ComfyUI still holds
        # their output (the closed engine), so their IS_CHANGED says so and they run again
        self._closed_for: set[str] = set()
        self._lock = threading.Lock()

    def get_or_start(self, settings: dict[str, Any], loras: tuple[Any, ...] = (), node: str = "",
                     workflow: frozenset[str] | None = None) -> EngineHandle:
        """The engine of these settings and LoRA files, started if needed; one with the same files is told
        the strengths live. When Engine node `node` (ComfyUI's node id) moves to other settings or files,
        the engine it used stops first unless another node uses it: an edited node leaves one engine (two
        would hold the model twice). `workflow`: the ids of the queued workflow's Engine nodes; an engine
        started for it first closes those none of them uses. Without a node id and a workflow (scripts)
        engines stay until `close_all`."""
        key = engine_key(settings, loras)
        if self.ended(key):  # e.g. refused for missing weights, now pulled: the next queue run tries a fresh engine
            self.close(key, "it had ended; the Engine node starts a fresh one")
        for unused in self._leave(node, key):  # stopped outside the lock: it takes a moment
            _close(unused, f"Engine node {node} was given other settings")
        for unused in self._unused_by(workflow, key):
            _close(unused, "no Engine node of the queued workflow uses it, and that workflow starts another")
        with self._lock:
            self._closed_for.discard(node)
            handle = self._engines.get(key)
            if handle is None:
                handle = EngineHandle(key, _start_bridge(settings, loras), dict(settings), loras=loras)
                self._engines[key] = handle
            if node:
                handle.users.add(node)
            if loras:
                from loom_live.host_bridge.loras import scales

                handle.bridge.set_params(lora_scales=scales(loras))
                handle.loras = loras
            return handle

    def _leave(self, node: str, key: str) -> list[EngineHandle]:
        """Node `node` no longer uses the engines other than `key`'s: those no node uses leave the registry."""
        if not node:
            return []
        unused = []
        with self._lock:
            for old_key, old in list(self._engines.items()):
                if old_key != key and node in old.users:
                    old.users.discard(node)
                    if not old.users:
                        unused.append(self._engines.pop(old_key))
        return unused

    def _unused_by(self, workflow: frozenset[str] | None, key: str) -> list[EngineHandle]:
        """When `key`'s engine is about to start for `workflow`: the engines none of its Engine nodes uses
        leave the registry (their nodes are remembered for `ended_for`)."""
        if workflow is None:
            return []
        with self._lock:
            if key in self._engines:
                return []
            unused = [self._engines.pop(k) for k, h in list(self._engines.items()) if not h.users & workflow]
            for handle in unused:
                self._closed_for |= handle.users
        return unused

    def ended(self, key: str) -> bool:
        """Whether the engine of these settings was started and is now dead (it is not restarted)."""
        with self._lock:
            handle = self._engines.get(key)
        return handle is not None and handle.bridge.status().state.ended

    def ended_for(self, node: str) -> bool:
        """Whether an engine that Engine node `node` uses has ended, or was closed for another workflow's:
        ComfyUI gives IS_CHANGED no linked input (the LoRA chain), so a node's engine is found by the node,
        not by its settings."""
        with self._lock:
            if node in self._closed_for:
                return True
            handles = [h for h in self._engines.values() if node in h.users]
        return any(h.bridge.status().state.ended for h in handles)

    def close(self, key: str, why: str = "its owner closed it") -> None:
        with self._lock:
            handle = self._engines.pop(key, None)
        if handle is not None:
            _close(handle, why)

    def close_all(self, why: str = "its owner closed every engine") -> None:
        for key in list(self._engines):
            self.close(key, why)

    def __len__(self) -> int:
        return len(self._engines)


def _close(handle: EngineHandle, why: str) -> None:
    """Stop an engine that left the registry, saying which and why in ComfyUI's log."""
    users = ", ".join(sorted(handle.users)) or "none"
    log.info("Loom: closing the engine of config %r (Engine nodes: %s): %s", handle.settings.get("config"), users,
             why)
    handle.bridge.close()


ENGINES = EngineRegistry()
atexit.register(ENGINES.close_all, "ComfyUI exits")


def settings_key(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def engine_key(settings: dict[str, Any], loras: tuple[Any, ...]) -> str:
    """One engine per settings and LoRA files (strengths change live on it)."""
    return settings_key({**settings, "loras": [c.path for c in loras]})


def _choices(loras: Any) -> tuple[Any, ...]:
    """A `LOOM_LORAS` list as the LoRA choices an engine is started with."""
    from loom_live.host_bridge.loras import LoraChoice

    return tuple(LoraChoice(path, strength) for path, strength in loras or ())


def _start_bridge(settings: dict[str, Any], loras: tuple[Any, ...] = ()) -> Any:
    try:
        from loom_live.host_bridge import Bridge, BridgeConfig
        from loom_live.host_bridge.loras import engine_args
    except ImportError as exc:
        raise RuntimeError(f"Loom: cannot import loom_live.host_bridge ({exc}); link this folder from a Loom checkout "
                           "into custom_nodes, or pip install the Loom repository into ComfyUI's Python") from exc
    endpoint = settings["endpoint"].strip() or None
    overrides = [line.strip() for line in settings["overrides"].splitlines() if line.strip()]
    if loras and endpoint is not None:
        raise ValueError("Loom Engine: LoRA files load with an engine this node starts; the engine at endpoint "
                         "has the LoRAs it was served with (loom serve --lora). Disconnect the loras input")
    secret_file = settings["secret_file"].strip() or None
    if endpoint is not None:
        from loom_live.host_bridge.reach import check_reachable
        from loom_live.host_bridge.wire.errors import UserError

        try:  # a peer that will never let this node in is said now, not after a silent wait
            check_reachable(endpoint, secret_file, names=("endpoint", "secret_file"))
        except UserError as exc:
            raise ValueError(f"Loom Engine: {exc}") from None
    cfg = BridgeConfig(transport=settings["transport"], launch=endpoint is None,
                       engine_python=settings["engine_python"].strip() or sys.executable,
                       engine_config=settings["config"], engine_overrides=overrides, endpoint=endpoint,
                       secret_file=secret_file if endpoint is not None else None,
                       fallback=settings["fallback"], passthrough=settings["passthrough"],
                       engine_args=engine_args(loras))
    bridge = Bridge(cfg)
    bridge.start()
    return bridge


def _images_to_frames(images: Any) -> np.ndarray:
    """ComfyUI IMAGE (torch tensor or array) to engine uint8 [B, H, W, 3]; a float tensor of another precision
    is read as float32 (numpy has no bfloat16)."""
    from .pixels import from_comfy

    if hasattr(images, "detach"):
        tensor = images.detach().cpu()
        array = (tensor.float() if tensor.is_floating_point() else tensor).numpy()
    else:
        array = np.asarray(images)
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
    DESCRIPTION = ("Starts a Loom engine process (or connects to one) that restyles frames with streaming diffusion. "
                   "Starting one stops the engines no Engine node of the queued workflow uses.")

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        return {
            # ComfyUI's id of this node (which engine it used before), and the queued workflow (which engines
            # it uses: the others close when this node starts one)
            "hidden": {"unique_id": "UNIQUE_ID", "workflow": "PROMPT"},
            "required": {
                "config": ("STRING", {"default": "default", "tooltip": "preset name or YAML file of the engine"}),
                "transport": (TRANSPORTS, {"default": "shm"}),
                "fallback": (FALLBACKS, {"default": "passthrough"}),
            },
            "optional": {
                "engine_python": ("STRING", {"default": "", "tooltip": "python with torch and Loom; empty: ComfyUI's"}),
                "endpoint": ("STRING", {"default": "", "tooltip": "empty: start a local engine; else the address "
                                                                 "of one `loom serve --bind` runs on this machine"}),
                "secret_file": ("STRING", {"default": "", "tooltip": "with endpoint: the served engine's session "
                                                                    "secret (its loom serve --secret-file)"}),
                "overrides": ("STRING", {"default": "", "multiline": True, "tooltip": (
                    "key=value per line; with endpoint only prompt.text and the live parameters (the served "
                    "engine runs its own config)")}),
                "passthrough": ("BOOLEAN", {"default": False, "tooltip": "engine returns frames unchanged"}),
                "loras": (LORAS_TYPE, {"tooltip": "style LoRAs from a chain of Loom LoRA nodes"}),
            },
        }

    @classmethod
    def IS_CHANGED(cls, loras: Any = None, unique_id: Any = None, workflow: Any = None, **settings: Any) -> str:
        """Same settings, same engine: re-run only when a setting (or a LoRA or its strength) changes, or
        when that engine has ended or was closed for another workflow's (then the node runs again and
        starts a fresh one). ComfyUI gives IS_CHANGED an empty `workflow`: it is not used here."""
        engine_settings = _engine_settings(**settings)
        key = settings_key({**engine_settings, "loras": [list(x) for x in loras or ()]})
        ended = ENGINES.ended(engine_key(engine_settings, _choices(loras))) \
            or unique_id is not None and ENGINES.ended_for(str(unique_id))
        return f"{key}:ended" if ended else key

    def start(self, config: str, transport: str, fallback: str, engine_python: str = "", endpoint: str = "",
              secret_file: str = "", overrides: str = "", passthrough: bool = False, loras: Any = None,
              unique_id: Any = None, workflow: dict[str, Any] | None = None) -> tuple[EngineHandle, str]:
        _check_overrides(overrides)
        if endpoint.strip():
            prompt, given = _served_overrides(overrides)
        else:  # the engine starts with them: nothing to tell it later
            _check_launched(config, overrides)
            prompt, given = None, {}
        handle = ENGINES.get_or_start(_engine_settings(config=config, transport=transport, fallback=fallback,
                                                       engine_python=engine_python, endpoint=endpoint,
                                                       secret_file=secret_file, overrides=overrides,
                                                       passthrough=passthrough),
                                      _choices(loras),
                                      node="" if unique_id is None else str(unique_id),
                                      workflow=_engine_nodes(workflow))
        # waited for here, so that a config the engine refuses, or an engine that cannot start, fails this node
        _wait_running(handle, ENGINE_READY_TIMEOUT_S, _cancel_check(), "Loom Engine")
        if prompt is not None or given:
            handle = _tell_served(handle, prompt, given)
        if handle.loras:  # two Engine nodes with the same files share the engine: each wire keeps its strengths
            from loom_live.host_bridge.loras import scales

            handle = handle.wishing(("params", {"lora_scales": scales(handle.loras)}))
        return handle, handle.status_text()


def _engine_nodes(workflow: dict[str, Any] | None) -> frozenset[str] | None:
    """The ids of the Engine nodes of a queued workflow (ComfyUI's PROMPT: each node by id, with its
    class_type); None without one (a script's call)."""
    if not workflow:
        return None
    return frozenset(str(i) for i, n in workflow.items() if NODE_CLASS_MAPPINGS.get(n["class_type"]) is LoomEngine)


def _check_overrides(overrides: str) -> None:
    """Each line `key=value` (the engine checks keys and values when it starts)."""
    for number, line in enumerate(overrides.splitlines(), 1):
        key, eq, _ = line.strip().partition("=")
        if line.strip() and (not eq or not key.strip()):
            raise ValueError(f"Loom Engine: overrides line {number}: {line.strip()!r} is not allowed; expected "
                             "key=value, one per line (e.g. stream.steps=[700,500])")


def _served_overrides(overrides: str) -> tuple[str | None, dict[str, Any]]:
    """With an endpoint the overrides never reach the engine's config (it is served with its own): the first prompt
    (prompt.text) and the live parameters, of any model family, are what it can be told once ready; any other key is
    refused here, named in this node's inputs' words (the user has no command line), before the node connects."""
    from loom_live.engine.config import ConfigError
    from loom_live.engine.host_overrides import HOST_KEYS, ServedKeyError, served_overrides

    texts, sources = _override_lines(overrides)
    try:  # a value not allowed, or no YAML, is named by its line (served_overrides' sources)
        host, params = served_overrides(texts, sources)
    except ServedKeyError as exc:
        raise ValueError(f"Loom Engine: {sources[texts.index(exc.override)]}: {exc.override!r} is not "
                         f"allowed while endpoint is set: a served engine runs its own config, and only the live "
                         f"parameters reach it ({', '.join(exc.live_keys)}) and {', '.join(HOST_KEYS)}{exc.hint}; "
                         f"set {exc.key} in the config the engine is served with, or clear endpoint to start a "
                         "local engine") from None
    except ConfigError as exc:
        raise ValueError(f"Loom Engine: {exc}") from None
    prompt = json.loads(host[-1].partition("=")[2]) if host else None  # checked there; the last one given counts
    return prompt, params


def _check_launched(config: str, overrides: str) -> None:
    """The config and overrides of an engine this node launches, checked before it starts (it checks them again): a
    refusal is said at once, naming the overrides line, instead of in the engine's command-line words once it has
    started."""
    from loom_live.engine.config import ConfigError
    from loom_live.engine.host_overrides import check_overrides

    try:
        check_overrides(config, *_override_lines(overrides), "overrides")
    except ConfigError as exc:
        raise ValueError(f"Loom Engine: {exc}") from None


def _override_lines(overrides: str) -> tuple[list[str], list[str]]:
    """The overrides input's lines that say something, stripped, and each one's name in this node's words
    (`overrides line N`, blank lines counted): a ComfyUI user has no `--set` to be told about."""
    numbered = [(number, line.strip()) for number, line in enumerate(overrides.splitlines(), 1) if line.strip()]
    return [text for _, text in numbered], [f"overrides line {number}" for number, _ in numbered]


def _tell_served(handle: EngineHandle, prompt: str | None, params: dict[str, Any]) -> EngineHandle:
    """A ready served engine is told the overrides' prompt and live parameters, as wishes of this wire (the Stream
    node tells them again before each run); a parameter it does not take is refused, naming those it takes, before
    any is sent."""
    from loom_live.host_bridge.wire.params import check_prompt_request

    bridge = handle.bridge
    start = bridge.engine_start()
    takes = params if start is None else start["params"]  # an engine that does not say: sent, it refuses itself
    unsent = [name for name in params if name not in takes]
    wishes: list[tuple[str, Any]] = []
    try:
        if unsent:
            raise ValueError(f"the engine at {handle.settings['endpoint'].strip()} does not take "
                             f"{', '.join(unsent)}; it takes {', '.join(takes) or 'none'}")
        text = check_prompt_request(prompt, family=bridge.engine_family)[0] if prompt is not None else None
        if params:
            bridge.set_params(wait=True, **params)
            wishes.append(("params", params))
        if text is not None:
            bridge.set_prompt(text, transition_chunks=0, wait=True)
            wishes.append(("prompt", (text, 0)))
    except ValueError as exc:
        raise ValueError(f"Loom Engine: overrides: {exc}") from None
    return handle.wishing(*wishes)


def _engine_settings(config: str = "default", transport: str = "shm", fallback: str = "passthrough",
                     engine_python: str = "", endpoint: str = "", secret_file: str = "", overrides: str = "",
                     passthrough: bool = False) -> dict[str, Any]:
    return {"config": config, "transport": transport, "fallback": fallback, "engine_python": engine_python,
            "endpoint": endpoint, "secret_file": secret_file, "overrides": overrides,
            "passthrough": bool(passthrough)}


class LoomLora:
    """One style LoRA and its strength, added to the LoRAs of the previous Loom LoRA node (if any)."""

    CATEGORY = CATEGORY
    RETURN_TYPES = (LORAS_TYPE,)
    RETURN_NAMES = ("loras",)
    FUNCTION = "add"
    DESCRIPTION = ("A Wan2.1 style LoRA for the Loom Engine node; chain several. A strength change reaches a "
                   "running engine live; a file change restarts it. Put the LoRA's trigger words in the prompt.")

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        from loom_live.host_bridge.wire.params import LORA_DEFAULT_SCALE, LORA_SCALES

        files = [NO_LORA_FILE, *_lora_folder_files()]
        return {
            "required": {
                "lora_name": (files, {"default": NO_LORA_FILE, "tooltip": "a file of ComfyUI's models/loras folder"}),
                "strength": ("FLOAT", {"default": LORA_DEFAULT_SCALE, "min": LORA_SCALES.min,
                                       "max": LORA_SCALES.ui_max, "step": LORA_SCALES.ui_step,
                                       "tooltip": LORA_SCALES.doc}),
            },
            "optional": {
                "path": ("STRING", {"default": "", "tooltip": "a LoRA file anywhere; used instead of lora_name"}),
                "loras": (LORAS_TYPE, {"tooltip": "the LoRAs of the previous Loom LoRA node"}),
            },
        }

    def add(self, lora_name: str, strength: float, path: str = "",
            loras: tuple[tuple[str, float], ...] | None = None) -> tuple[tuple[tuple[str, float], ...]]:
        from loom_live.host_bridge.loras import LoraChoice, check_together, lora_choice

        file = path.strip() or _lora_folder_path(lora_name)
        try:
            choice = lora_choice(file, strength)
            chain = (*(LoraChoice(p, s) for p, s in loras or ()), choice)
            check_together(chain)
        except ValueError as exc:
            raise ValueError(f"Loom LoRA: {exc}") from None
        return (tuple((c.path, c.scale) for c in chain),)


def _lora_folder_files() -> list[str]:
    """The files of ComfyUI's `loras` folder(s), as its own LoRA loader lists them; none outside ComfyUI."""
    try:
        import folder_paths
    except ImportError:
        return []
    return list(folder_paths.get_filename_list("loras"))


def _lora_folder_path(name: str) -> str:
    """A name from the loras folder list -> its full path; ValueError when there is none."""
    if name == NO_LORA_FILE:
        raise ValueError("Loom LoRA: pick a file in lora_name (ComfyUI's models/loras folder) or give a path")
    try:
        import folder_paths
    except ImportError:
        raise ValueError(f"Loom LoRA: {name!r}: no ComfyUI loras folder here; give the file's path") from None
    full = folder_paths.get_full_path("loras", name)
    if full is None:
        raise ValueError(f"Loom LoRA: {name!r} is not in ComfyUI's loras folder any more; pick another")
    return full


class LoomPrompt:
    """Set the prompt and the live parameters of an engine; passes the engine on."""

    CATEGORY = CATEGORY
    RETURN_TYPES = (ENGINE_TYPE,)
    RETURN_NAMES = ("engine",)
    FUNCTION = "apply"
    DESCRIPTION = ("Prompt and parameters for a Loom engine. Each queue run starts on its prompt; with the Stream "
                   "node's blend_from_last_run on, a new prompt blends in over transition_chunks chunks instead.")

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        from loom_live.host_bridge.wire.params import LIVE, PROMPT, STEP_LISTS

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
        from loom_live.host_bridge.wire.params import LIVE, check_prompt_request, steps_for

        try:  # all checked before any is sent: a refused node changes nothing; the prompt in the engine's words
            text, chunks = check_prompt_request(prompt, transition_chunks, family=engine.bridge.engine_family)
            params = LIVE.check({"steps": steps_for(steps), "noise_scale": noise_scale, "motion_aware": motion_aware})
        except ValueError as exc:
            raise ValueError(f"Loom Prompt: {exc}") from None
        # the bridge remembers both: the engine is told now if it runs, else as soon as it does; the Stream
        # node tells them again, as the wish of this wire, before each of its runs
        engine.bridge.set_prompt(text, transition_chunks=chunks)
        engine.bridge.set_params(**params)
        return (engine.wishing(("prompt", (text, chunks)), ("params", params)),)


class LoomControl:
    """VACE structure control of an engine: the control source and scale, and a reference image; passes it on."""

    CATEGORY = CATEGORY
    RETURN_TYPES = (ENGINE_TYPE,)
    RETURN_NAMES = ("engine",)
    FUNCTION = "apply"
    DESCRIPTION = ("Structure control for a VACE engine (a *vace* config): what the control video is made from "
                   "(edges, grey, flow, depth, or the Stream node's control input: video), how strongly it "
                   "steers, and a reference image (the first of the batch) that sets the look. Without a "
                   "reference input a reference an earlier run set is cleared. On the default (embedded) "
                   "engine context_scale scales the input's edges it reads (0: its structure not given); "
                   "control_source must be edges there, and it takes no reference.")

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        from loom_live.host_bridge.wire.params import CONTROL

        return {
            "required": {
                "engine": (ENGINE_TYPE,),
                "control_source": (list(CONTROL.choices), {"default": CONTROL.default, "tooltip": CONTROL.doc}),
                "context_scale": _live_input("context_scale"),
            },
            "optional": {
                "reference": ("IMAGE", {"tooltip": "the look to keep: the first image of the batch"}),
            },
        }

    def apply(self, engine: EngineHandle, control_source: str, context_scale: float,
              reference: Any = None) -> tuple[EngineHandle]:
        from loom_live.host_bridge.wire.params import LIVE

        try:  # checked before anything is sent; the engine's own refusal (no VACE blocks) is raised here too
            params = LIVE.check({"control_source": control_source, "context_scale": context_scale})
            image = _images_to_frames(reference) if reference is not None else None
            if image is not None and not len(image):
                raise ValueError("reference: the image batch is empty; expected at least one image")
            image = image[0] if image is not None else None
            _wait_running(engine, STARTUP_TIMEOUT_S, _cancel_check(), "Loom Control")
            engine.bridge.set_params(wait=True, **params)
            wishes: list[tuple[str, Any]] = [("params", params)]
            if image is not None or engine.bridge.wanted.reference_set:
                engine.bridge.set_reference(image, wait=True)
                wishes.append(("reference", image))
        except ValueError as exc:
            raise ValueError(f"Loom Control: {exc}") from None
        return (engine.wishing(*wishes),)


class LoomStream:
    """Stream an IMAGE batch through the engine; every frame comes back restyled, in order."""

    CATEGORY = CATEGORY
    RETURN_TYPES = ("IMAGE", "STRING")
    RETURN_NAMES = ("images", "status")
    FUNCTION = "stream"
    DESCRIPTION = ("Sends the frames of an IMAGE batch (a video) through the engine's stream; returns one "
                   "restyled frame per input frame. Each run is one stream, started afresh and flushed at its end.")
    # a list of images (a folder loader's) comes whole, as one call, so it can become one stream
    INPUT_IS_LIST = True

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        return {
            "required": {
                "engine": (ENGINE_TYPE,),
                "images": ("IMAGE",),
            },
            "optional": {
                "control": ("IMAGE", {"tooltip": (
                    "VACE presets, control_source video: the control video, one frame per input frame and of "
                    "its size; frames without one, or with one that does not fit, are counted and go on")}),
                "timeout_s": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 36000.0,
                                        "tooltip": "0: a limit from the batch size"}),
                "blend_from_last_run": ("BOOLEAN", {"default": False, "tooltip": (
                    "off: every run starts a fresh stream on its prompt, so a queued run depends only on its "
                    "inputs; on: a prompt changed since the last run blends in over transition_chunks")}),
            },
        }

    @classmethod
    def IS_CHANGED(cls, **_: Any) -> float:
        """NaN never equals itself: the stream is live, so the node runs every time."""
        return float("nan")

    def stream(self, engine: list[EngineHandle], images: list[Any], timeout_s: list[float] = (0.0,),
               blend_from_last_run: list[bool] = (False,), control: list[Any] | None = None) -> tuple[Any, str]:
        """Every input comes as a list (INPUT_IS_LIST); all but `images` and `control` hold one value."""
        engine, timeout, blend = engine[0], float(timeout_s[0]), bool(blend_from_last_run[0])
        said = engine.bridge.status().message  # what an earlier run left in the status
        frames, note = _stream_frames(images)
        controls = _stream_frames(control, "control")[0] if control else None
        limit = timeout or (TIMEOUT_PER_FRAME_S * len(frames) + STARTUP_TIMEOUT_S)
        cancelled = _cancel_check()
        _wait_running(engine, limit, cancelled, "Loom Stream")
        try:  # this wire's prompt and parameters, whichever branch's nodes ran last
            engine.tell_wishes(blend)
        except ValueError as exc:
            raise ValueError(f"Loom Stream: {exc}") from None
        if engine.interrupted or not blend:  # confirmed before this run's first frame goes
            engine.bridge.reset(wait=True)  # a fresh stream on the newest prompt, with no blend under way
            engine.interrupted = False
        refused = engine.bridge.stats()["refused_control"]
        try:
            outs = engine.bridge.process(_until_cancelled(frames, cancelled), timeout_s=limit, control=controls)
        except BaseException:
            # Cancel (or a failure) mid-batch: process() has put the engine back in live mode; the frames
            # it still holds of this batch's stream go too, so the next run starts a stream of its own
            engine.interrupted = True
            engine.bridge.reset()
            raise
        if len(outs) != len(frames):
            raise RuntimeError(f"Loom Stream: the engine returned {len(outs)} frames for {len(frames)}")
        if controls is not None:
            note += _control_note(len(frames), len(controls), engine.bridge.stats()["refused_control"] - refused)
        return _frames_to_images(outs), engine.status_text(since=said) + note


def _control_note(frames: int, controls: int, refused: int) -> str:
    """What the status says of the control video when not every frame had a fitting control frame."""
    missing = max(0, frames - controls)
    if not refused and not missing:
        return ""
    return (f"  (control: {refused} frame(s) refused, not of the input's size; {missing} frame(s) without one; "
            "those went on with the grey control)")


def _stream_frames(images: list[Any], what: str = "images") -> tuple[np.ndarray, str]:
    """The frames of one stream: an IMAGE batch, or a list of them (a folder loader's images) of one size,
    joined in order. A note for the status says when a list was joined."""
    named = "" if what == "images" else f"{what}: "  # which input a refusal is about
    try:
        batches = [_images_to_frames(batch) for batch in images]
    except ValueError as exc:
        raise ValueError(f"Loom Stream: {named}{exc}") from None
    filled = [b for b in batches if len(b)]  # an empty batch in a list adds no frame (nor a size)
    sizes = sorted({f"{b.shape[2]}x{b.shape[1]}" for b in filled})
    if len(sizes) > 1:
        raise ValueError(f"Loom Stream: {named}the images come as a list of {len(batches)} in {len(sizes)} sizes "
                         f"({', '.join(sizes[:4])}); one stream takes one size: scale them to one size first "
                         "(e.g. Upscale Image), or stream each size with its own Loom Stream node")
    if not filled:
        raise ValueError(f"Loom Stream: {named}the image batch is empty (0 frames); expected at least one frame "
                         "(a video loader past the end of its video, or a skip_first_frames beyond it?)")
    frames = np.concatenate(filled) if len(filled) > 1 else filled[0]
    note = f"  ({len(batches)} images of a list streamed as one video)" if len(batches) > 1 else ""
    return frames, note


_INPUT_KINDS = {"int": "INT", "float": "FLOAT", "bool": "BOOLEAN"}


def _live_input(name: str) -> tuple[str, dict[str, Any]]:
    """A ComfyUI input for one live parameter: type, default, range and step from the schema (a widget
    stops at the schema's `ui_max` where the allowed maximum is far beyond useful values)."""
    from loom_live.host_bridge.wire.params import LIVE

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


def _wait_running(engine: EngineHandle, limit_s: float, cancelled: Callable[[], None], node: str) -> None:
    """Wait for the engine (loading a model takes a while), answering Cancel meanwhile; a failure names
    `node`. An engine that failed naming one of its LoRA files (one for another model size) is stopped,
    and the run says which."""
    from loom_live.host_bridge import EngineState

    bridge = engine.bridge
    deadline = time.monotonic() + limit_s
    while (status := bridge.status()).state != EngineState.RUNNING:
        cancelled()
        _raise_if_lora_refused(engine, node)
        if status.refusal:  # the engine refused its settings (config, weights) or this host's session secret:
            raise RuntimeError(f"{node}: {status.message}")  # the bridge's message says which, once
        gone = status.state in (EngineState.DEAD, EngineState.STOPPED)
        if gone or time.monotonic() > deadline:
            tail = "\n".join(status.log_tail or [])
            raise RuntimeError(f"{node}: the engine is {status.state}{'' if gone else f' after {limit_s:.0f} s'}"
                               f": {status.message}" + (f"\n{tail}" if tail else ""))
        time.sleep(CANCEL_POLL_S)


def _raise_if_lora_refused(engine: EngineHandle, node: str) -> None:
    if not engine.loras:
        return
    from loom_live.host_bridge.loras import refused_lora

    stats = engine.bridge.stats()
    found = refused_lora(f"{stats.get('last_error') or ''}\n{stats.get('message') or ''}", engine.loras)
    if found is None:
        return
    choice, words = found
    # else it would fail again and again; a fixed file gets a fresh engine
    ENGINES.close(engine.key, f"it refused the LoRA {choice.name!r}")
    raise RuntimeError(f"{node}: the engine refused the LoRA {choice.name!r}: {words}. Remove it from the "
                       "Loom LoRA chain, or pick one made for this model")


NODE_CLASS_MAPPINGS = {"LoomEngine": LoomEngine, "LoomLora": LoomLora, "LoomPrompt": LoomPrompt,
                       "LoomControl": LoomControl, "LoomStream": LoomStream}
NODE_DISPLAY_NAME_MAPPINGS = {"LoomEngine": "Loom Engine", "LoomLora": "Loom LoRA",
                              "LoomPrompt": "Loom Prompt & Params", "LoomControl": "Loom Control (VACE)",
                              "LoomStream": "Loom Stream Images"}
