"""The seam between the engine server and a model family: what a streaming session must offer.

The server drives any object of this shape and nothing else: it never probes a session for
optional attributes. A model family (the causal Wan DiT in `engine.stream`, the pass-through in
`engine.server.passthrough`, further families beside them) plugs in behind the same server,
bridge and hosts by implementing it. Frames are uint8 [N, H, W, 3] RGB, numpy arrays, or torch
tensors on the session's device where `accepts_device_frames` is true.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from loom_live.engine.graphs.compile_cache import enable_persistent_compile_cache


@runtime_checkable
class EngineSession(Protocol):
    """A stream of frames in, restyled frames out, in order, steered by prompt and live params."""

    @property
    def accepts_device_frames(self) -> bool:
        """True when `push` takes torch tensors on the session's device (the cuda-ipc path)."""

    @property
    def raw_passthrough(self) -> bool:
        """True when outputs are the inputs untouched, so the server may copy ring to ring."""

    @property
    def unfinished(self) -> int:
        """Outputs still being computed, collected by `poll` (chunks or frames: the server only asks
        whether there are any, to decide how soon to poll)."""

    def push(self, frames: Any, control: Any = None) -> Any:
        """Take N frames; return the finished outputs (possibly none), oldest first. `control`: the host's
        control frames, one per frame (VACE); a model without control blocks counts them and goes on."""

    def poll(self, wait: bool = False) -> Any:
        """Outputs finished since the last call; with `wait`, block until the oldest is done."""

    def flush(self) -> Any:
        """End the stream: every remaining output, then a state ready for a new stream."""

    def while_waiting(self, fn: Callable[[], None] | None) -> None:
        """Have `fn` called on the calling thread, between short looks, while `push`, `poll` or `flush` waits
        for the device (None: wait plainly). The server hands out its paced outputs and takes the host's
        notices there, on time, instead of in a burst when a chunk's wait ends. `fn` never calls the session."""

    def set_prompt(self, text: str, transition_chunks: int | None = None) -> None:
        """Change the prompt, blended over that many chunks; raises ValueError when refused."""

    def set_params(self, **params: Any) -> None:
        """Change live parameters (the shared schema's names); raises ValueError when refused."""

    def set_reference(self, image: Any) -> None:
        """A new reference image (uint8 RGB [H, W, 3], or None for none) from the next chunk on (VACE);
        raises ValueError when the model takes none."""

    def reset(self) -> None:
        """Start a new stream: caches, motion state and queues back to their start."""

    def stats(self) -> dict[str, Any]:
        """Telemetry for the host's status, cheap enough to call several times a second."""

    def close(self) -> None:
        """Release the session's device resources."""


def check_devices(cfg: Any) -> None:
    """The devices `open_session(cfg)` would run on are here: `model.device`, and with `parallel.gpus > 1`
    one GPU per pipeline rank and a split the model's blocks allow. ValueError naming the setting and what
    is allowed; nothing is loaded or started, so an engine checks this before it serves."""
    if cfg.parallel.gpus > 1:
        from loom_live.engine.parallel.session import check_pipeline

        check_pipeline(cfg)
    else:
        from loom_live.engine.models.loading import resolve_device

        resolve_device(cfg.model.device)


def open_session(cfg: Any, warmup: bool = True, warmup_share: float = 1.0) -> EngineSession:
    """The session for the config's model family (`model.family`), loaded and warmed up (on a GPU; paced to
    `warmup_share` of the time below 1: a standby beside a show); with `parallel.gpus > 1` the Wan DiT's
    pipeline over that many GPUs (this process is its rank 0).

    Whoever opens it (a served engine, `loom bench`, `loom prepare`), its compiled code goes to the same
    persistent compile cache, so what one of them compiled the next start of that config reads."""
    enable_persistent_compile_cache()
    if cfg.parallel.gpus > 1:
        from loom_live.engine.parallel.session import PipelineSession

        return PipelineSession.from_config(cfg, warmup=warmup, warmup_share=warmup_share)
    if cfg.model.family == "edit":
        from loom_live.engine.edit.session import EditSession

        return EditSession.from_config(cfg, warmup=warmup, warmup_share=warmup_share)
    from loom_live.engine.stream.session import StreamSession

    return StreamSession.from_config(cfg, warmup=warmup, warmup_share=warmup_share)
