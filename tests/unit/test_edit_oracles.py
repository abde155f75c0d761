"""The edit family's pieces against the libraries they mirror: diffusers' AutoencoderTiny and
transformers' Qwen3-VL (a tiny random configuration built here, no download)."""

from __future__ import annotations

import numpy as np
import pytest
import torch


def test_tiny_vae_matches_diffusers_autoencoder_tiny():
    diffusers = pytest.importorskip("diffusers")
    from engine.edit.vae import VAE_PRESETS, TinyVAE

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
    from engine.edit.encoder import Qwen3VLEncoder, tiny_qwen3vl_config

    return Qwen3VLEncoder.random(tiny_qwen3vl_config(), torch.device("cpu"), torch.float32)


def test_frame_patches_follow_the_qwen_vl_image_processor(tiny_qwen):
    try:
        from transformers import Qwen2VLImageProcessorPil as Processor
    except ImportError:  # transformers 4.x
        from transformers import Qwen2VLImageProcessor as Processor

    proc = Processor(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                                    image_std=[0.5] * 3, do_resize=False)
    image = np.random.default_rng(0).integers(0, 256, (256, 256, 3), np.uint8)
    ref = proc(images=[image], return_tensors="pt")
    mine = tiny_qwen.pixel_patches(torch.from_numpy(image).permute(2, 0, 1)[None].float() / 127.5 - 1)
    assert ref.image_grid_thw.tolist() == [[1, 16, 16]]
    assert torch.allclose(mine, ref.pixel_values.float(), atol=1e-5)


def test_qwen3vl_conditioning_is_fixed_size_and_per_frame(tiny_qwen):
    frames = torch.rand(2, 3, 64, 48) * 2 - 1
    ctx, mask = tiny_qwen.encode("make it a watercolor", frames)
    assert ctx.shape == (2, 192, 64) and mask.shape == (2, 192) and mask.dtype == torch.bool
    longer, longer_mask = tiny_qwen.encode("make it a watercolor with many more words in it", frames)
    assert longer.shape == ctx.shape and longer_mask.sum() > mask.sum()  # same shape, more real tokens
    one, _ = tiny_qwen.encode("make it a watercolor", frames[1:])
    assert torch.allclose(one[0], ctx[1], atol=1e-5)  # frames of a batch do not see each other


def test_encoder_refuses_float16():
    from engine.edit.encoder import HashEditEncoder

    with pytest.raises(ValueError, match="float16.*overflow.*bfloat16"):
        HashEditEncoder(8, 8, torch.device("cpu"), torch.float16)
