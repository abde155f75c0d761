"""The edit family's pieces against the libraries they mirror: diffusers' AutoencoderTiny and
transformers' Qwen3-VL (a tiny random configuration built here, no download)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch


def test_tiny_vae_matches_diffusers_autoencoder_tiny():
    diffusers = pytest.importorskip("diffusers")
    from loom_live.engine.edit.vae import VAE_PRESETS, TinyVAE

    ref = diffusers.AutoencoderTiny(encoder_block_out_channels=(8,) * 4, decoder_block_out_channels=(8,) * 4,
                                    num_encoder_blocks=(1, 1, 1, 1), num_decoder_blocks=(1, 1, 1, 1)).eval()
    mine = TinyVAE(VAE_PRESETS["tiny"]).eval()
    mine.load_state_dict(ref.state_dict(), strict=True)
    x = torch.rand(1, 3, 32, 32) * 2 - 1
    with torch.inference_mode():
        z = mine.encode(x)
        assert torch.allclose(z, ref.encode(x).latents, atol=1e-6)
        assert torch.allclose(mine.decode(z), ref.decode(z).sample, atol=1e-6)


@pytest.fixture(scope="module")
def tiny_qwen():
    pytest.importorskip("transformers.models.qwen3_vl")
    from loom_live.engine.edit.encoder import Qwen3VLEncoder, tiny_qwen3vl_config

    return Qwen3VLEncoder.random(tiny_qwen3vl_config(), torch.device("cpu"), torch.float32)


def test_frame_patches_follow_the_qwen_vl_image_processor(tiny_qwen):
    try:
        from transformers import Qwen2VLImageProcessorPil as Processor
    except ImportError:  # transformers 4.x
        from transformers import Qwen2VLImageProcessor as Processor

    proc = Processor(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                                    image_std=[0.5] * 3, do_resize=False)
    image = np.random.default_rng(0).integers(0, 256, (512, 512, 3), np.uint8)
    ref = proc(images=[image], return_tensors="pt")
    mine = tiny_qwen.pixel_patches(torch.from_numpy(image).permute(2, 0, 1)[None].float() / 127.5 - 1)
    assert ref.image_grid_thw.tolist() == [[1, 32, 32]]
    assert torch.allclose(mine, ref.pixel_values.float(), atol=1e-5)


def test_qwen3vl_conditioning_is_fixed_size_and_per_frame(tiny_qwen):
    frames = torch.rand(2, 3, 64, 48) * 2 - 1
    ctx, mask = tiny_qwen.encode("make it a watercolor", frames)
    assert ctx.shape == (2, 448, 64) and mask.shape == (2, 448) and mask.dtype == torch.bool
    longer, longer_mask = tiny_qwen.encode("make it a watercolor with many more words in it", frames)
    assert longer.shape == ctx.shape and longer_mask.sum() > mask.sum()  # same shape, more real tokens
    one, _ = tiny_qwen.encode("make it a watercolor", frames[1:])
    assert torch.allclose(one[0], ctx[1], atol=1e-5)  # frames of a batch do not see each other


def test_encoder_refuses_float16():
    from loom_live.engine.edit.encoder import HashEditEncoder

    with pytest.raises(ValueError, match="float16.*overflow.*bfloat16"):
        HashEditEncoder(8, 8, torch.device("cpu"), torch.float16)


def _word_tokenizer(text: str):
    """A word-level tokenizer (no download) whose special tokens have the tiny Qwen3-VL config's ids."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from loom_live.engine.edit.encoder import tiny_qwen3vl_config

    c = tiny_qwen3vl_config()
    special = {"<|endoftext|>": 1, "<|im_start|>": 2, "<|im_end|>": 3, "<|image_pad|>": c.image_token_id,
               "<|video_pad|>": c.video_token_id, "<|vision_start|>": c.vision_start_token_id,
               "<|vision_end|>": c.vision_end_token_id}
    words = dict.fromkeys(w for w, _ in pre_tokenizers.Whitespace().pre_tokenize_str(text))
    vocab = {"[UNK]": 0, **special, **{w: 10 + i for i, w in enumerate(words) if w not in special}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True) for t in special])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="<|endoftext|>")


def _image_only_processor(tokenizer):
    """transformers' Qwen3VLProcessor without its video half (which needs torchvision): the image and
    text handling is the library's own."""
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageOnly(Qwen3VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, **kwargs) -> None:
            ProcessorMixin.__init__(self, image_processor, tokenizer)
            for name in ("image", "video", "vision_start", "vision_end"):
                token = {"image": "<|image_pad|>", "video": "<|video_pad|>"}.get(name, f"<|{name}|>")
                setattr(self, f"{name}_token", token)
                setattr(self, f"{name}_token_id", tokenizer.convert_tokens_to_ids(token))

    images = Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                                      image_std=[0.5] * 3)
    return ImageOnly(image_processor=images, tokenizer=tokenizer)


@pytest.mark.parametrize("steps", [1, 2])
def test_an_edit_step_of_the_session_equals_dreamlite_mobile_pipeline(tmp_path, steps):
    """The same frame, instruction, seed and random weights through diffusers' DreamLiteMobilePipeline
    (its processor, Qwen3-VL conditioning, scheduler, UNet, TAESD scaling) and through Loom's session,
    which loads the saved UNet, autoencoder and encoder from disk as it would the released ones."""
    diffusers = pytest.importorskip("diffusers")
    pytest.importorskip("transformers.models.qwen3_vl")
    if not hasattr(diffusers, "DreamLiteMobilePipeline"):
        pytest.skip("diffusers >= 0.42 (DreamLiteMobilePipeline) is needed")
    from PIL import Image
    from transformers import Qwen3VLForConditionalGeneration

    from loom_live.engine.config import load_config
    from loom_live.engine.edit.encoder import EDIT_PREFIX, SYSTEM, tiny_qwen3vl_config
    from loom_live.engine.edit.loading import load_edit_models
    from loom_live.engine.edit.session import EditSession
    from loom_live.engine.edit.unet_config import TINY

    prompt = "make it a watercolor"
    torch.manual_seed(0)
    qwen = Qwen3VLForConditionalGeneration(tiny_qwen3vl_config()).eval()
    tokenizer = _word_tokenizer(SYSTEM + EDIT_PREFIX + prompt + " assistant user")
    unet = diffusers.DreamLiteUNetModel(**{**TINY, "encoder_hid_dim": 64}).eval()
    vae = diffusers.AutoencoderTiny(encoder_block_out_channels=(8,) * 4, decoder_block_out_channels=(8,) * 4,
                                    num_encoder_blocks=(1, 1, 1, 1), num_decoder_blocks=(1, 1, 1, 1),
                                    scaling_factor=0.8, shift_factor=0.1).eval()
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.4, max_shift=1.3)
    pipe = diffusers.DreamLiteMobilePipeline(text_encoder=qwen, tokenizer=tokenizer,
                                             processor=_image_only_processor(tokenizer), vae=vae, unet=unet,
                                             scheduler=scheduler)
    pipe.set_progress_bar_config(disable=True)
    unet.save_pretrained(tmp_path / "dreamlite" / "unet")
    vae.save_pretrained(tmp_path / "dreamlite" / "vae")
    scheduler.save_pretrained(tmp_path / "dreamlite" / "scheduler")
    qwen.save_pretrained(tmp_path / "qwen")
    tokenizer.save_pretrained(tmp_path / "qwen")

    frame = np.random.default_rng(0).integers(0, 256, (512, 512, 3), np.uint8)
    with torch.inference_mode():
        expected_latents = pipe(prompt=prompt, image=Image.fromarray(frame), num_inference_steps=steps,
                                generator=torch.Generator().manual_seed(7), output_type="latent").images
        expected = pipe(prompt=prompt, image=Image.fromarray(frame), num_inference_steps=steps,
                        generator=torch.Generator().manual_seed(7), output_type="np").images[0]

    cfg = load_config("edit-tiny", [
        "resolution.width=512", "resolution.height=512", "edit.batch=1", f"edit.steps={steps}", "edit.seed=7",
        f"edit.checkpoint={tmp_path / 'dreamlite'}", "edit.encoder=qwen3-vl", f"edit.encoder_path={tmp_path / 'qwen'}",
        "edit.lllite_hooks=none", "edit.two_streams=false", "model.dtype=float32", "model.device=cpu",
        f"prompt.text={prompt}"])
    models = load_edit_models(cfg)
    decoded = []
    decode = models.vae.decode_latents
    models.vae.decode_latents = lambda z: decoded.append(z) or decode(z)  # see the latents on their way out
    with EditSession(cfg, models) as session:
        out = np.concatenate([o for o in (session.push(frame[None]), session.flush()) if o.size])
    # fp32 on both sides: about 1e-6 apart; one token of conditioning shifted moves them 4e-4
    assert torch.allclose(decoded[0], expected_latents, atol=2e-5), (decoded[0] - expected_latents).abs().max()
    assert expected.std() > 0.02  # a picture, not a flat field
    diff = np.abs(out[0].astype(np.float64) - expected * 255.0)
    assert diff.max() <= 1.0 and diff.mean() < 0.3  # the pipeline's float image, rounded to Loom's uint8


def test_an_instruction_holding_a_special_token_is_refused_when_set_and_the_stream_goes_on():
    """The tokenizer reads its special tokens inside the instruction: an image pad in it gave the template an
    extra image token, and the encode failed on the encoder's thread, raised by the next batch's push (its
    frames lost; a prompt.text holding one failed every batch). Now the prompt is refused when set."""
    pytest.importorskip("transformers.models.qwen3_vl")
    from dataclasses import replace

    from transformers import Qwen3VLModel

    from loom_live.engine.edit.encoder import EDIT_PREFIX, SYSTEM, Qwen3VLEncoder, tiny_qwen3vl_config
    from loom_live.engine.edit.loading import load_edit_models
    from loom_live.engine.edit.session import EditSession
    from loom_live.engine.edit.unet import UNET_PRESETS, EditUNet
    from tests.fakes.edit_tiny import B, random_frames, tiny_edit_cfg

    prompt = "make it a watercolor"
    config = tiny_qwen3vl_config()
    torch.manual_seed(0)
    cfg = tiny_edit_cfg("edit.lllite_hooks=none", "edit.prompt_refresh_every=100", f"prompt.text={prompt}")
    models = load_edit_models(cfg)
    models.unet = EditUNet(replace(UNET_PRESETS["tiny"], context_dim=config.text_config.hidden_size)).eval()
    models.encoder = Qwen3VLEncoder(Qwen3VLModel(config), config, _word_tokenizer(SYSTEM + EDIT_PREFIX + prompt),
                                    torch.device("cpu"), torch.float32)
    frames = random_frames(3 * B)
    with EditSession(cfg, models) as session:
        outs = [session.push(frames[:B])]
        for bad, token in (("<|image_pad|> make it blue", "<|image_pad|>"),
                           ("blue <|vision_start|>", "<|vision_start|>")):
            with pytest.raises(ValueError, match=f"prompt: '{re.escape(token)}' is a special token") as refused:
                session.set_prompt(bad)
            assert "\n" not in str(refused.value)
        outs += [session.push(frames[B:]), session.flush()]
        assert sum(len(o) for o in outs) == len(frames)  # every frame back, the instruction unchanged
        assert session.stats()["prompt"] == prompt
    with pytest.raises(ValueError, match="is a special token"):  # in the config: refused at load
        EditSession(cfg.replace(prompt=replace(cfg.prompt, text="<|image_pad|>")), models)
