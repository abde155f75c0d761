"""A DiT block moving between pipeline ranks takes its LoRAs along: the giving rank sends the
original weights, the receiving rank merges every loaded LoRA into them at its current scale."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from loom_live.engine.models.lora import LoraMerger, read_lora
from loom_live.engine.models.wan_dit import RMSNorm
from tests.fakes.wan_models import random_model


def _lora_file(model: torch.nn.Module, path) -> str:
    """A LoRA (original Wan layout) on every linear of the model's blocks, with full deltas for their norms'
    weights (the cross-attention LayerNorm's bias too), as community Wan LoRAs carry."""
    g = torch.Generator().manual_seed(2)
    sd = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name.startswith("blocks."):
            sd[f"diffusion_model.{name}.lora_down.weight"] = torch.randn(2, m.in_features, generator=g) * 0.2
            sd[f"diffusion_model.{name}.lora_up.weight"] = torch.randn(m.out_features, 2, generator=g) * 0.2
        elif isinstance(m, (torch.nn.LayerNorm, RMSNorm)) and name.startswith("blocks."):
            sd[f"diffusion_model.{name}.diff"] = torch.randn(m.weight.shape, generator=g) * 0.2
            if isinstance(m, torch.nn.LayerNorm):
                sd[f"diffusion_model.{name}.diff_b"] = torch.randn(m.bias.shape, generator=g) * 0.2
    save_file(sd, str(path))
    return str(path)


def _rank(path, held: int) -> tuple[torch.nn.Module, LoraMerger]:
    model = random_model()
    for i, block in enumerate(model.blocks):
        if i != held:
            block.to("meta")
    merger = LoraMerger(model)
    merger.add(read_lora(path, model), scale=0.7)
    return model, merger


def test_a_moved_block_is_merged_on_its_new_rank_as_on_one_gpu(tmp_path):
    full = random_model()
    original = {k: v.clone() for k, v in full.blocks[1].state_dict().items()}
    path = _lora_file(full, tmp_path / "style.safetensors")
    merged = LoraMerger(full)
    merged.add(read_lora(path, full), scale=0.7)
    giver, giver_lora = _rank(path, held=1)
    taker, taker_lora = _rank(path, held=0)

    assert not torch.equal(full.blocks[1].norm3.bias, original["norm3.bias"])  # the norms' deltas merged too
    giver_lora.forget("blocks.1.")  # what travels is the original block
    sent = {k: v.clone() for k, v in giver.blocks[1].state_dict().items()}
    assert all(torch.equal(sent[k], original[k]) for k in original)
    giver.blocks[1].to("meta")
    taker.blocks[1].to_empty(device="cpu")
    taker.blocks[1].load_state_dict(sent)
    taker_lora.adopt("blocks.1.")
    for k, v in full.blocks[1].state_dict().items():
        assert torch.equal(taker.blocks[1].state_dict()[k], v), k

    # later scale changes reach the block where it now lives, and the giver no longer touches it
    taker_lora.set_scale("style", 0.0)
    giver_lora.set_scale("style", 0.0)
    assert all(torch.equal(taker.blocks[1].state_dict()[k], original[k]) for k in original)
    assert giver.blocks[1].self_attn.q.weight.is_meta
