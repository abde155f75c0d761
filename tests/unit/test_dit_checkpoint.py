"""Loading DiT checkpoints in every accepted layout, and failing loudly on bad ones."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from loom_live.engine.models.checkpoint_io import CheckpointError
from loom_live.engine.models.dit_convert import to_diffusers_key
from loom_live.engine.models.wan_dit import WanDiT, WanDiTConfig

CFG = WanDiTConfig(dim=24, ffn_dim=32, num_heads=2, num_layers=2, text_dim=8, text_len=4, freq_dim=8)


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    return WanDiT(CFG).eval()


def weights(model):
    return {k: v.clone().contiguous() for k, v in model.state_dict().items()}


def same_output(a: WanDiT, b: WanDiT) -> bool:
    torch.manual_seed(1)
    x, t, ctx = torch.randn(1, 16, 2, 4, 4), torch.tensor([300.0]), torch.randn(1, 4, CFG.text_dim)
    with torch.no_grad():
        return torch.equal(a(x, t, ctx), b(x, t, ctx.to(b.patch_embedding.weight.dtype)))


def test_wan_original_safetensors(tmp_path, reference):
    path = tmp_path / "diffusion_pytorch_model.safetensors"
    save_file(weights(reference), path)
    loaded = WanDiT.from_checkpoint(path, CFG)
    assert same_output(reference, loaded)


def test_diffusers_sharded_pipeline_folder(tmp_path, reference):
    folder = tmp_path / "Wan2.1-T2V-tiny-Diffusers" / "transformer"
    folder.mkdir(parents=True)
    sd = {to_diffusers_key(k): v for k, v in weights(reference).items()}
    names = sorted(sd)
    shards = {"diffusion_pytorch_model-00001-of-00002.safetensors": names[::2],
              "diffusion_pytorch_model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: sd[k] for k in keys}, folder / shard)
    index = {"metadata": {}, "weight_map": {k: s for s, keys in shards.items() for k in keys}}
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    loaded = WanDiT.from_checkpoint(folder.parent, CFG)  # the pipeline folder is accepted too
    assert same_output(reference, loaded)


def test_causvid_generator_pt(tmp_path, reference):
    path = tmp_path / "model.pt"
    torch.save({"generator": {f"model.{k}": v for k, v in weights(reference).items()}, "step": 5}, path)
    assert same_output(reference, WanDiT.from_checkpoint(path, CFG))


def test_comfyui_prefixed_single_file(tmp_path, reference):
    path = tmp_path / "wan2.1_t2v.safetensors"
    save_file({f"model.diffusion_model.{k}": v for k, v in weights(reference).items()}, path)
    assert same_output(reference, WanDiT.from_checkpoint(path, CFG))


def test_dtype_and_block_range_for_a_pipeline_rank(tmp_path, reference):
    path = tmp_path / "dit.safetensors"
    save_file(weights(reference), path)
    rank = WanDiT.from_checkpoint(path, CFG, dtype=torch.bfloat16, blocks=range(1, 2))
    assert rank.blocks[1].self_attn.q.weight.dtype == torch.bfloat16
    assert rank.blocks[0].self_attn.q.weight.is_meta
    assert not rank.head.head.weight.is_meta and not rank.text_embedding[0].weight.is_meta
    tokens = torch.randn(1, 4, CFG.dim, dtype=torch.bfloat16)
    cond = rank.condition(torch.tensor([100.0]), 1)
    cross = rank.cross_kv(torch.randn(1, 4, CFG.text_dim), blocks=[1])
    from loom_live.engine.models.wan_dit import FullSequenceAttention

    attend = FullSequenceAttention(rank.rope(tokens.device), (1, 2, 2), None)
    assert rank.run_blocks(1, 2, tokens, cond, cross, attend).shape == tokens.shape
    with pytest.raises(RuntimeError, match="block 0 was not loaded"):
        rank.run_blocks(0, 1, tokens, cond, cross, attend)


def test_missing_key_is_named(tmp_path, reference):
    sd = weights(reference)
    del sd["blocks.1.cross_attn.norm_k.weight"]
    path = tmp_path / "partial.safetensors"
    save_file(sd, path)
    with pytest.raises(CheckpointError) as err:
        WanDiT.from_checkpoint(path, CFG)
    assert "partial.safetensors" in str(err.value) and "blocks.1.cross_attn.norm_k.weight" in str(err.value)
    assert "1 missing keys" in str(err.value)


def test_wrong_shape_is_named(tmp_path, reference):
    sd = weights(reference)
    sd["blocks.0.ffn.0.weight"] = torch.zeros(64, CFG.dim)
    path = tmp_path / "other_size.safetensors"
    save_file(sd, path)
    shapes = r"other_size.*blocks\.0\.ffn\.0\.weight: file \(64, 24\) vs model \(32, 24\)"
    with pytest.raises(CheckpointError, match=shapes):
        WanDiT.from_checkpoint(path, CFG)


def test_unexpected_keys_are_named(tmp_path, reference):
    sd = weights(reference)
    sd["img_emb.proj.0.weight"] = torch.zeros(4)  # an image-to-video checkpoint
    path = tmp_path / "i2v.safetensors"
    save_file(sd, path)
    with pytest.raises(CheckpointError, match=r"1 unexpected keys.*img_emb\.proj\.0\.weight"):
        WanDiT.from_checkpoint(path, CFG)


def test_unknown_formats(tmp_path):
    text = tmp_path / "weights.txt"
    text.write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match=r"weights\.txt: unknown checkpoint format"):
        WanDiT.from_checkpoint(text, CFG)
    vae = tmp_path / "Wan2.1_VAE.safetensors"
    save_file({"decoder.middle.0.residual.0.gamma": torch.zeros(3)}, vae)
    with pytest.raises(CheckpointError, match=r"unknown checkpoint format: no key is a Wan2.1 DiT.*VAE"):
        WanDiT.from_checkpoint(vae, CFG)


@pytest.mark.parametrize("name", ["dit.safetensors", "model.pt"])
def test_truncated_file(tmp_path, reference, name):
    path = tmp_path / name
    if name.endswith(".pt"):
        torch.save({"generator": weights(reference)}, path)
    else:
        save_file(weights(reference), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"{name}: unreadable"):
        WanDiT.from_checkpoint(path, CFG)


def test_a_truncated_file_is_said_to_be_unreadable_not_of_an_unknown_format(tmp_path, reference):
    """A download cut short is a Wan file that cannot be read: the message said first that no key was a
    Wan2.1 DiT key in any accepted layout (no key had been read at all), sending the user to the format."""
    path = tmp_path / "diffusion_pytorch_model.safetensors"
    save_file(weights(reference), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as refused:
        WanDiT.from_checkpoint(path, CFG)
    assert str(refused.value).startswith(f"{path}: unreadable safetensors file"), refused.value
    assert "unknown checkpoint format" not in str(refused.value)


def test_a_pipeline_folder_under_the_home_folder_is_found_by_its_tilde(tmp_path, reference, monkeypatch):
    """`~/Wan2.1-T2V-1.3B-Diffusers` (a YAML config, a host's text field): the file loaders expand `~`, but the
    look for the pipeline's transformer/ did not, so the folder was refused as holding no checkpoint."""
    folder = tmp_path / "Wan2.1-T2V-tiny-Diffusers" / "transformer"
    folder.mkdir(parents=True)
    save_file({to_diffusers_key(k): v for k, v in weights(reference).items()},
              folder / "diffusion_pytorch_model.safetensors")
    monkeypatch.setenv("HOME", str(tmp_path))
    loaded = WanDiT.from_checkpoint("~/Wan2.1-T2V-tiny-Diffusers", CFG).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in reference.state_dict().items())
