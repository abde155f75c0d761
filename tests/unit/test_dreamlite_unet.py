"""Loom's edit UNet against diffusers' DreamLiteUNetModel on random weights: the released
DreamLite-mobile config (at a small spatial size) and two small configs it was not written
against; strict loading of diffusers' own files; LLLite hook names as the temporal LLLite
release names them."""

from __future__ import annotations

import pytest
import torch

from loom_live.engine.edit.checkpoint import load_unet
from loom_live.engine.edit.lllite import LLLite, module_key, select_hooks
from loom_live.engine.edit.unet import EditUNet
from loom_live.engine.edit.unet_config import DREAMLITE_MOBILE, TINY, UNET_PRESETS, EditUNetConfig

diffusers = pytest.importorskip("diffusers")
if not hasattr(diffusers, "DreamLiteUNetModel"):
    pytest.skip("diffusers >= 0.42 (DreamLiteUNetModel) is needed", allow_module_level=True)

# Two configs unlike the released one: every block kind at other places, full multi-head attention
# or 2 KV heads, plain convolutions, 1x1-conv projections, no context projection or size embedding,
# two mid attentions, per-level depths, explicit up-block depths, shifted frequencies.
UNSEEN = {
    "conv-gqa2": {
        "block_out_channels": [16, 32, 48], "layers_per_block": [1, 2, 1], "transformer_layers_per_block": [1, 2, 1],
        "attention_head_dim": [2, 4, 4], "num_kv_heads": 2, "qk_norm": None, "ff_mult": 4, "use_sep_conv": False,
        "use_linear_projection": False, "down_block_types": ["DownBlock2D", "CrossAttnDownRemoveSelfAttnBlock2D",
                                                              "CrossAttnDownBlock2D"],
        "up_block_types": ["CrossAttnUpRemoveSelfAttnBlock2DV1", "CrossAttnUpBlock2D", "UpBlock2D"],
        "cross_attention_dim": 24, "num_mid_layers": 2, "norm_num_groups": 8, "norm_eps": 1e-6,
        "flip_sin_to_cos": False, "freq_shift": 1, "mid_block_scale_factor": 2.0,
    },
    "mha-sep": {
        "block_out_channels": [16, 32], "layers_per_block": 1, "transformer_layers_per_block": 1,
        "reverse_transformer_layers_per_block": [[2, 1], [1, 1]], "attention_head_dim": [2, 2],
        "num_kv_heads": None, "ff_mult": 2, "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
        "up_block_types": ["CrossAttnUpRemoveSelfAttnBlock2D", "CrossAttnUpBlock2D"], "cross_attention_dim": 16,
        "encoder_hid_dim": 12, "encoder_hid_dim_type": "text_proj_rms", "addition_embed_type": "time",
        "addition_time_embed_dim": 6, "projection_class_embeddings_input_dim": 12, "time_embedding_dim": 48,
        "norm_num_groups": 4,
    },
}
POOL = 1 << 23


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _random_weights(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random weights for a meta-built module without paying for 390M fresh draws: every matrix is a
    view into one random pool at its own offset; 1-d parameters (norm scales, biases) near 1."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(POOL, generator=g) * 0.05
    for i, (name, p) in enumerate(module.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        if p.ndim == 1:
            value = 1 + 0.2 * torch.randn(p.shape, generator=g)
        else:
            off = (i * 1_000_003) % (POOL - p.numel())
            value = pool[off:off + p.numel()].view(p.shape)
        module.get_submodule(owner)._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
    return module.eval()


def _pair(config: dict) -> tuple[torch.nn.Module, EditUNet]:
    with torch.device("meta"):
        ref = diffusers.DreamLiteUNetModel(**config)
        mine = EditUNet(EditUNetConfig.from_diffusers(config))
    ref = _random_weights(ref)
    mine.load_state_dict(ref.state_dict(), strict=True, assign=True)
    return ref, mine.eval()


def _inputs(config: dict, h: int = 4, w: int = 4, tokens: int = 6):
    """Row 0 text-to-image ([noise | zeros], all tokens real), row 1 editing ([noise | source latents],
    two padding tokens)."""
    g = torch.Generator().manual_seed(1)
    cfg = EditUNetConfig.from_diffusers(config)
    noise = torch.randn(2, 4, h, w, generator=g)
    right = torch.stack([torch.zeros(4, h, w), torch.randn(4, h, w, generator=g)])
    ctx = torch.randn(2, tokens, cfg.context_in, generator=g) * 3
    mask = torch.ones(2, tokens, dtype=torch.long)
    mask[1, tokens - 2:] = 0
    return (torch.cat([noise, right], dim=3), torch.tensor([1000.0, 437.5]), ctx, mask,
            torch.tensor([[8.0 * w, 8.0 * h], [8.0 * w, 8.0 * h]]))


def _check_forward(config: dict, h: int, w: int) -> None:
    ref, mine = _pair(config)
    x, t, ctx, mask, ids = _inputs(config, h, w)
    with torch.inference_mode():
        expected = ref(x, t, encoder_hidden_states=ctx, encoder_attention_mask=mask,
                       added_cond_kwargs={"time_ids": ids}).sample
        got = mine(x, t, ctx, mask.bool(), ids)
    assert got.shape == expected.shape == x.shape
    for row in range(2):
        scale = expected[row].abs().max().item()
        assert scale > 0.1 and torch.allclose(got[row], expected[row], atol=2e-5 * scale, rtol=1e-4), (row, scale)


def test_dreamlite_mobile_forward_equals_diffusers():
    _check_forward(DREAMLITE_MOBILE, 4, 4)  # latents 4x(4+4): the smallest size the three levels allow


@pytest.mark.parametrize("name", sorted(UNSEEN))
def test_unseen_configs_forward_equal_diffusers(name):
    _check_forward(UNSEEN[name], 8, 8)


def test_dreamlite_mobile_keys_and_size_are_diffusers():
    with torch.device("meta"):
        ref = diffusers.DreamLiteUNetModel(**DREAMLITE_MOBILE)
        mine = EditUNet(UNET_PRESETS["dreamlite-mobile"])
    theirs = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    ours = {k: tuple(v.shape) for k, v in mine.state_dict().items()}
    assert ours == theirs
    assert sum(p.numel() for p in mine.parameters()) == 389_968_388  # "0.39B"


@pytest.mark.parametrize("config", [TINY, *UNSEEN.values()], ids=["tiny", *sorted(UNSEEN)])
def test_a_diffusers_saved_unet_loads_strictly(tmp_path, config):
    torch.manual_seed(0)
    ref = diffusers.DreamLiteUNetModel(**config).eval()
    ref.save_pretrained(tmp_path / "unet")  # diffusion_pytorch_model.safetensors + config.json
    loaded = load_unet(tmp_path, None, torch.device("cpu"), torch.float32)  # the model directory, unet/ inside
    assert loaded.cfg == EditUNetConfig.from_diffusers(config)  # built from the checkpoint's own config.json
    x, t, ctx, mask, ids = _inputs(config, 8, 8)
    with torch.inference_mode():
        expected = ref(x, t, encoder_hidden_states=ctx, encoder_attention_mask=mask,
                       added_cond_kwargs={"time_ids": ids}).sample
        assert torch.allclose(loaded(x, t, ctx, mask.bool(), ids), expected, atol=1e-5)


def test_hook_names_are_the_temporal_lllite_release_names():
    """otanl/dreamlite-lllite hooks attn1.to_q/k/v and attn2.to_q of every transformer block of the
    diffusers model, keyed by the module path with dots as "__"; runs/temporal_lllite_v3/args.json of
    otanl/dreamlite-stream trained them at 512x512 with cond_emb_dim 32, mlp_dim 64."""
    with torch.device("meta"):
        ref = diffusers.DreamLiteUNetModel(**DREAMLITE_MOBILE)
        mine = EditUNet(UNET_PRESETS["dreamlite-mobile"])
    ends = (".attn1.to_q", ".attn1.to_k", ".attn1.to_v", ".attn2.to_q")
    released = {module_key(n): m.in_features for n, m in ref.named_modules()
                if isinstance(m, torch.nn.Linear) and n.endswith(ends)}
    with torch.device("meta"):
        lllite = LLLite(mine.hook_sizes(64), select_hooks(mine.hook_points(), "all"), (512, 512), 1)
    assert {k: h.down[0].in_features for k, h in lllite.modules_dict.items()} == released
    assert len(released) == 108 and len(select_hooks(mine.hook_points(), "down")) == 38
    hook = lllite.modules_dict["down_blocks__2__attentions__0__transformer_blocks__0__attn1__to_q"]
    assert (hook.mid[0].in_features, hook.mid[0].out_features) == (64 + 32, 64)  # mlp_dim + cond_emb_dim
    assert hook.feature_hw == (16, 16)  # 512 px -> 64 latent -> level 2


@pytest.mark.parametrize("text, words", [('{"block_out_channels": "abc"}', "down needs one entry per level"),
                                         ("[1, 2]", "not a UNet config.json"),
                                         ('{"down_block_types": ["X"]}', "down_block_types entry 'X'"),
                                         ('{"_class_name": "UNet2DConditionModel"}',  # SD1.5's, read as DreamLite's
                                          "_class_name 'UNet2DConditionModel' is not DreamLite's UNet (expected "
                                          "'DreamLiteUNetModel')")])
def test_a_unet_config_json_of_wrong_values_is_refused_naming_the_file(tmp_path, text, words):
    """A checkpoint's hand-edited or damaged config.json: one line that says which file, whichever check meets it."""
    path = tmp_path / "unet" / "config.json"
    path.parent.mkdir()
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        EditUNetConfig.from_file(path)
    assert str(err.value).startswith(f"{path}: ") and words in str(err.value) and "\n" not in str(err.value)
