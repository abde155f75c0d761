"""Style LoRAs: each shared file layout merged by Loom equals diffusers' own LoRA loading."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from loom_live.engine.models.lora import LoraError, LoraMerger, read_lora
from tests.fakes.wan_models import CFG, diffusers_twin, random_model

pytest.importorskip("peft", reason="diffusers' LoRA loading (the oracle) needs peft, in the test extra")
from diffusers.loaders.lora_pipeline import WanLoraLoaderMixin  # noqa: E402

RANK = 4
SMALL = ["resolution.width=64", "resolution.height=64"]  # the session tests' frames: 64x64 is enough
# WanDiT module -> (diffusers module, in, out)
PROJ = dict(zip("qkvo", ("to_q", "to_k", "to_v", "to_out.0")))
LINEARS = {**{f"self_attn.{p}": (f"attn1.{d}", CFG.dim, CFG.dim) for p, d in PROJ.items()},
           **{f"cross_attn.{p}": (f"attn2.{d}", CFG.dim, CFG.dim) for p, d in PROJ.items()},
           "ffn.0": ("ffn.net.0.proj", CFG.dim, CFG.ffn_dim), "ffn.2": ("ffn.net.2", CFG.ffn_dim, CFG.dim)}


def _lora(layout: str, seed: int, alpha: float | None = 2.0, dim_in: int = CFG.dim) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i in range(CFG.num_layers):
        for wan, (hf, n_in, n_out) in LINEARS.items():
            n_in = dim_in if n_in == CFG.dim else n_in
            down, up = torch.randn(RANK, n_in, generator=g) * 0.3, torch.randn(n_out, RANK, generator=g) * 0.3
            if layout == "diffusers":
                base, names = f"transformer.blocks.{i}.{hf}", ("lora_A", "lora_B")
            elif layout == "wan":
                base, names = f"diffusion_model.blocks.{i}.{wan}", ("lora_down", "lora_up")
            else:  # kohya / musubi
                base, names = f"lora_unet_blocks_{i}_{wan.replace('.', '_')}", ("lora_down", "lora_up")
            sd[f"{base}.{names[0]}.weight"], sd[f"{base}.{names[1]}.weight"] = down, up
            if alpha is not None and layout != "diffusers":
                sd[f"{base}.alpha"] = torch.tensor(alpha)
    return sd


def _save(tmp_path, name: str, sd: dict[str, torch.Tensor]):
    path = tmp_path / f"{name}.safetensors"
    save_file(sd, str(path))
    return path


def _run(model, x, t, ctx):
    with torch.no_grad():
        return model(x, t, ctx)


def _inputs():
    torch.manual_seed(3)
    return torch.randn(1, 16, 2, 4, 6), torch.tensor([600.0]), torch.randn(1, CFG.text_len, CFG.text_dim)


def _diffusers_with(paths_scales, model):
    twin = diffusers_twin(model=model)
    names = []
    for i, (path, _) in enumerate(paths_scales):
        sd = WanLoraLoaderMixin.lora_state_dict(str(path))
        twin.load_lora_adapter(sd, adapter_name=f"l{i}", prefix="transformer")
        names.append(f"l{i}")
    twin.set_adapters(names, weights=[s for _, s in paths_scales])
    return twin


@pytest.mark.parametrize("layout", ["diffusers", "wan", "kohya"])
def test_merged_lora_equals_diffusers_lora_loading(tmp_path, layout):
    path = _save(tmp_path, layout, _lora(layout, seed=1))
    model = random_model()
    twin = _diffusers_with([(path, 0.7)], random_model())
    merger = LoraMerger(model)
    merger.add(read_lora(path, model), scale=0.7)
    x, t, ctx = _inputs()
    ours, theirs = _run(model, x, t, ctx), twin(x, t, ctx, return_dict=False)[0]
    base = _run(random_model(), x, t, ctx)
    assert (ours - base).abs().max() > 1e-2  # the LoRA changed the output
    assert (ours - theirs).abs().max() < 1e-4


def test_two_loras_combine_linearly_as_in_diffusers(tmp_path):
    a, b = _save(tmp_path, "a", _lora("wan", seed=1)), _save(tmp_path, "b", _lora("kohya", seed=2, alpha=8.0))
    model = random_model()
    merger = LoraMerger(model)
    merger.add(read_lora(a, model), scale=0.5)
    merger.add(read_lora(b, model), scale=-0.3)
    twin = _diffusers_with([(a, 0.5), (b, -0.3)], random_model())
    x, t, ctx = _inputs()
    assert (_run(model, x, t, ctx) - twin(x, t, ctx, return_dict=False)[0]).abs().max() < 1e-4


def test_scale_zero_restores_the_original_weights_bit_for_bit(tmp_path):
    model = random_model().to(torch.bfloat16)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    merger = LoraMerger(model)
    merger.add(read_lora(_save(tmp_path, "a", _lora("wan", seed=1)), model), scale=0.9)
    merger.add(read_lora(_save(tmp_path, "b", _lora("diffusers", seed=2)), model), scale=0.4)
    assert not torch.equal(model.blocks[0].self_attn.q.weight, original["blocks.0.self_attn.q.weight"])
    merger.set_scale("a", 0.0)
    merger.set_scale("b", 0.0)
    assert all(torch.equal(v, original[k]) for k, v in model.state_dict().items())


def test_a_scale_change_recomputes_only_that_loras_layers(tmp_path):
    model = random_model()
    sd = {k: v for k, v in _lora("wan", seed=1).items() if ".blocks.1." in k}
    merger = LoraMerger(model)
    merger.add(read_lora(_save(tmp_path, "only1", sd), model), scale=1.0)
    block0 = model.blocks[0].self_attn.q.weight.clone()
    merger.set_scale("only1", 0.25)
    assert torch.equal(model.blocks[0].self_attn.q.weight, block0)
    assert merger.scales == {"only1": 0.25}


def test_a_lora_for_another_model_size_names_the_file_and_shapes(tmp_path):
    path = _save(tmp_path, "wan14b", _lora("wan", seed=1, dim_in=CFG.dim * 2))
    expected = r"wan14b\.safetensors: shapes that do not fit this model.*blocks\.0\.self_attn\.q"
    with pytest.raises(LoraError, match=expected):
        read_lora(path, random_model())


def test_a_folder_of_several_loras_is_refused_not_read_as_one(tmp_path):
    """`--lora /loras/` (the folder, not a file in it): every file in it was read as one LoRA, the later
    file's updates silently replacing the earlier one's for the layers both adapt. A folder of one LoRA (as
    PEFT's save_pretrained writes it) is still read."""
    model = random_model()
    folder = tmp_path / "loras"
    folder.mkdir()
    _save(folder, "ink", _lora("wan", seed=1))
    assert len(read_lora(folder, model).modules) == CFG.num_layers * len(LINEARS)
    _save(folder, "film", _lora("wan", seed=2))
    with pytest.raises(LoraError, match=r"loras: a folder of 2 weight files.*film\.safetensors, ink\.safetensors"):
        read_lora(folder, model, meta=True)


def test_unknown_keys_are_named(tmp_path):
    sd = _lora("wan", seed=1)
    sd["diffusion_model.blocks.0.self_attn.q.magic"] = torch.zeros(2)
    sd["diffusion_model.blocks.9.self_attn.q.lora_down.weight"] = torch.zeros(RANK, CFG.dim)
    sd["diffusion_model.blocks.9.self_attn.q.lora_up.weight"] = torch.zeros(CFG.dim, RANK)
    with pytest.raises(LoraError, match=r"magic"):
        read_lora(_save(tmp_path, "odd", sd), random_model())
    del sd["diffusion_model.blocks.0.self_attn.q.magic"]
    with pytest.raises(LoraError, match=r"modules this model does not have: blocks\.9\.self_attn\.q"):
        read_lora(_save(tmp_path, "odd", sd), random_model())


def test_a_pipeline_rank_merges_only_the_blocks_it_holds(tmp_path):
    model = random_model()
    model.blocks[0].to("meta")  # a rank that holds block 1 only
    merger = LoraMerger(model)
    merger.add(read_lora(_save(tmp_path, "a", _lora("wan", seed=1)), model), scale=1.0)
    full = random_model()
    LoraMerger(full).add(read_lora(tmp_path / "a.safetensors", full), scale=1.0)
    assert model.blocks[0].self_attn.q.weight.is_meta
    assert torch.equal(model.blocks[1].ffn[0].weight, full.blocks[1].ffn[0].weight)


def _lora_for(model, seed: int, rank: int = 2) -> dict[str, torch.Tensor]:
    """A diffusers-layout LoRA on every attention and FFN linear of `model`'s blocks."""
    from loom_live.engine.models.dit_convert import to_diffusers_key

    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name.startswith("blocks."):
            base = "transformer." + to_diffusers_key(name + ".weight").removesuffix(".weight")
            sd[f"{base}.lora_A.weight"] = torch.randn(rank, m.in_features, generator=g) * 0.2
            sd[f"{base}.lora_B.weight"] = torch.randn(m.out_features, rank, generator=g) * 0.2
    return sd


def _session_frames(overrides: list[str]):
    import numpy as np

    from loom_live.engine.config import load_config
    from loom_live.engine.stream.session import StreamSession

    frames = np.random.default_rng(0).integers(0, 256, (9, 64, 64, 3), np.uint8)
    with StreamSession.from_config(load_config("default", [*overrides, *SMALL]), warmup=False) as session:
        return np.concatenate([session.push(frames), session.flush()])


def test_config_loras_are_merged_at_load_and_scale_zero_is_no_lora(tmp_path):
    from loom_live.engine.config import load_config
    from loom_live.engine.models.loading import load_models

    dit = load_models(load_config("default")).dit
    path = _save(tmp_path, "style", _lora_for(dit, seed=5))
    plain = _session_frames([])
    styled = _session_frames([f"lora=[{{path: {path}, scale: 1.0}}]"])
    off = _session_frames([f"lora=[{{path: {path}, scale: 0.0}}]"])
    assert (plain == off).all()
    assert (plain.astype(int) - styled).__abs__().mean() > 0.5


def test_lora_config_errors_name_the_problem(tmp_path):
    from loom_live.engine.config import ConfigError, load_config
    from loom_live.engine.models.loading import load_models

    with pytest.raises(ConfigError, match="share a name"):
        load_config("default", ["lora=[{path: a/x.safetensors}, {path: b/x.safetensors}]"])
    with pytest.raises(ConfigError, match=r"lora\[0\]\.scale"):
        load_config("default", ["lora=[{path: a.safetensors, scale: 9}]"])
    with pytest.raises(Exception, match="missing.safetensors"):
        load_models(load_config("default", [f"lora=[{{path: {tmp_path / 'missing.safetensors'}}}]"]))


def test_a_live_scale_change_equals_a_stream_switched_to_that_scale_at_that_chunk(tmp_path):
    """In one part, exactly the stream switched at that chunk; spread over three parts (a part a chunk),
    the same weights once the three chunks after the change have run."""
    import numpy as np

    from loom_live.engine.config import load_config
    from loom_live.engine.models.loading import load_models
    from loom_live.engine.stream.session import StreamSession

    path = _save(tmp_path, "style", _lora_for(load_models(load_config("default")).dit, seed=6))
    frames = np.random.default_rng(1).integers(0, 256, (1 + 4 * 5, 32, 32, 3), np.uint8)
    pieces = [frames[:5]] + [frames[i:i + 4] for i in range(5, len(frames), 4)]
    weights = []  # each run's merged weights at its end

    def run(switch, parts: int = 1) -> list:
        lora = f"lora=[{{path: {path}, scale: 1.0}}]"
        cfg = load_config("default", [lora, f"stream.lora_merge_parts={parts}", *SMALL])
        outs = []
        with StreamSession.from_config(cfg, warmup=False) as s:
            for i, piece in enumerate(pieces):
                if i == 2:
                    switch(s)
                outs.append(s.push(piece))
            outs.append(s.flush())
            weights.append({k: v.clone() for k, v in s.models.dit.state_dict().items()})
            assert s.models.lora.settled
        return outs

    def live(s):
        s.set_params(lora_scales={"style": 0.25})

    def direct(s):  # the definition: the same stream state, the weights at the new scale from here on
        s.models.lora.set_scale("style", 0.25)
        s.denoiser.set_context(s.models.dit.cross_kv(s.prompt.current()[None]))

    a, b, c = run(live), run(direct), run(lambda s: None)
    assert all((x == y).all() for x, y in zip(a, b))
    assert all((x == y).all() for x, y in zip(a[:2], c[:2]))  # nothing changes before the switch
    assert any((x != y).any() for x, y in zip(a[2:], c[2:]))
    spread = run(live, parts=3)
    assert all((x == y).all() for x, y in zip(spread[:2], c[:2]))
    assert any((x != y).any() for x, y in zip(spread[2:], c[2:]))
    assert all(torch.equal(v, weights[0][k]) for k, v in weights[3].items())  # the live run in one part
    with pytest.raises(ValueError, match="no LoRA named 'nope'"):
        cfg = load_config("default", [f"lora=[{{path: {path}, scale: 1.0}}]"])
        StreamSession.from_config(cfg, warmup=False).set_params(lora_scales={"nope": 1.0})


def test_a_spread_change_remakes_the_cross_attention_kv_of_each_parts_blocks_once_and_alone(tmp_path):
    """Each chunk of a change spread over three parts leaves cross-attention K/V equal to K/V made afresh
    from the weights as merged so far, having remade only the blocks whose k or v that part merged: every
    block over the three chunks, a block twice only where two parts split its k and v."""
    import numpy as np

    from loom_live.engine.config import load_config
    from loom_live.engine.models.loading import load_models
    from loom_live.engine.stream.session import StreamSession

    path = _save(tmp_path, "style", _lora_for(load_models(load_config("default")).dit, seed=7))
    frames = np.random.default_rng(2).integers(0, 256, (1 + 4 * 5, 32, 32, 3), np.uint8)
    pieces = [frames[:5]] + [frames[i:i + 4] for i in range(5, len(frames), 4)]
    cfg = load_config("default", [f"lora=[{{path: {path}, scale: 1.0}}]", "stream.lora_merge_parts=3", *SMALL])
    remade = []
    with StreamSession.from_config(cfg, warmup=False) as s:
        for piece in pieces[:2]:
            s.push(piece)
        s.set_params(lora_scales={"style": 0.25})
        for piece in pieces[2:5]:
            before = s.denoiser.cross
            s.push(piece)
            after, fresh = s.denoiser.cross, s.models.dit.cross_kv(s.prompt.current()[None])
            assert all(torch.equal(after.k[i], fresh.k[i]) and torch.equal(after.v[i], fresh.v[i]) for i in fresh.k)
            remade.append({i for i in after.k if after.k[i] is not before.k[i]})
        assert s.models.lora.settled
    blocks = set(fresh.k)
    assert len(blocks) > 1 and set().union(*remade) == blocks and sum(map(len, remade)) <= len(blocks) + 2
    assert all(len(r) < len(blocks) for r in remade)


def test_the_blocks_whose_cross_attention_kv_a_weight_change_reaches():
    from loom_live.engine.models.wan_vace import VACE_PRESETS, WanVaceDiT

    model = random_model()
    assert model.cross_kv_blocks({"blocks.1.cross_attn.k", "blocks.0.self_attn.q", "blocks.0.ffn.0"}) == [1]
    assert model.cross_kv_blocks({"blocks.0.cross_attn.v", "blocks.1.cross_attn.q", "blocks.1.cross_attn.o"}) == [0]
    assert model.cross_kv_blocks({"blocks.1.cross_attn.norm_k", "blocks.0.cross_attn.norm_q", "blocks.0.norm3"}) == [1]
    assert model.cross_kv_blocks({"text_embedding.0", "blocks.0.ffn.2"}) is None  # every block reads it
    vace = WanVaceDiT(VACE_PRESETS["tiny-vace"])
    control = vace.control_block_ids()
    assert vace.cross_kv_blocks({"vace_blocks.0.cross_attn.k", "blocks.1.cross_attn.v"}) == [1, control[0]]
    assert vace.cross_kv_blocks({"vace_blocks.0.cross_attn.norm_k"}) == [control[0]]
    context = torch.randn(1, 8, vace.cfg.text_dim)
    part, whole = vace.cross_kv(context, [1, control[0]]), vace.cross_kv(context)
    assert set(part.k) == {1, control[0]} and all(torch.equal(part.k[i], whole.k[i]) for i in part.k)


def test_the_graphs_fixed_kv_buffers_take_the_blocks_a_change_remade_and_a_new_prompt_whole():
    from loom_live.engine.cache.kv_cache import CrossKV
    from loom_live.engine.graphs.dit_steps import StaticCross

    def kv(seed, blocks=(0, 1, 2)):
        g = torch.Generator().manual_seed(seed)
        return CrossKV({i: torch.randn(1, 4, 2, 8, generator=g) for i in blocks},
                       {i: torch.randn(1, 4, 2, 8, generator=g) for i in blocks})

    static = StaticCross()
    first = kv(0)
    buffers, made = static.update(first)
    assert made and all(torch.equal(buffers.k[i], first.k[i]) for i in first.k)
    for cross in (first.updated(kv(1, blocks=(1,))), kv(2)):  # a merge part reached block 1; a new prompt
        same, made = static.update(cross)
        assert same is buffers and not made
        assert all(torch.equal(buffers.k[i], cross.k[i]) and torch.equal(buffers.v[i], cross.v[i]) for i in cross.k)
