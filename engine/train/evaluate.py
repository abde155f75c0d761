"""The embedded model's card metrics, measured on held-out clips (CPU), and the README picture.

For every held-out clip and style, the clip is streamed through a `StreamSession` of the default
preset with the style's canonical prompt, at the model's resolution, and compared with every
style's procedural target of the same frames:
- style accuracy: the output is nearest (mean absolute error) to its own style's target;
- SSIM against its own target (mean over frames, 11x11 Gaussian window, on each RGB channel);
- temporal: Farneback warp error (engine/quality.py, flow on the input frames) of the output and
  of the target, and Sobel sharpness (mean gradient magnitude) of both; the card gives ratios;
- structure: the edge correlation of the output with the input (and of the target with it);
- texture: `block_grid`, the change across the decoder's 8x8 pixel blocks over the change within them
  (of the output and of the target), which Sobel sharpness cannot tell from real detail.
The ablation runs the same with sinks off (stream.sink=0), motion-aware noise off, and the edge control
off (control.context_scale=0: the model is not given the input's edges), so the card says how much of
the input's structure the edges keep. A last run streams each clip played forward and back past the
first RoPE refresh (the held-out clips are shorter than one), where the cached frames' positions move
back: the change at the chunk boundaries around it says whether the stream pulses there.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import cv2
import numpy as np

from loom_live.engine.train.data import HELD_OUT, MEDIA, read_clip
from loom_live.engine.train.styles import STYLES, apply_style
from loom_live.host_bridge.wire.files import write_replacing

SIZE = 256
GATE_PSNR = 30.0  # dB: the VAE's reconstruction gate (issue 29), per held-out clip and style
GATE_SATURATION = 0.10  # mean saturation within this fraction of the input's
ABLATION_FRAMES = 49  # both held-out clips have at least this many
GRID_STYLE = 1.5  # a target's block_grid above this: its style is drawn in blocks (pixel art)
LOOPED_RUN = "looped past a RoPE refresh"
ABLATIONS = {"default": [], "sinks off": ["stream.sink=0"], "motion-aware off": ["noise.motion_aware=false"],
             "control off": ["control.context_scale=0"]}


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    """Mean SSIM of two uint8 RGB frames (Wang et al. 2004 constants, Gaussian window 11, sigma 1.5)."""
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    x, y = a.astype(np.float64), b.astype(np.float64)

    def blur(t: np.ndarray) -> np.ndarray:
        return cv2.GaussianBlur(t, (11, 11), 1.5)

    mx, my = blur(x), blur(y)
    vx, vy, cxy = blur(x * x) - mx * mx, blur(y * y) - my * my, blur(x * y) - mx * my
    s = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx * mx + my * my + c1) * (vx + vy + c2))
    return float(s.mean())


def sharpness(frames: np.ndarray) -> float:
    """Mean Sobel gradient magnitude of the grey frames (0..~1000)."""
    vals = []
    for f in frames:
        g = cv2.cvtColor(f, cv2.COLOR_RGB2GRAY).astype(np.float32)
        vals.append(np.sqrt(cv2.Sobel(g, cv2.CV_32F, 1, 0) ** 2 + cv2.Sobel(g, cv2.CV_32F, 0, 1) ** 2).mean())
    return float(np.mean(vals))


def block_grid(frames: np.ndarray, block: int = 8) -> float:
    """How much more the grey image changes across the borders of the decoder's `block` x `block` pixel
    blocks (one latent pixel each) than elsewhere: the mean absolute difference of neighbouring pixels
    on either side of a border over that of the pixels within a block, both directions. About 1 for a
    picture the grid does not shape; a model that buys sharpness with a block texture (each latent
    pixel its own blob) shows it here, where the Sobel sharpness rewards it."""
    g = np.stack([cv2.cvtColor(f, cv2.COLOR_RGB2GRAY) for f in frames]).astype(np.float32)
    ratios = []
    for d in (np.abs(np.diff(g, axis=2)), np.abs(np.diff(g, axis=1)).transpose(0, 2, 1)):
        border = (np.arange(d.shape[2]) + 1) % block == 0  # between pixel block*k - 1 and block*k
        ratios.append(d[..., border].mean() / max(float(d[..., ~border].mean()), 0.5))  # flat blocks: per level
    return float(np.mean(ratios))


def edge_map(frame: np.ndarray) -> np.ndarray:
    """Edge strength of a uint8 RGB frame: the grey frame blurred 5x5, its Sobel magnitude (the measure the
    embedded model reads as its structure control, engine/models/dit_source.py, up to a constant)."""
    g = cv2.GaussianBlur(cv2.cvtColor(frame, cv2.COLOR_RGB2GRAY).astype(np.float32), (5, 5), 0)
    return np.sqrt(cv2.Sobel(g, cv2.CV_32F, 1, 0) ** 2 + cv2.Sobel(g, cv2.CV_32F, 0, 1) ** 2)


def edge_correlation(frames: np.ndarray, inputs: np.ndarray) -> float:
    """Pearson correlation of the edge maps of `frames` and `inputs` (uint8 RGB [T, H, W, 3]) over every
    pixel of every frame: 1 where the edges are where the input's are (at any strength), ~0 where they
    are unrelated. Either side without any variation (a flat clip) has no structure to share: 0."""
    a = np.stack([edge_map(f) for f in frames]).ravel().astype(np.float64)
    b = np.stack([edge_map(f) for f in inputs]).ravel().astype(np.float64)
    a, b = a - a.mean(), b - b.mean()
    norm = np.sqrt((a * a).sum() * (b * b).sum())
    return float((a * b).sum() / norm) if norm > 0 else 0.0


def change_ratios(frames: np.ndarray, first_chunk: int = 5, chunk: int = 4) -> tuple[float, float]:
    """(mean change at chunk boundaries, largest change) over the mean consecutive-frame change:
    a stream that pulses at its chunk boundaries, cache wraps or RoPE refreshes shows up here."""
    d = np.abs(np.diff(frames.astype(np.float32), axis=0)).mean(axis=(1, 2, 3))  # d[t-1]: frame t vs t-1
    mean = max(float(d.mean()), 1e-6)
    starts = [t for t in range(first_chunk, len(frames), chunk)]
    boundary = float(np.mean([d[t - 1] for t in starts])) if starts else 0.0
    return boundary / mean, float(d.max()) / mean


def refresh_change(frames: np.ndarray, refresh_at: int, around: int = 2, first_chunk: int = 5,
                   chunk: int = 4) -> float:
    """The largest change at a chunk boundary within `around` latents of the first RoPE refresh, over
    the mean consecutive-frame change. The refresh moves back the first chunk that would pass latent
    `refresh_at`; which one that is depends on the chunk sizes the scheduler chose, hence the window."""
    d = np.abs(np.diff(frames.astype(np.float32), axis=0)).mean(axis=(1, 2, 3))
    latents = range(max(1, refresh_at - around), refresh_at + around + 1)
    starts = [first_chunk + chunk * (k - 2) for k in latents if 0 < first_chunk + chunk * (k - 2) < len(frames)]
    if not starts:
        raise ValueError(f"{len(frames)} frames do not reach the refresh at latent {refresh_at}")
    return float(max(d[t - 1] for t in starts)) / max(float(d.mean()), 1e-6)


def refresh_frames(refresh_at: int, after: int = 3) -> int:
    """Frames of a stream that reaches `after` latents past latent `refresh_at` (5 frames, then 4 a latent)."""
    return 5 + 4 * (refresh_at + after - 1)


def looped(frames: np.ndarray, n: int) -> np.ndarray:
    """`frames` played forward, then back, then forward... to `n` frames (no jump at the turns)."""
    cycle = np.concatenate([frames, frames[-2:0:-1]])
    return np.concatenate([cycle] * -(-n // len(cycle)))[:n]


def colour_error(out: np.ndarray, target: np.ndarray) -> tuple[float, float]:
    """(mean chroma error, mean hue error in degrees) in CIELAB, hue over the target's coloured pixels."""
    def lab(f: np.ndarray) -> np.ndarray:
        flat = np.ascontiguousarray(f.reshape(-1, f.shape[-2], 3))
        return cv2.cvtColor(flat.astype(np.float32) / 255.0, cv2.COLOR_RGB2LAB)

    a, b = lab(out), lab(target)
    ca, cb = np.hypot(a[..., 1], a[..., 2]), np.hypot(b[..., 1], b[..., 2])
    coloured = cb > 10.0
    hue = np.abs(np.angle(np.exp(1j * (np.arctan2(a[..., 2], a[..., 1]) - np.arctan2(b[..., 2], b[..., 1])))))
    hue_err = float(np.degrees(hue[coloured]).mean()) if coloured.any() else 0.0
    return float(np.abs(ca - cb).mean()), hue_err


def warp_error(inputs: np.ndarray, outputs: np.ndarray) -> float:
    from loom_live.engine.tools.quality import evaluate_frames

    return float(evaluate_frames(inputs, outputs).totals["warp_error"])


def stylise(frames: np.ndarray, prompt: str, overrides: list[str] = (), weights: str | None = None,
            chunk: int = 4) -> np.ndarray:
    """Stream frames through the default preset with one prompt; returns one output per frame."""
    from loom_live.engine.config import load_config
    from loom_live.engine.stream.session import StreamSession

    sets = [f"prompt.text={prompt}", *overrides]
    if weights:
        sets.append(f"model.checkpoint={weights}")
    with StreamSession.from_config(load_config("default", sets)) as s:
        outs = [s.push(frames[i:i + chunk]) for i in range(0, len(frames), chunk)]
        outs.append(s.flush())
    return np.concatenate([o for o in outs if len(o)])


def held_out(frames: int) -> dict[str, np.ndarray]:
    return {Path(n).stem: read_clip(MEDIA / n, SIZE, limit=frames) for n in HELD_OUT}


def measure(clips: dict[str, np.ndarray], overrides: list[str], styles=STYLES, weights: str | None = None,
            refresh_at: int | None = None) -> list[dict]:
    rows = []
    for clip, frames in clips.items():
        targets = {s.name: apply_style(s.name, frames) for s in STYLES}
        for style in styles:
            t = time.perf_counter()
            out = stylise(frames, style.prompt, overrides, weights)
            mae = {n: float(np.abs(out.astype(np.float32) - tg).mean()) for n, tg in targets.items()}
            own = targets[style.name]
            rows.append({
                "clip": clip, "style": style.name, "nearest": min(mae, key=mae.get), "mae": mae[style.name],
                "ssim": float(np.mean([ssim(o, g) for o, g in zip(out, own)])),
                "warp_error": warp_error(frames, out), "target_warp_error": warp_error(frames, own),
                "sharpness": sharpness(out), "target_sharpness": sharpness(own),
                "block_grid": block_grid(out), "target_block_grid": block_grid(own),
                "edge_correlation": edge_correlation(out, frames),
                "target_edge_correlation": edge_correlation(own, frames),
                **dict(zip(("chroma_error", "hue_error"), colour_error(out, own))),
                **dict(zip(("boundary_change", "max_change"), change_ratios(out))),
                **({"refresh_change": refresh_change(out, refresh_at)} if refresh_at else {}),
                "seconds": round(time.perf_counter() - t, 1)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _grid_summary(rows: list[dict]) -> dict:
    """The mean `block_grid` of output and target over the pairs whose target has no blocks of its own
    (pixel art's cells sit on the same 8-pixel grid: there the blocks are the style)."""
    rows = [r for r in rows if "block_grid" in r and r["target_block_grid"] < GRID_STYLE]
    if not rows:
        return {}
    return {k: float(np.mean([r[k] for r in rows])) for k in ("block_grid", "target_block_grid")}


def saturation(frames: np.ndarray) -> float:
    """Mean HSV saturation (0..255) of [T, H, W, 3] uint8 RGB frames."""
    flat = np.ascontiguousarray(frames.reshape(-1, frames.shape[-2], 3))
    return float(cv2.cvtColor(flat, cv2.COLOR_RGB2HSV)[..., 1].mean())


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 10.0 * np.log10(255.0 ** 2 / max(mse, 1e-10))


def reconstruction(vae, clips: list, device) -> list[dict]:
    """The VAE alone (streamed encode, then decode) on every clip's source and styles: PSNR and mean
    saturation against the input. `clips` are `engine.train.data.Clip`s."""
    import torch

    rows = []
    with torch.inference_mode():
        for clip in clips:
            for variant, frames in clip.frames.items():
                frames = frames[:1 + 4 * ((len(frames) - 1) // 4)]
                x = torch.from_numpy(frames).to(device).permute(3, 0, 1, 2)[None].float().div(127.5).sub(1.0)
                y = vae.decode(vae.encode(x))[0].permute(1, 2, 3, 0)
                out = y.add(1.0).mul(127.5).round().clamp(0, 255).to(torch.uint8).cpu().numpy()
                rows.append({"clip": clip.name, "variant": variant, "psnr": round(psnr(out, frames), 2),
                             "saturation_in": round(saturation(frames), 1),
                             "saturation_out": round(saturation(out), 1)})
    return rows


def gate_summary(rows: list[dict]) -> dict:
    """Which (clip, variant) pairs miss the reconstruction gate, and the worst figures."""
    def sat_ok(r: dict) -> bool:
        return abs(r["saturation_out"] - r["saturation_in"]) <= GATE_SATURATION * max(r["saturation_in"], 1.0)

    misses = [f"{r['clip']}/{r['variant']}" for r in rows if r["psnr"] < GATE_PSNR or not sat_ok(r)]
    return {"pairs": len(rows), "passes": len(rows) - len(misses), "misses": misses,
            "psnr_min": min(r["psnr"] for r in rows), "psnr_mean": float(np.mean([r["psnr"] for r in rows]))}


def summary(rows: list[dict]) -> dict:
    def mean(key: str) -> float:
        return float(np.mean([r[key] for r in rows]))

    return {"pairs": len(rows), "nearest_own": float(np.mean([r["nearest"] == r["style"] for r in rows])),
            "ssim": mean("ssim"), "ssim_min": float(min(r["ssim"] for r in rows)),
            "warp_error": mean("warp_error"), "target_warp_error": mean("target_warp_error"),
            "warp_ratio": mean("warp_error") / mean("target_warp_error"),
            "sharpness": mean("sharpness"), "target_sharpness": mean("target_sharpness"),
            "sharpness_ratio": mean("sharpness") / mean("target_sharpness"),
            "boundary_change": mean("boundary_change"), "max_change": float(max(r["max_change"] for r in rows)),
            **_grid_summary(rows),
            **({k: mean(k) for k in ("edge_correlation", "target_edge_correlation")}
               if all("edge_correlation" in r for r in rows) else {}),
            **({"refresh_change": mean("refresh_change"),
                "refresh_change_max": float(max(r["refresh_change"] for r in rows))}
               if all("refresh_change" in r for r in rows) else {})}


def main(weights: str | None, out: str, frames: int = 49, ablation_styles: int = 2,
         ablation_frames: int = ABLATION_FRAMES) -> dict:
    """Every style on the held-out clips' first `frames`, then the ablations on a few styles over
    `ablation_frames`: sinks only matter once the KV window has evicted, so the ablations run longer
    than the window (13 latent frames against 6), and beside a default run of the same frames; then
    every style over the clips looped past the first RoPE refresh (`refresh_frames`)."""
    import torch

    from loom_live.engine.config import load_config

    partial = writable(out, "the JSON report")  # a wrong --out fails now, not after the whole evaluation
    if weights:
        check_weights(weights)
    torch.set_num_threads(2)
    clips, long_clips = held_out(frames), held_out(max(frames, ablation_frames))
    refresh_at = load_config("default").stream.rope_refresh_at
    n_refresh = refresh_frames(refresh_at)
    looped_clips = {name: looped(c, n_refresh) for name, c in long_clips.items()}
    report = {"frames": frames, "ablation_frames": max(frames, ablation_frames), "size": SIZE,
              "clips": list(clips), "runs": {}}
    ablated = STYLES[:: max(1, len(STYLES) // ablation_styles)][:ablation_styles]
    runs = [("default", [], STYLES, clips, frames), ("default (ablation styles)", [], ablated, long_clips,
                                                     max(frames, ablation_frames))]
    runs += [(name, overrides, ablated, long_clips, max(frames, ablation_frames))
             for name, overrides in ABLATIONS.items() if overrides]
    runs.append((LOOPED_RUN, [], STYLES, looped_clips, n_refresh))
    for name, overrides, styles, on, n in runs:
        rows = measure(on, overrides, styles, weights, refresh_at if name == LOOPED_RUN else None)
        report["runs"][name] = {"overrides": overrides, "styles": [s.name for s in styles], "frames": n,
                                "rows": rows, "summary": summary(rows)}
        # each run's rows as they come, beside the report: an earlier complete report stays until this one is
        # whole, and the last run's write is the whole report, moved into place
        partial.write_text(json.dumps(report, indent=1))
    os.replace(partial, out)
    return report


def writable(out: str | Path, what: str) -> Path:
    """OUT.partial, beside `out` (a file path whose folder can be made and written): a wrong --out is a
    one-line error before any work, not a traceback after it."""
    path = Path(out)
    if path.is_dir():
        raise ValueError(f"--out {out}: a folder; expected a file path for {what}")
    partial = path.with_name(path.name + ".partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        existed = partial.exists()  # an interrupted run's rows: kept until this run has its own
        with open(partial, "ab"):
            pass
        if not existed:
            partial.unlink()
    except OSError as exc:
        raise ValueError(f"--out {out}: cannot write there ({exc.strerror or exc}: {exc.filename})") from None
    return partial


def check_weights(weights: str) -> None:
    """A --weights file that is missing, damaged or of another layout: a one-line error before any work."""
    import torch
    from safetensors import SafetensorError

    from loom_live.engine.models.embedded import EmbeddedWeightsError, load_embedded

    if not Path(weights).is_file():
        raise FileNotFoundError(f"--weights {weights}: no such file")
    try:
        load_embedded(torch.device("cpu"), torch.float32, weights)
    except (EmbeddedWeightsError, SafetensorError, KeyError, ValueError) as exc:
        raise ValueError(f"--weights {weights}: not weights of the embedded model "
                         f"({str(exc).removeprefix(f'{weights}: ')})") from None


def picture(out: str = "docs/embedded-styles.png", clip: str = "davis512_parkour.mp4",
            styles: tuple[str, ...] = ("pencil sketch", "thermal camera", "pop art poster", "sepia film"),
            at: tuple[int, ...] = (4, 12, 20)) -> Path:
    """Input frames (rows: three moments of a held-out clip) beside four styles made by the model."""
    from tqdm import tqdm

    path = Path(out)
    if not cv2.haveImageWriter(str(path)):
        raise ValueError(f"--out {out}: expected an image file name (.png, .jpg, .webp)")
    writable(path, "the picture")
    frames = read_clip(MEDIA / clip, SIZE, limit=max(at) + 1)
    columns = [frames[list(at)]] + [stylise(frames, p)[list(at)] for p in tqdm(styles, desc="picture", unit="style")]
    pad = 4
    h, w = SIZE, SIZE
    label_h = 22
    canvas = np.full((label_h + len(at) * (h + pad), len(columns) * (w + pad), 3), 255, np.uint8)
    for j, (col, name) in enumerate(zip(columns, ("input", *styles))):
        cv2.putText(canvas, name, (j * (w + pad) + 4, 16), cv2.FONT_HERSHEY_SIMPLEX, 0.5, (0, 0, 0), 1, cv2.LINE_AA)
        for i, f in enumerate(col):
            y, x = label_h + i * (h + pad), j * (w + pad)
            canvas[y:y + h, x:x + w] = f
    ok, encoded = cv2.imencode(path.suffix, cv2.cvtColor(canvas, cv2.COLOR_RGB2BGR))
    if not ok:
        raise ValueError(f"--out {out}: OpenCV could not encode the picture as {path.suffix}")
    write_replacing(path, lambda f: f.write(encoded.tobytes()))  # an earlier picture stays until this one is whole
    return path


def tables(report: dict) -> str:
    """The model card's metric tables (markdown) from an eval report."""
    lines = ["| clip | style | nearest target | SSIM | warp error (target) | sharpness (target) | "
             "edge corr. with input (target) |", "|---|---|---|---|---|---|---|"]
    for r in report["runs"]["default"]["rows"]:
        ok = "yes" if r["nearest"] == r["style"] else f"no ({r['nearest']})"
        lines.append(f"| {r['clip'].replace('davis512_', '')} | {r['style']} | {ok} | {r['ssim']:.2f} | "
                     f"{r['warp_error']:.2f} ({r['target_warp_error']:.2f}) | {r['sharpness']:.1f} "
                     f"({r['target_sharpness']:.1f}) | {_edges_cell(r)} |")
    lines += ["", "| run | styles | pairs | nearest own | SSIM | warp error / target's | sharpness / target's | "
              "edge corr. with input (target's) | chunk-boundary change (near the RoPE refresh: mean, max) | "
              "block grid (target's) | frames |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, run in report["runs"].items():
        s = run["summary"]
        styles = run.get("styles", [])
        styles = "all" if name == "default" or len(styles) == len(STYLES) else ", ".join(styles)
        frames = run.get("frames", report.get("frames" if name == "default" else "ablation_frames",
                                              report.get("frames", "-")))
        lines.append(f"| {name} | {styles} | {s['pairs']} | {s['nearest_own']:.0%} | {s['ssim']:.2f} | "
                     f"{s['warp_error']:.2f} / {s['target_warp_error']:.2f} = {s['warp_ratio']:.2f} | "
                     f"{s['sharpness']:.1f} / {s['target_sharpness']:.1f} = {s['sharpness_ratio']:.2f} | "
                     f"{_edges_cell(s)} | {_boundary_cell(s)} | {_grid_cell(s)} | {frames} |")
    return "\n".join(lines)


def _grid_cell(s: dict) -> str:
    return f"{s['block_grid']:.2f} ({s['target_block_grid']:.2f})" if "block_grid" in s else "-"


def _boundary_cell(s: dict) -> str:
    """A summary's chunk-boundary change and, for a run past a refresh, the change near it."""
    cell = f"{s['boundary_change']:.2f}x"
    if "refresh_change" in s:
        cell += f" ({s['refresh_change']:.2f}x, {s['refresh_change_max']:.2f}x)"
    return cell


def _edges_cell(r: dict) -> str:
    """A row's or summary's edge correlation (its target's); a report from before the measure: not measured."""
    if "edge_correlation" not in r:
        return "-"
    return f"{r['edge_correlation']:.2f} ({r['target_edge_correlation']:.2f})"
