"""Draw docs/architecture.png: Loom's packages, its processes, and the path of a frame.

Run from the repository root after changing the layout: `python docs/architecture.py`
(matplotlib, from the `test` extra). The picture is described in words in docs/design.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

HOST, WIRE, ENGINE, RING = "#dbe9f6", "#fff2cc", "#e2f0d9", "#f8cbad"
FRAME, CONTROL = "#c0392b", "#2e75b6"


def _box(ax, x: float, y: float, w: float, h: float, color: str, title: str, lines: tuple[str, ...] = (),
         size: float = 8.5) -> None:
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.12", fc=color, ec="#404040",
                                lw=1.0))
    ax.text(x + 0.12, y + h - 0.1, title, ha="left", va="top", fontsize=size + 1, weight="bold", family="monospace")
    for i, line in enumerate(lines):
        ax.text(x + 0.12, y + h - 0.42 - 0.27 * i, line, ha="left", va="top", fontsize=size, family="monospace")


def _arrow(ax, a: tuple[float, float], b: tuple[float, float], color: str, label: str = "", rad: float = 0.0,
           offset: tuple[float, float] = (0.0, 0.12), style: str = "-|>") -> None:
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle=style, mutation_scale=13, color=color, lw=1.8,
                                 connectionstyle=f"arc3,rad={rad}"))
    if label:
        ax.text((a[0] + b[0]) / 2 + offset[0], (a[1] + b[1]) / 2 + offset[1], label, ha="center", va="bottom",
                fontsize=8, color=color)


def draw(out: Path) -> None:
    fig, ax = plt.subplots(figsize=(15, 8.6))
    ax.set_xlim(0, 15)
    ax.set_ylim(0, 8.6)
    ax.axis("off")

    # the host process
    ax.add_patch(FancyBboxPatch((0.2, 0.3), 5.3, 7.6, boxstyle="round,pad=0.02", fc="white", ec="#7f7f7f", ls="--"))
    ax.text(0.35, 8.05, "host process (TouchDesigner / ComfyUI / loom play)", fontsize=10, weight="bold")
    _box(ax, 0.45, 5.75, 4.8, 1.95, HOST, "plugin/", ("touchdesigner/  loom_ext, callbacks", "comfyui/  nodes",
                                                      "player/  app, controls, osc   cli/  loom",
                                                      "media/  sources, sinks, network_output",
                                                      "live_params  (prompt, steps, noise)"))
    _box(ax, 0.45, 3.2, 4.8, 2.25, HOST, "host_bridge/   (no torch)", ("client.py   Bridge: submit, latest",
                                                                        "newest_frames  output / fallback",
                                                                        "supervisor.py  link, restart",
                                                                        "link.py  launcher.py  config.py",
                                                                        "bridge_stats.py"))
    _box(ax, 0.45, 0.55, 4.8, 2.35, WIRE, "host_bridge/wire/", ("protocol.py  messages, RingSpec",
                                                                "channel.py   control (ZMQ)",
                                                                "doorbell.py  frame_lane.py  notices",
                                                                "rings/  shm | cuda | tcp",
                                                                "pixels.py  typed_config  processes"))

    # the engine process, and the rank processes it spawns for several GPUs
    ax.add_patch(FancyBboxPatch((9.3, 2.2), 5.5, 5.7, boxstyle="round,pad=0.02", fc="white", ec="#7f7f7f", ls="--"))
    ax.text(9.45, 8.05, "engine process  (python -m loom_live.engine serve)", fontsize=10, weight="bold")
    _box(ax, 9.55, 5.75, 5.0, 1.95, ENGINE, "engine/server/", ("core.py  control loop, handshake",
                                                               "frame_worker.py  owns the session",
                                                               "device_frames.py  passthrough.py",
                                                               "session_api.py  EngineSession"))
    _box(ax, 9.55, 2.4, 5.0, 3.05, ENGINE, "engine/stream/", ("session.py  StreamSession.push",
                                                              "frames  motion_noise  prompts",
                                                              "denoiser  schedule  slo_scheduler",
                                                              "output_queue  metrics  stage_timer",
                                                              "engine/models/  wan_dit wan_vae taehv",
                                                              "engine/cache/  kv_cache vae_cache",
                                                              "engine/layers/  engine/graphs/",
                                                              "engine/config.py  engine/tools/"), size=8)
    ax.add_patch(FancyBboxPatch((9.3, 0.3), 5.5, 1.55, boxstyle="round,pad=0.02", fc="white", ec="#7f7f7f", ls="--"))
    _box(ax, 9.55, 0.45, 5.0, 1.25, ENGINE, "engine/parallel/  rank processes 1..N-1",
         ("stage.py link.py ranks.py: DiT blocks", "over torch.distributed (NCCL / gloo)"), size=8)
    _arrow(ax, (12.05, 2.4), (12.05, 1.7), "#555555", style="<|-|>")
    ax.text(12.2, 2.0, "activations", fontsize=8, color="#555555", va="center")

    # the rings between them
    _box(ax, 6.0, 4.75, 2.8, 1.35, RING, "input ring", ("N slots, one frame each", "shm | cuda-ipc | tcp"), size=8)
    _box(ax, 6.0, 2.75, 2.8, 1.35, RING, "output ring", ("host-owned, engine attaches", "generation per size"),
         size=8)

    # the frame path: numbered arrows, explained below the rings
    _arrow(ax, (5.25, 4.9), (6.0, 5.3), FRAME, "1", offset=(-0.1, 0.05))
    _arrow(ax, (8.8, 5.4), (9.55, 6.2), FRAME, "2", offset=(-0.15, 0.05))
    _arrow(ax, (11.2, 5.75), (11.2, 5.45), FRAME, style="<|-|>")
    ax.text(11.35, 5.6, "3", fontsize=9, color=FRAME, va="center")
    _arrow(ax, (9.55, 3.3), (8.8, 3.4), FRAME, "4", offset=(0.0, 0.05))
    _arrow(ax, (6.0, 3.4), (5.25, 3.9), FRAME, "5", offset=(0.0, 0.05))
    ax.text(5.75, 2.45, "frame path (red)\n"
                        "1 Bridge.submit: copy into a free input slot\n"
                        "2 notice on the doorbell (shm, cuda-ipc) or lane (tcp)\n"
                        "3 FrameWorker: session.push / poll\n"
                        "4 write a free output slot, notice back\n"
                        "5 Bridge.latest: the newest output (or fallback)",
            ha="left", va="top", fontsize=8, color=FRAME, linespacing=1.5)

    # the control path
    _arrow(ax, (5.25, 6.75), (9.55, 6.75), CONTROL)
    _arrow(ax, (9.55, 6.45), (5.25, 6.45), CONTROL)
    ax.text(7.4, 7.0, "control (blue): ZMQ, versioned JSON\nhello ready heartbeat ring prompt\n"
                      "params mode stats flush reset bye", ha="center", va="bottom", fontsize=8, color=CONTROL)
    ax.text(7.4, 0.45, "layers: plugin -> host_bridge -> host_bridge/wire <- engine\n"
                       "(tests/unit/test_layers.py keeps them)", ha="center", fontsize=8, style="italic")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("architecture.png"))
    draw(parser.parse_args().out)


if __name__ == "__main__":
    main()
