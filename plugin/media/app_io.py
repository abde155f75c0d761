"""Outputs to other video applications (NDI, Spout, Syphon, a virtual camera) through optional bindings.

A plain install has none of the bindings; asking for ``-o spout://NAME`` without SpoutGL must say
in one line what to install, not show an ImportError traceback. The player drives these sinks like
its network streams: ``write`` one RGB frame, ``close``/``discard`` at the end; nothing is kept on
disk, so there is nothing to finalise or roll back.
"""

from __future__ import annotations

from loom_live.plugin.media.base import AppSink, MediaError

VIRTUALCAM = "virtualcam"
# Output URL schemes of this module; `virtualcam` alone (the system's default virtual camera) too.
APP_OUTPUT_SCHEMES = ("ndi", "spout", "syphon", VIRTUALCAM)


def is_app_output(spec: str) -> bool:
    """Whether ``spec`` names an application output (ndi://, spout://, syphon://, virtualcam)."""
    return spec == VIRTUALCAM or ("://" in spec and spec.split("://", 1)[0].lower() in APP_OUTPUT_SCHEMES)


def target_name(spec: str) -> str:
    """The NAME of ``scheme://NAME``: the name receivers see; an empty one is refused."""
    scheme, _, name = spec.partition("://")
    if not name.strip():
        raise MediaError(f"output {spec!r}: give a name after {scheme}://, e.g. {scheme}://Loom")
    return name.strip()


def open_app_sink(spec: str, fps: float, size: tuple[int, int]) -> AppSink:
    """Open the application output ``spec`` (see ``is_app_output``) for frames of ``size`` at ``fps``."""
    scheme = VIRTUALCAM if spec == VIRTUALCAM else spec.split("://", 1)[0].lower()
    if scheme == "ndi":
        from loom_live.plugin.media.ndi import NdiSink

        return NdiSink(target_name(spec), fps, size)
    if scheme in ("spout", "syphon"):
        from loom_live.plugin.media.gpu_share import SpoutSink, SyphonSink

        return (SpoutSink if scheme == "spout" else SyphonSink)(target_name(spec), fps, size)
    from loom_live.plugin.media.virtualcam import VirtualCamSink

    device = spec.split("://", 1)[1] if "://" in spec else None
    return VirtualCamSink(fps, size, device or None)
