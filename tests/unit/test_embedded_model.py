"""The trained embedded default: shipped weights, styles on a held-out clip, prompts, determinism."""

from __future__ import annotations

import numpy as np
import pytest

from loom_live.engine.config import load_config
from loom_live.engine.models.embedded import (
    EMBEDDED_VAE,
    WEIGHTS_SHA256,
    file_sha256,
    load_embedded,
    read_embedded,
    weights_path,
)
from loom_live.engine.stream.session import StreamSession
from loom_live.engine.train.data import read_clip
from loom_live.engine.train.styles import STYLES, apply_style

CLIP = "davis512_libby.mp4"  # held out of training (engine/train/data.py HELD_OUT)
FRAMES = 13  # the first chunk (5 frames) and two more
SIZE = 256


def stream(frames: np.ndarray, prompt: str, *overrides: str, change: tuple[int, str, int] | None = None
           ) -> tuple[np.ndarray, StreamSession]:
    """Frames through the default preset, 4 at a time; `change` = (at chunk, prompt, transition_chunks)."""
    session = StreamSession.from_config(load_config("default", [f"prompt.text={prompt}", *overrides]))
    out = [session.push(frames[:5])]
    for i, start in enumerate(range(5, len(frames), 4)):
        if change is not None and i + 1 == change[0]:
            session.set_prompt(change[1], change[2])
            session.prompt.wait_pending()
        out.append(session.push(frames[start:start + 4]))
    out.append(session.flush())
    session.close()
    return np.concatenate([o for o in out if len(o)]), session


def mae(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float32) - b.astype(np.float32)).mean())


@pytest.fixture(scope="module")
def clip(request) -> np.ndarray:
    media = request.getfixturevalue("media_dir")
    return read_clip(media / CLIP, SIZE, limit=FRAMES)


@pytest.fixture(scope="module")
def media_dir():  # module scope for the clip fixture; the same check as conftest's
    from tests.conftest import MEDIA

    if not MEDIA.is_dir():
        pytest.skip(f"shared test media not found at {MEDIA} (a fresh clone has no ../shared)")
    return MEDIA


def test_shipped_weights_load_and_match_their_recorded_hash():
    assert file_sha256(weights_path()) == WEIGHTS_SHA256
    dit_state, vae_state, meta = read_embedded()
    assert meta["styles"] == [s.name for s in STYLES] and len(meta["latents_std"]) == EMBEDDED_VAE.latent_channels
    import torch

    dit, vae, _ = load_embedded(torch.device("cpu"), torch.float32)  # strict: every key, every shape
    assert sum(p.numel() for p in dit.parameters()) == sum(t.numel() for t in dit_state.values())


def test_a_training_runs_weights_file_is_loaded_and_one_of_another_layout_is_refused(tmp_path):
    """`model.checkpoint` with the default preset reads a `loom train fit` weights file (no hash: it is
    not the shipped one); a file of another layout gets one line naming it, not a state-dict dump."""
    from dataclasses import replace

    import torch

    from loom_live.engine.models.embedded import EMBEDDED_DIT, EmbeddedWeightsError, save_embedded
    from loom_live.engine.models.frame_vae import FrameVAE
    from loom_live.engine.models.loading import load_models
    from loom_live.engine.models.wan_dit import WanDiT

    torch.manual_seed(3)
    run = tmp_path / "run.safetensors"
    save_embedded(run, WanDiT(EMBEDDED_DIT), FrameVAE(EMBEDDED_VAE), {"styles": [s.name for s in STYLES]})
    dit = load_models(load_config("default", [f"model.checkpoint={run}", "model.dtype=float32"])).dit
    shipped, _, _ = load_embedded(torch.device("cpu"), torch.float32)
    assert not torch.equal(dit.patch_embedding.weight, shipped.patch_embedding.weight)
    old = tmp_path / "old.safetensors"
    save_embedded(old, WanDiT(replace(EMBEDDED_DIT, source_channels=0, source_edges=False)), FrameVAE(EMBEDDED_VAE), {})
    with pytest.raises(EmbeddedWeightsError, match=r"old.safetensors: not weights of the embedded model's layout"
                                                   r".*size mismatch") as err:
        load_models(load_config("default", [f"model.checkpoint={old}"]))
    assert "\n" not in str(err.value)


# The shipped model lands toon on sepia film on this clip (mean error 19.4 to toon's target, 18.5 to sepia's):
# docs/embedded-model.md, Metrics and Limits. A better model fails the test below: then drop the entry.
KNOWN_WRONG = {"toon": "sepia_film"}


def test_each_style_is_nearest_its_own_target_on_a_held_out_clip(clip):
    """Every other style's output is nearer its own target than any other style's; a model that loses one
    (or mends toon) changes what the docs promise."""
    targets = {s.name: apply_style(s.name, clip) for s in STYLES}
    wrong = {}
    for style in STYLES:
        out, _ = stream(clip, style.prompt)
        dist = {name: mae(out, t) for name, t in targets.items()}
        nearest = min(dist, key=dist.get)
        if nearest != style.name:
            wrong[style.name] = nearest
    assert wrong == KNOWN_WRONG, "styles whose output is nearer another style's target"


def test_a_prompt_change_reaches_the_new_style_within_transition_chunks_plus_one(clip):
    frames = np.concatenate([clip, clip[::-1][1:], clip[1:]])  # 37 frames: 9 chunks
    transition = 2
    out, session = stream(frames, "pencil sketch", f"prompt.transition_chunks={transition}",
                          change=(2, "thermal camera", transition))
    assert session.stats()["prompt_style"]["style"] == "thermal"
    after = 5 + 4 * (2 + transition + 1)  # frames before the chunk that must show the new style
    new, old = apply_style("thermal", frames[after:]), apply_style("pencil_sketch", frames[after:])
    assert mae(out[after:], new) < mae(out[after:], old)


def test_the_same_input_and_seed_give_the_same_output(clip):
    a, _ = stream(clip[:9], "watercolour")
    b, _ = stream(clip[:9], "watercolour")
    assert np.array_equal(a, b)
    c, _ = stream(clip[:9], "watercolour", "stream.seed=1")
    assert not np.array_equal(a, c)


@pytest.mark.parametrize("prompt, style", [("charcoal drawing", "pencil_sketch"), ("infrared camera", "thermal"),
                                           ("8 bit retro game", "pixel_art"), ("chinese brush painting", "ink_wash"),
                                           ("old movie", "sepia_film"), ("glowing neon", "neon_edges")])
def test_prompts_in_other_words_land_on_their_style(prompt, style):
    from loom_live.engine.stream.style_text import StyleTextEncoder

    assert StyleTextEncoder(384, 4).describe(prompt).style == style


@pytest.mark.parametrize("native, setting, want", [(True, "auto", "bfloat16"), (False, "auto", "float32"),
                                                   (True, "float32", "float32")])
def test_the_embedded_model_computes_in_bfloat16_on_a_cpu_that_has_it_in_hardware(monkeypatch, native, setting,
                                                                                   want):
    """Only the embedded model (checked to restyle the same in bfloat16), only with `auto`, and only
    where the CPU multiplies bfloat16 natively: elsewhere bfloat16 is emulated and slower."""
    import torch

    from loom_live.engine.models import loading

    monkeypatch.setattr(loading, "native_cpu_bfloat16", lambda: native)
    cfg = load_config("default", [f"model.dtype={setting}", "model.device=cpu"])
    assert loading.load_models(cfg).dtype == getattr(torch, want)
    assert loading.resolve_dtype("auto", torch.device("cpu")) == torch.float32  # any other model


def test_an_unrelated_prompt_gets_the_nearest_style_and_the_stats_say_how_near():
    session = StreamSession.from_config(load_config("default", ["prompt.text=a banana on a table"]))
    match = session.stats()["prompt_style"]
    session.close()
    assert match["style"] in [s.name for s in STYLES] and 0.0 <= match["similarity"] < 0.6


def test_saved_weights_are_int8_matrices_that_read_back_within_one_step_of_their_scale(tmp_path):
    """What `loom train` writes and the package ships: matrices and kernels as int8 with a per-channel
    scale (half the bytes of float16), read back to within half a quantisation step."""
    import torch
    from safetensors import safe_open

    from loom_live.engine.models.embedded import EMBEDDED_DIT, SCALE_SUFFIX, save_embedded, vae_config
    from loom_live.engine.models.frame_vae import FrameVAE
    from loom_live.engine.models.wan_dit import WanDiT

    torch.manual_seed(0)
    dit = WanDiT(EMBEDDED_DIT)
    _, _, meta = read_embedded()
    vae = FrameVAE(vae_config(meta))
    path = tmp_path / "w.safetensors"
    assert save_embedded(path, dit, vae, {"note": "test"}) == file_sha256(path)
    with safe_open(str(path), framework="pt") as f:
        kinds = {k: f.get_tensor(k).dtype for k in f.keys()}
    assert kinds["dit.blocks.0.ffn.0.weight"] == torch.int8 and f"dit.blocks.0.ffn.0.weight{SCALE_SUFFIX}" in kinds
    dit_back, vae_back, meta_back = read_embedded(path)
    assert meta_back["note"] == "test" and not any(k.endswith(SCALE_SUFFIX) for k in dit_back)
    for name, value in dit.state_dict().items():
        back = dit_back[name].float()
        if value.ndim >= 2:
            step = value.abs().flatten(1).amax(1).view(-1, *[1] * (value.ndim - 1)) / 127
            assert ((back - value).abs() <= step * 0.51 + 1e-3).all(), name
        else:
            assert torch.allclose(back, value, atol=1e-3, rtol=1e-3), name
    assert set(vae_back) == set(vae.state_dict())


def test_a_save_stopped_while_writing_leaves_the_last_checkpoint_whole(tmp_path, monkeypatch):
    """`loom train` saves its partial weights every 200 steps over the last ones: a Ctrl-C during that
    write must leave the earlier file readable (a later run continues from it) and no stray file."""
    import io

    from loom_live.engine.models.embedded import EMBEDDED_DIT, save_embedded, vae_config
    from loom_live.engine.models.frame_vae import FrameVAE
    from loom_live.engine.models.wan_dit import WanDiT
    from loom_live.host_bridge.wire import files

    _, _, meta = read_embedded()
    dit, vae = WanDiT(EMBEDDED_DIT), FrameVAE(vae_config(meta))
    path = tmp_path / "embedded.partial.safetensors"
    sha = save_embedded(path, dit, vae, {"partial_step": 200})

    class HalfThenStop(io.FileIO):  # the disk takes half the bytes, then Ctrl-C
        def write(self, data):
            super().write(bytes(data[: len(data) // 2]))
            raise KeyboardInterrupt

    monkeypatch.setattr(files, "open", HalfThenStop, raising=False)
    with pytest.raises(KeyboardInterrupt):
        save_embedded(path, dit, vae, {"partial_step": 400})
    assert file_sha256(path) == sha and read_embedded(path)[2]["partial_step"] == 200
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_the_vae_round_trip_keeps_a_saturated_clips_colour():
    """The VAE alone (streamed encode, then decode) on loud, saturated colours: the mean saturation
    stays within 10% and the picture within 30 dB. The VAE shipped before this one turned such a
    clip grey (saturation 146 -> 19, 15.6 dB)."""
    import torch

    from loom_live.engine.train.data import shapes_clip
    from loom_live.engine.train.evaluate import psnr, saturation

    frames = shapes_clip(seed=3, size=SIZE, n=9)
    hsv = np.stack([cv2_hsv(f) for f in frames])
    hsv[..., 1] = np.maximum(hsv[..., 1], 200)  # every pixel strongly coloured
    frames = np.stack([cv2_rgb(f) for f in hsv])
    _, vae, _ = load_embedded(torch.device("cpu"), torch.float32)
    x = torch.from_numpy(frames).permute(3, 0, 1, 2)[None].float().div(127.5).sub(1.0)
    with torch.inference_mode():
        y = vae.decode(vae.encode(x))[0].permute(1, 2, 3, 0)
    out = y.add(1.0).mul(127.5).round().clamp(0, 255).to(torch.uint8).numpy()
    assert abs(saturation(out) - saturation(frames)) <= 0.1 * saturation(frames)
    assert psnr(out, frames) >= 30.0


def cv2_hsv(rgb: np.ndarray) -> np.ndarray:
    import cv2

    return cv2.cvtColor(rgb, cv2.COLOR_RGB2HSV)


def cv2_rgb(hsv: np.ndarray) -> np.ndarray:
    import cv2

    return cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB)



TOON_SATURATION = pytest.mark.xfail(strict=True, reason="toon's dark pixels (its darkest colour level, its "
                                    "outlines): one or two levels of reconstruction error give them a loud HSV "
                                    "saturation (about +13% on this clip); the shipped VAE learnt from H.264-stored "
                                    "targets, whose dark pixels carry that error: docs/embedded-model.md")


@pytest.mark.parametrize("variant", ["source", *[pytest.param(s.name, marks=TOON_SATURATION) if s.name == "toon"
                                                 else s.name for s in STYLES]])
def test_the_vae_passes_the_gate_on_a_held_out_clip_and_its_styled_targets(clip, variant):
    """Issue 29's VAE gate on the 13 frames the other tests use, against the procedural targets
    themselves: PSNR >= 30 dB and mean saturation within 10% of the input."""
    import torch

    from loom_live.engine.train.data import Clip
    from loom_live.engine.train.evaluate import gate_summary, reconstruction

    _, vae, _ = load_embedded(torch.device("cpu"), torch.float32)
    frames = clip if variant == "source" else apply_style(variant, clip)
    rows = reconstruction(vae, [Clip(CLIP, {variant: frames})], torch.device("cpu"))
    assert gate_summary(rows)["misses"] == [], rows
