"""The embedded model's styles: procedural, temporally stable video looks made with OpenCV/numpy.

Each style is a pure function of one RGB uint8 frame (no per-frame randomness, no state), so a
still scene gives a still result and a moving one moves with it: the model that learns them has
nothing to flicker about. Static overlays (paper tint, vignette, grid) are fixed in screen space.
The functions are size-agnostic (sizes in the recipes scale with the frame), tuned at 192x192.

`STYLES` is the one list: name, the function, and free-text descriptions. The first description
is the style's canonical prompt (the model's text condition); all of them seed the text table
(`engine.train.text_table`) that maps a user's prompt to a style.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import cv2
import numpy as np

Frame = np.ndarray  # [H, W, 3] uint8 RGB


@dataclass(frozen=True)
class Style:
    name: str
    apply: Callable[[Frame], Frame]
    descriptions: tuple[str, ...]

    @property
    def prompt(self) -> str:
        return self.descriptions[0]


def _grey(frame: Frame) -> np.ndarray:
    return cv2.cvtColor(frame, cv2.COLOR_RGB2GRAY)


def _scale(frame: Frame, fraction: float) -> int:
    """An odd kernel size proportional to the frame's shorter side."""
    k = max(1, int(round(min(frame.shape[:2]) * fraction)))
    return k | 1


def _edges(grey: np.ndarray, blur: int) -> np.ndarray:
    """Edge strength in [0, 1] (1 = a full black-white step) from a smoothed Sobel magnitude;
    callers map it through soft ramps, not hard thresholds, so edges fade rather than pop."""
    g = cv2.GaussianBlur(grey, (blur, blur), 0).astype(np.float32)
    gx = cv2.Sobel(g, cv2.CV_32F, 1, 0, ksize=3)
    gy = cv2.Sobel(g, cv2.CV_32F, 0, 1, ksize=3)
    return np.clip(np.sqrt(gx * gx + gy * gy) / (4.0 * 255.0), 0.0, 1.0)


def _to_rgb(grey: np.ndarray) -> Frame:
    return cv2.cvtColor(np.clip(grey, 0, 255).astype(np.uint8), cv2.COLOR_GRAY2RGB)


def _tint(grey01: np.ndarray, dark: tuple[int, int, int], light: tuple[int, int, int]) -> Frame:
    """Map a [0, 1] grey image between two RGB colours."""
    d, li = np.array(dark, np.float32), np.array(light, np.float32)
    return np.clip(d + grey01[..., None] * (li - d), 0, 255).astype(np.uint8)


def pencil_sketch(frame: Frame) -> Frame:
    """Colour-dodge of the grey image by its blurred negative: graphite lines on paper."""
    g = _grey(frame).astype(np.float32)
    blur = cv2.GaussianBlur(255.0 - g, (_scale(frame, 0.11), _scale(frame, 0.11)), 0)
    sketch = np.clip(g * 255.0 / np.maximum(255.0 - blur, 1.0), 0, 255) / 255.0
    sketch = sketch ** 2.2  # darker, more visible strokes
    return _tint(sketch, (40, 40, 45), (250, 247, 238))


def watercolour(frame: Frame) -> Frame:
    """Edge-preserving smoothing, soft colour pooling, light pigment edges on white paper."""
    smooth = cv2.bilateralFilter(frame, 9, 60, 9)
    smooth = cv2.bilateralFilter(smooth, 9, 60, 9)
    hsv = cv2.cvtColor(smooth, cv2.COLOR_RGB2HSV).astype(np.float32)
    hsv[..., 1] *= 0.75
    hsv[..., 2] = 90 + 0.7 * hsv[..., 2]
    wash = cv2.cvtColor(np.clip(hsv, 0, 255).astype(np.uint8), cv2.COLOR_HSV2RGB).astype(np.float32)
    edge = np.clip(_edges(_grey(smooth), 5) * 6.0 - 0.3, 0, 1)[..., None]
    out = wash * (1.0 - 0.5 * edge)
    return np.clip(out, 0, 255).astype(np.uint8)


TOON_INK = np.array([40, 36, 50], np.float32)  # outline colour: dark grey-violet ink


def toon(frame: Frame) -> Frame:
    """Cartoon: flat colour bands (smoothed, quantised) with dark ink outlines. The ink is a dark grey
    rather than black: a colour faded to black passes through dark pixels of loud hue, which any
    codec (H.264 as much as Loom's VAE) turns into hue noise; faded to grey ink it stays calm."""
    smooth = cv2.bilateralFilter(frame, 9, 80, 9)
    levels = 5
    q = (np.floor(smooth.astype(np.float32) / 256.0 * levels) + 0.5) * (256.0 / levels)
    hsv = cv2.cvtColor(np.clip(q, 0, 255).astype(np.uint8), cv2.COLOR_RGB2HSV).astype(np.float32)
    hsv[..., 1] = np.clip(hsv[..., 1] * 1.4, 0, 255)
    flat = cv2.cvtColor(hsv.astype(np.uint8), cv2.COLOR_HSV2RGB).astype(np.float32)
    edge = np.clip(_edges(_grey(frame), 5) * 8.0 - 0.8, 0, 1)[..., None]
    return np.clip(flat * (1.0 - edge) + TOON_INK * edge, 0, 255).astype(np.uint8)


def ink_wash(frame: Frame) -> Frame:
    """Sumi-e: a few soft grey washes and dark brush edges on cream rice paper."""
    g = cv2.bilateralFilter(_grey(frame), 9, 50, 9).astype(np.float32) / 255.0
    washes = np.round(g * 4.0) / 4.0
    washes = cv2.GaussianBlur(washes, (5, 5), 0)
    edge = np.clip(_edges((g * 255).astype(np.uint8), 5) * 6.0 - 0.4, 0, 1)
    ink = np.clip(0.15 + 0.85 * washes - 0.8 * edge, 0, 1)
    return _tint(ink, (20, 20, 25), (242, 234, 214))


def thermal(frame: Frame) -> Frame:
    """Thermal camera: smoothed brightness through the inferno colour map."""
    g = cv2.GaussianBlur(_grey(frame), (_scale(frame, 0.03), _scale(frame, 0.03)), 0)
    g = cv2.equalizeHist(g) // 2 + g // 2
    return cv2.cvtColor(cv2.applyColorMap(g, cv2.COLORMAP_INFERNO), cv2.COLOR_BGR2RGB)


def neon_edges(frame: Frame) -> Frame:
    """Glowing neon outlines in the scene's own (saturated) colours on black."""
    edge = np.clip(_edges(_grey(frame), 5) * 7.0 - 0.35, 0, 1)
    hsv = cv2.cvtColor(frame, cv2.COLOR_RGB2HSV)
    hsv[..., 1], hsv[..., 2] = 255, 255
    colour = cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB).astype(np.float32)
    line = colour * edge[..., None]
    glow = cv2.GaussianBlur(line, (_scale(frame, 0.05), _scale(frame, 0.05)), 0)
    return np.clip(line + 1.5 * glow, 0, 255).astype(np.uint8)


PICO8 = np.array([
    (0, 0, 0), (29, 43, 83), (126, 37, 83), (0, 135, 81), (171, 82, 54), (95, 87, 79), (194, 195, 199),
    (255, 241, 232), (255, 0, 77), (255, 163, 0), (255, 236, 39), (0, 228, 54), (41, 173, 255),
    (131, 118, 156), (255, 119, 168), (255, 204, 170)], np.float32)


def pixel_art(frame: Frame) -> Frame:
    """8-bit game look: 6-pixel blocks in a fixed 16-colour palette."""
    h, w = frame.shape[:2]
    block = max(2, min(h, w) // 32)
    small = cv2.resize(frame, (w // block, h // block), interpolation=cv2.INTER_AREA).astype(np.float32)
    small = small * 1.2 + 12.0  # brighter, so dark footage still uses the palette
    dist = ((small[:, :, None, :] - PICO8[None, None]) ** 2).sum(-1)
    quant = PICO8[dist.argmin(-1)].astype(np.uint8)
    return cv2.resize(quant, (w, h), interpolation=cv2.INTER_NEAREST)


def _vignette(h: int, w: int, strength: float) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    r = np.sqrt(((x - w / 2) / (w / 2)) ** 2 + ((y - h / 2) / (h / 2)) ** 2) / np.sqrt(2)
    return 1.0 - strength * r ** 2


def sepia_film(frame: Frame) -> Frame:
    """Old film: sepia toning, softened contrast, darkened corners."""
    f = frame.astype(np.float32)
    m = np.array([[0.393, 0.769, 0.189], [0.349, 0.686, 0.168], [0.272, 0.534, 0.131]], np.float32)
    sep = f @ m.T
    sep = 0.85 * sep + 20
    sep *= _vignette(*frame.shape[:2], 0.7)[..., None]
    return np.clip(sep, 0, 255).astype(np.uint8)


def blueprint(frame: Frame) -> Frame:
    """Technical blueprint: white line work on cyanotype blue with a faint grid."""
    h, w = frame.shape[:2]
    edge = np.clip(_edges(_grey(frame), 5) * 10.0 - 0.5, 0, 1)
    grid = np.zeros((h, w), np.float32)
    step = max(4, min(h, w) // 12)
    grid[::step, :] = 0.18
    grid[:, ::step] = 0.18
    lum = np.maximum(edge, grid)
    return _tint(lum, (22, 64, 140), (235, 245, 255))


POP = np.array([(20, 20, 60), (230, 30, 120), (40, 200, 230), (255, 230, 40)], np.float32)


def _soft_levels(g: np.ndarray, palette: np.ndarray, band: float) -> np.ndarray:
    """Posterise g (in level units, 0..len(palette)) to the palette with a smoothstep `band` wide
    around each threshold: flat fields with clean, anti-aliased borders instead of hard steps."""
    top = len(palette) - 1
    base = np.clip(np.floor(g), 0, top)
    frac = g - base
    up = np.clip((frac - (1.0 - band / 2)) / band, 0.0, 1.0)  # towards the next level
    down = np.clip((frac + band / 2) / band, 0.0, 1.0)  # coming from the level below
    up, down = up * up * (3 - 2 * up), down * down * (3 - 2 * down)
    here = palette[base.astype(np.int32)]
    above = palette[np.clip(base + 1, 0, top).astype(np.int32)]
    below = palette[np.clip(base - 1, 0, top).astype(np.int32)]
    rising = here + (above - here) * up[..., None]
    falling = below + (here - below) * (0.5 + 0.5 * down[..., None])
    return np.where((frac < band / 2)[..., None], falling, rising)


def pop_art(frame: Frame) -> Frame:
    """Warhol-style poster: four flat, loud colours by brightness with black contours around them.
    The level map is drawn at a quarter of the frame's side and smoothly enlarged, and the contours
    follow the level map rather than the raw picture, so textured ground (grass, gravel, water)
    becomes a few flat fields instead of speckle that no video codec (or VAE) keeps."""
    h, w = frame.shape[:2]
    g = cv2.equalizeHist(cv2.bilateralFilter(_grey(frame), 9, 60, 9))
    small = cv2.resize(g, (max(1, w // 4), max(1, h // 4)), interpolation=cv2.INTER_AREA)
    levels = cv2.resize(small, (w, h), interpolation=cv2.INTER_CUBIC).astype(np.float32) / 255.0 * len(POP)
    poster = _soft_levels(levels, POP, 0.5)
    level_grey = np.clip(levels / len(POP) * 255.0, 0, 255).astype(np.uint8)
    edge = np.clip(_edges(level_grey, 5) * 6.0 - 0.6, 0, 1)[..., None]
    return np.clip(poster * (1.0 - edge), 0, 255).astype(np.uint8)


STYLES: tuple[Style, ...] = (
    Style("pencil_sketch", pencil_sketch, (
        "pencil sketch", "graphite drawing on paper", "hand drawn sketch", "black and white pencil lines",
        "sketchbook drawing", "line drawing")),
    Style("watercolour", watercolour, (
        "watercolour painting", "watercolor painting", "soft wet paint washes", "aquarelle on paper",
        "pastel painted look")),
    Style("toon", toon, (
        "cartoon", "toon shading with outlines", "comic book animation", "cel shaded anime look",
        "flat colours like an animated film")),
    Style("ink_wash", ink_wash, (
        "ink wash painting", "chinese brush painting", "sumi-e ink", "monochrome brush and ink",
        "japanese calligraphy ink art")),
    Style("thermal", thermal, (
        "thermal camera", "heat vision", "thermographic imaging", "heat map colours",
        "night vision heat sensor")),
    Style("neon_edges", neon_edges, (
        "neon edges", "glowing neon outlines on black", "cyberpunk neon lights", "synthwave glow",
        "tron style light lines")),
    Style("pixel_art", pixel_art, (
        "pixel art", "8-bit video game", "retro game graphics", "low resolution pixels",
        "arcade sprite look")),
    Style("sepia_film", sepia_film, (
        "old film", "sepia photograph", "vintage movie", "antique brown tinted photo",
        "silent film era")),
    Style("blueprint", blueprint, (
        "blueprint", "technical drawing in white on blue", "architectural plan", "engineering schematic",
        "cyanotype diagram")),
    Style("pop_art", pop_art, (
        "pop art poster", "andy warhol style", "posterised bold colours", "screen print in loud colours",
        "comic pop art")),
)
STYLE_NAMES: tuple[str, ...] = tuple(s.name for s in STYLES)


def style_by_name(name: str) -> Style:
    for s in STYLES:
        if s.name == name:
            return s
    raise ValueError(f"unknown style {name!r}; styles: {', '.join(STYLE_NAMES)}")


def apply_style(name: str, frames: np.ndarray) -> np.ndarray:
    """Apply a style to every frame of [T, H, W, 3] uint8 RGB."""
    fn = style_by_name(name).apply
    return np.stack([fn(np.ascontiguousarray(f)) for f in frames])
