"""The LoRA merge program: the weights it writes equal the definition (and the per-LoRA addmm merge it
replaced) to one rounding; a live scale change rebuilds nothing, moves no tensor and recompiles nothing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from loom_live.engine.models.lora import LoraError, LoraFile, LoraMerger, LowRank, read_lora
from loom_live.engine.models.wan_dit import DIT_PRESETS, WanDiT
from tests.fakes.wan_models import CFG, random_model


def _lora_file(model: torch.nn.Module, path, seed: int, rank: int, alpha: float, bias: bool = False) -> str:
    """A LoRA in the original Wan layout on every linear of the blocks (with `.alpha`; `bias`: `.diff_b` too)."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name.startswith("blocks."):
            sd[f"diffusion_model.{name}.lora_down.weight"] = torch.randn(rank, m.in_features, generator=g) * 0.2
            sd[f"diffusion_model.{name}.lora_up.weight"] = torch.randn(m.out_features, rank, generator=g) * 0.2
            sd[f"diffusion_model.{name}.alpha"] = torch.tensor(alpha)
            if bias:
                sd[f"diffusion_model.{name}.diff_b"] = torch.randn(m.out_features, generator=g) * 0.1
    save_file(sd, str(path))
    return str(path)


def _two_loras(tmp_path, model: torch.nn.Module, parts: int = 1) -> tuple[LoraMerger, list]:
    paths = [_lora_file(model, tmp_path / "a.safetensors", 1, rank=4, alpha=2.0, bias=True),
             _lora_file(model, tmp_path / "b.safetensors", 2, rank=3, alpha=6.0)]
    files = [read_lora(p, model) for p in paths]
    raw = [read_lora(p, model) for p in paths]  # float32 factors, for the reference
    merger = LoraMerger(model, parts=parts)
    merger.add(files[0], scale=0.8)
    merger.add(files[1], scale=-0.4)
    return merger, raw


def _reference(original: dict, raw: list, scales: dict[str, float], name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """W0 + sum_i s_i a_i B_i A_i in float64 from the factors in the weight's dtype (as merged), and
    sum_i |s_i a_i| |B_i| |A_i|: the size of what is added, which bounds the error of rounding it."""
    module, dtype = name.removesuffix(".weight"), original[name].dtype
    w, size = original[name].double(), torch.zeros_like(original[name], dtype=torch.float64)
    for lora in raw:
        u = lora.modules[module]
        up, down = u.up.to(dtype).double(), u.down.to(dtype).double()
        w = w + scales[lora.name] * u.alpha_scale * (up @ down)
        size = size + abs(scales[lora.name] * u.alpha_scale) * (up.abs() @ down.abs())
    return w, size


def _addmm_chain(original: dict, raw: list, scales: dict[str, float], name: str, dtype) -> torch.Tensor:
    """The merge this program replaced: one addmm per LoRA in the weight's dtype, the scale as alpha."""
    module = name.removesuffix(".weight")
    w = original[name].clone()
    for lora in raw:
        u = lora.modules[module]
        w = torch.addmm(w, u.up.to(dtype), u.down.to(dtype), alpha=scales[lora.name] * u.alpha_scale)
    return w


def test_bf16_merge_equals_the_definition_and_the_addmm_merge_to_one_rounding(tmp_path):
    model = random_model().to(torch.bfloat16)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    merger, raw = _two_loras(tmp_path, model)
    merger.set_scales({"a": 1.3, "b": 0.25})
    weights = [k for k in original if k.startswith("blocks.") and k.endswith(".weight") and original[k].ndim == 2]
    assert weights
    for name in weights:
        got = model.state_dict()[name].double()
        ref, size = _reference(original, raw, merger.scales, name)
        ulp = (ref.abs() + size) * 2.0**-8  # bf16 keeps 8 significant bits: one rounding is within 2^-9
        assert ((got - ref).abs() <= ulp).all(), name
        chain = _addmm_chain(original, raw, merger.scales, name, torch.bfloat16).double()
        assert ((got - chain).abs() <= 2 * ulp).all(), name
    bias = model.blocks[0].ffn[0].bias
    delta = raw[0].modules["blocks.0.ffn.0"].bias.float()
    expect = (original["blocks.0.ffn.0.bias"].float() + 1.3 * delta).to(torch.bfloat16)
    assert torch.equal(bias, expect)


def test_float32_merge_equals_the_definition(tmp_path):
    model = random_model()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    merger, raw = _two_loras(tmp_path, model)
    for name in ("blocks.0.self_attn.q.weight", "blocks.1.ffn.2.weight", "blocks.1.cross_attn.o.weight"):
        ref, _ = _reference(original, raw, merger.scales, name)
        assert (model.state_dict()[name].double() - ref).abs().max() < 1e-5


def test_a_scale_change_rebuilds_nothing_moves_no_tensor_and_recompiles_nothing(tmp_path):
    model = random_model()
    merger, _ = _two_loras(tmp_path, model)
    compiles = []

    def counting_backend(gm, example_inputs):
        compiles.append(len(gm.graph.nodes))
        return gm.forward

    layer = model.blocks[0].ffn[0]
    compiled = torch.compile(layer, backend=counting_backend, fullgraph=True)
    x = torch.randn(3, layer.in_features)
    with torch.no_grad():
        before = compiled(x)
    addresses = [p.data_ptr() for p in model.parameters()]
    builds, scales_at = merger.builds, merger.program.scales.data_ptr()
    for a, b in ((0.1, 0.9), (1.7, -1.0), (0.0, 0.0)):
        merger.set_scales({"a": a, "b": b})
        with torch.no_grad():
            after = compiled(x)
            assert torch.equal(after, layer(x))  # the compiled code reads the merged weights
    assert len(compiles) == 1
    assert merger.builds == builds and merger.program.scales.data_ptr() == scales_at
    assert [p.data_ptr() for p in model.parameters()] == addresses
    assert not torch.equal(before, after)


def test_scales_of_unknown_loras_are_refused_and_nothing_changes(tmp_path):
    model = random_model()
    merger, _ = _two_loras(tmp_path, model)
    weight = model.blocks[1].self_attn.k.weight.clone()
    with pytest.raises(ValueError, match="no LoRA named 'c'; loaded: a, b"):
        merger.set_scales({"a": 0.1, "c": 1.0})
    assert merger.scales == {"a": 0.8, "b": -0.4}
    assert torch.equal(model.blocks[1].self_attn.k.weight, weight)


def test_low_vram_merges_from_originals_on_the_cpu_as_on_the_device(tmp_path):
    on_device, off_device = random_model(), random_model()
    path = _lora_file(on_device, tmp_path / "a.safetensors", 1, rank=4, alpha=2.0)
    a, b = LoraMerger(on_device), LoraMerger(off_device, keep_device="cpu")
    a.add(read_lora(path, on_device), 0.6)
    b.add(read_lora(path, off_device), 0.6)
    a.set_scale("a", -0.3)
    b.set_scale("a", -0.3)
    assert b.program is None
    for (k, v), w in zip(on_device.state_dict().items(), off_device.state_dict().values()):
        assert (v - w).abs().max() < 1e-5, k


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("parts", [1, 3])
def test_a_captured_merge_replays_scale_changes_without_recapture(tmp_path, parts):
    model = random_model().to("cuda", torch.bfloat16)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    merger, raw = _two_loras(tmp_path, model, parts)
    merger.capture()
    assert merger.program.captured and merger.program.captures == 1 and merger.program.parts == parts
    for a, b in ((0.3, 1.1), (-0.7, 0.0), (0.0, 0.0)):
        merger.set_scales({"a": a, "b": b}, spread=True)  # the parts' graphs, one a step
        while merger.step():
            pass
        torch.cuda.synchronize()
        name = "blocks.1.ffn.2.weight"
        ref, size = _reference({k: v.cpu() for k, v in original.items()}, raw, merger.scales, name)
        got = model.state_dict()[name].double().cpu()
        assert ((got - ref).abs() <= (ref.abs() + size) * 2.0**-8).all()
    assert merger.program.captures == 1
    assert all(torch.equal(v, original[k]) for k, v in model.state_dict().items())


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _whole_and_split(tmp_path, parts: int) -> tuple[LoraMerger, LoraMerger, torch.nn.Module]:
    """The same two LoRAs merged into two copies of one model: in one part, and in `parts`."""
    whole, split = random_model(), random_model()
    split.load_state_dict(whole.state_dict())
    a, _ = _two_loras(tmp_path, whole)
    b = LoraMerger(split, parts=parts)
    for name, scale in a.scales.items():
        b.add(read_lora(tmp_path / f"{name}.safetensors", split), scale)
    return a, b, split


def _same(a: LoraMerger, b: LoraMerger) -> bool:
    return all(torch.equal(v, b.model.state_dict()[k]) for k, v in a.model.state_dict().items())


def test_the_parts_together_are_the_whole_merge_and_each_holds_its_own_layers(tmp_path):
    a, b, split = _whole_and_split(tmp_path, 3)
    assert b.program.parts == 3 and a.program.parts == 1 and _same(a, b)
    b.program.set_scale(0, 1.3)
    before, touched = _weights(split), []
    for part in range(3):
        b.program.run(part)
        now = _weights(split)
        touched.append({k for k in now if not torch.equal(now[k], before[k])})
        before = now
    assert all(touched) and not any(x & y for i, x in enumerate(touched) for y in touched[i + 1:])
    a.set_scales({"a": 1.3})
    assert _same(a, b)


def test_a_spread_change_reaches_every_layer_after_its_parts_and_a_new_one_starts_over(tmp_path):
    a, b, split = _whole_and_split(tmp_path, 4)
    assert b.settled and not b.step()
    original = _weights(split)
    b.set_scales({"a": 0.1}, spread=True)
    assert not b.settled
    assert any(not torch.equal(v, original[k]) for k, v in _weights(split).items())  # the first part, now
    assert b.step()
    b.set_scales({"b": 1.5}, spread=True)  # mid-way: every part is due again, at both new scales
    steps = 0
    while b.step():
        steps += 1
    assert steps == 3 and b.settled
    a.set_scales({"a": 0.1, "b": 1.5})
    assert _same(a, b)
    with pytest.raises(ValueError, match="parts: 0 is not allowed"):
        LoraMerger(split, parts=0)


def _wan_keys(module: str, **tensors: torch.Tensor) -> dict[str, torch.Tensor]:
    """Original-Wan-layout keys of `module`: lora_down= / lora_up= name the factors, the rest their suffix."""
    names = {"lora_down": "lora_down.weight", "lora_up": "lora_up.weight"}
    return {f"diffusion_model.{module}.{names.get(k, k)}": t for k, t in tensors.items()}


@pytest.mark.parametrize("keep", [None, "cpu"])
def test_full_weight_and_bias_deltas_merge_at_the_loras_scale_like_its_low_rank_product(tmp_path, keep):
    """Community Wan LoRAs carry `.diff` (a full weight delta) and `.diff_b` (a bias delta) beside their
    factors: each is added times the LoRA's scale (alpha is the factors' alone), on the device program and
    the low-VRAM host path alike; a linear layer with full deltas alone takes them alone."""
    model = random_model()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(5)
    down, up = torch.randn(4, 48, generator=g), torch.randn(48, 4, generator=g)
    diff, diff_b = torch.randn(48, 48, generator=g), torch.randn(48, generator=g)
    ffn_diff = torch.randn(48, 64, generator=g)
    path = tmp_path / "full.safetensors"
    save_file({**_wan_keys("blocks.0.self_attn.q", lora_down=down, lora_up=up, alpha=torch.tensor(2.0), diff=diff,
                           diff_b=diff_b),
               **_wan_keys("blocks.1.ffn.2", diff=ffn_diff)}, str(path))
    merger = LoraMerger(model, keep_device=keep)
    merger.add(read_lora(path, model), scale=0.7)
    for scale in (0.7, -1.3):
        merger.set_scale("full", scale)
        q, ffn = model.blocks[0].self_attn.q, model.blocks[1].ffn[2]
        expect_q = original["blocks.0.self_attn.q.weight"] + scale * (up @ down * 2.0 / 4) + scale * diff
        assert (q.weight - expect_q).abs().max() < 1e-5
        assert (q.bias - (original["blocks.0.self_attn.q.bias"] + scale * diff_b)).abs().max() < 1e-6
        assert (ffn.weight - (original["blocks.1.ffn.2.weight"] + scale * ffn_diff)).abs().max() < 1e-6
        assert torch.equal(ffn.bias, original["blocks.1.ffn.2.bias"])
    merger.set_scale("full", 0.0)
    assert all(torch.equal(v, original[k]) for k, v in model.state_dict().items())


def _norm_lora(path) -> dict[str, torch.Tensor]:
    """Full deltas of every kind of norm a Wan block has a weight for, beside a low-rank pair: the cross-attention
    LayerNorm's weight and bias (`norm3`), a self-attention RMSNorm and the cross-attention `norm_k` (the text
    K/V are made with it). Saved at `path`; returns the deltas by WanDiT parameter name."""
    g = torch.Generator().manual_seed(11)
    deltas = {name: torch.randn(48, generator=g) * 0.3 for name in
              ("blocks.0.norm3.weight", "blocks.0.norm3.bias", "blocks.1.self_attn.norm_q.weight",
               "blocks.1.cross_attn.norm_k.weight")}
    save_file({**_wan_keys("blocks.0.self_attn.q", lora_down=torch.randn(2, 48, generator=g),
                           lora_up=torch.randn(48, 2, generator=g)),
               **_wan_keys("blocks.0.norm3", diff=deltas["blocks.0.norm3.weight"],
                           diff_b=deltas["blocks.0.norm3.bias"]),
               **_wan_keys("blocks.1.self_attn.norm_q", diff=deltas["blocks.1.self_attn.norm_q.weight"]),
               **_wan_keys("blocks.1.cross_attn.norm_k", diff=deltas["blocks.1.cross_attn.norm_k.weight"])},
              str(path))
    return deltas


@pytest.mark.parametrize("keep, parts", [(None, 1), (None, 3), ("cpu", 1)])
def test_norm_deltas_merge_at_the_loras_scale_and_scale_0_gives_the_originals_back(tmp_path, keep, parts):
    """Community Wan LoRAs carry `.diff` (and `.diff_b`) for the norms' weights (and the LayerNorm's bias), as
    ComfyUI merges them: each parameter is its original plus the LoRA's scale times its delta, on the device
    program (in one part or spread over several) and the low-VRAM host path alike."""
    model = random_model()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    deltas = _norm_lora(tmp_path / "norms.safetensors")
    merger = LoraMerger(model, keep_device=keep, parts=parts)
    merger.add(read_lora(tmp_path / "norms.safetensors", model), scale=0.7)
    for scale in (1.2, -1.3):
        rewritten = merger.set_scales({"norms": scale}, spread=True) | merger.step() | merger.step()
        weights = model.state_dict()
        for name, delta in deltas.items():
            assert (weights[name] - (original[name] + scale * delta)).abs().max() < 1e-6, name
        if keep is None:  # the layers whose weights changed, so the cross-attention K/V of block 1 are remade
            assert {"blocks.0.norm3", "blocks.1.cross_attn.norm_k"} <= rewritten
            assert model.cross_kv_blocks(rewritten) == [1]
    assert not torch.equal(model.blocks[0].norm3.bias, original["blocks.0.norm3.bias"])
    merger.set_scale("norms", 0.0)
    while merger.step():
        pass
    assert all(torch.equal(v, original[k]) for k, v in model.state_dict().items())


def test_a_bf16_norm_merge_rounds_once_from_float32():
    """A norm's weight is its original plus every LoRA's scaled delta summed in float32, rounded to the
    weight's dtype once (two LoRAs on one norm: one rounding, not one a LoRA)."""
    model = random_model().to(torch.bfloat16)
    base = model.blocks[0].norm3.weight.detach().clone()
    g = torch.Generator().manual_seed(3)
    files = []
    for name in ("a", "b"):
        delta = torch.randn(48, generator=g)
        files.append((LoraFile(name, Path(name), {"blocks.0.norm3": LowRank(None, None, diff=delta)}), delta))
    merger = LoraMerger(model)
    for (lora, _), scale in zip(files, (0.3, -0.9)):
        merger.add(lora, scale)
    expect = (base.float() + (0.3 * files[0][1] - 0.9 * files[1][1])).to(torch.bfloat16)
    assert torch.equal(model.blocks[0].norm3.weight, expect)


def test_norm_deltas_in_diffusers_names_reach_the_same_norms(tmp_path):
    """diffusers names a block's cross-attention norm norm2 (Wan's norm3) and its FFN norm norm3 (Wan's norm2,
    with no weight); a file whose layers have diffusers' names is read in those names, one in Wan's in Wan's."""
    model = random_model()
    g = torch.Generator().manual_seed(4)
    pair = {"transformer.blocks.0.attn1.to_q.lora_A.weight": torch.randn(2, 48, generator=g),
            "transformer.blocks.0.attn1.to_q.lora_B.weight": torch.randn(48, 2, generator=g)}
    norm2, norm_k = torch.randn(48, generator=g), torch.randn(48, generator=g)
    path = tmp_path / "hf.safetensors"
    save_file({**pair, "transformer.blocks.0.norm2.diff": norm2, "transformer.blocks.1.attn2.norm_k.diff": norm_k},
              str(path))
    lora = read_lora(path, model)
    assert torch.equal(lora.modules["blocks.0.norm3"].diff, norm2)
    assert torch.equal(lora.modules["blocks.1.cross_attn.norm_k"].diff, norm_k)
    save_file({**pair, "transformer.blocks.0.norm3.diff": norm2}, str(path))
    with pytest.raises(LoraError, match=r"deltas for norms that only normalise.*: blocks\.0\.norm2\.diff$"):
        read_lora(path, model)


def test_deltas_for_norms_without_a_weight_and_for_other_parameters_are_refused_naming_their_keys(tmp_path):
    """Wan's norm1, norm2 and the head's norm only normalise (elementwise_affine=False: no weight or bias to
    add a delta to), and a modulation is no layer the merger adapts: such a file is refused before an engine
    starts, naming those keys and why, in every layout that names them."""
    path = tmp_path / "norms.safetensors"
    save_file({**_wan_keys("blocks.0.self_attn.q", lora_down=torch.zeros(2, 48), lora_up=torch.zeros(48, 2)),
               **_wan_keys("blocks.0.norm1", diff=torch.zeros(48)),
               **_wan_keys("blocks.1.norm2", diff=torch.zeros(48), diff_b=torch.zeros(48)),
               "lora_unet_head_norm.diff": torch.zeros(48),
               **_wan_keys("blocks.0.norm3", diff=torch.zeros(48))}, str(path))
    with torch.device("meta"):
        model = WanDiT(CFG)
    with pytest.raises(LoraError) as refused:
        read_lora(path, model, meta=True)
    said = str(refused.value)
    assert said.startswith(f"{path}: deltas for norms that only normalise, with no weight or bias to add them to "
                           "(elementwise_affine=False: Wan's norm1, norm2 and the head's norm): ")
    assert sorted(said.rsplit(": ", 1)[1].split(", ")) == ["blocks.0.norm1.diff", "blocks.1.norm2.diff",
                                                           "blocks.1.norm2.diff_b", "head.norm.diff"]
    save_file({**_wan_keys("head.modulation", diff=torch.zeros(1, 2, 48)),
               **_wan_keys("blocks.0.norm3", lora_down=torch.zeros(2, 48), lora_up=torch.zeros(48, 2))}, str(path))
    with pytest.raises(LoraError) as refused:
        read_lora(path, model, meta=True)
    said = str(refused.value)
    assert said.startswith(f"{path}: updates for parameters a LoRA does not merge into (") and "\n" not in said
    assert "norms with a weight take .diff and .diff_b" in said
    assert sorted(said.rsplit(": ", 1)[1].split(", ")) == ["blocks.0.norm3.lora_down", "blocks.0.norm3.lora_up",
                                                           "head.modulation.diff"]


def test_a_lora_with_norm_deltas_from_the_config_is_merged_and_changed_live_in_a_stream(tmp_path):
    """End to end on the tiny model: `--lora` with norm deltas passes the check before a start, is merged at
    load and changes the output; a live scale change rewrites the norms and remakes the text K/V that the
    cross-attention's `norm_k` makes; at scale 0 the norms are the originals again."""
    import numpy as np

    from loom_live.engine.config import load_config
    from loom_live.engine.host_overrides import lora_override
    from loom_live.engine.models.loading import check_weight_files
    from loom_live.engine.stream.session import StreamSession

    path = tmp_path / "norms.safetensors"
    g = torch.Generator().manual_seed(8)
    dim = DIT_PRESETS["tiny"].dim
    deltas = {n: torch.randn(dim, generator=g) for n in ("blocks.1.norm3", "blocks.2.cross_attn.norm_k",
                                                         "blocks.0.self_attn.norm_q")}
    save_file({f"diffusion_model.{n}.diff": d for n, d in deltas.items()}, str(path))
    frames = np.random.default_rng(0).integers(0, 256, (5, 32, 32, 3), np.uint8)
    small = ["resolution.width=32", "resolution.height=32", "stream.lora_merge_parts=2"]
    cfg = load_config("tiny-random", [*lora_override([f"{path}:1.0"]), *small])
    check_weight_files(cfg)
    with StreamSession.from_config(load_config("tiny-random", small), warmup=False) as s:
        plain = s.push(frames)
        original = {n: s.models.dit.get_submodule(n).weight.clone() for n in deltas}
    with StreamSession.from_config(cfg, warmup=False) as s:
        dit = s.models.dit
        assert len(plain) and (s.push(frames) != plain).any()
        for scale in (1.0, 0.25, 0.0):
            if scale != 1.0:
                s.set_params(lora_scales={"norms": scale})
                s.push(frames[:4])  # a chunk a part of the merge
                s.push(frames[:4])
                assert s.models.lora.settled
            for n, d in deltas.items():
                assert (dit.get_submodule(n).weight - (original[n] + scale * d)).abs().max() < 1e-6, (n, scale)
            fresh = dit.cross_kv(s.prompt.current()[None])
            assert all(torch.equal(s.denoiser.cross.k[i], fresh.k[i]) for i in fresh.k)
        assert all(torch.equal(dit.get_submodule(n).weight, w) for n, w in original.items())


def test_a_rank_0_lora_is_refused_before_a_start_not_divided_by_at_load(tmp_path):
    """A lora_down of no rows passed the pre-start check and divided by zero (alpha / rank) at load."""
    from loom_live.engine.config import load_config
    from loom_live.engine.host_overrides import lora_override
    from loom_live.engine.models.loading import check_weight_files

    dim = DIT_PRESETS["tiny"].dim
    path = tmp_path / "empty.safetensors"
    save_file(_wan_keys("blocks.0.self_attn.q", lora_down=torch.zeros(0, dim), lora_up=torch.zeros(dim, 0),
                        alpha=torch.tensor(8.0)), str(path))
    said = "^" + re.escape(f"{path}: rank-0 updates") + r"[^\n]*: blocks\.0\.self_attn\.q$"
    with pytest.raises(LoraError, match=said):
        check_weight_files(load_config("tiny-random", lora_override([str(path)])))
    with pytest.raises(LoraError, match=said):
        read_lora(path, random_model(DIT_PRESETS["tiny"]))


def test_a_bias_delta_for_a_linear_layer_without_a_bias_is_refused_by_the_pre_start_read(tmp_path):
    """A `.diff_b` on a layer with no bias passed `read_lora` on the meta model (the check before an engine
    starts) and was refused only when the merger took it, at model load."""
    path = tmp_path / "bias.safetensors"
    save_file({**_wan_keys("blocks.0.self_attn.q", lora_down=torch.zeros(2, 48), lora_up=torch.zeros(48, 2),
                           diff_b=torch.zeros(48)),
               **_wan_keys("blocks.1.ffn.2", diff=torch.zeros(48, 64), diff_b=torch.zeros(48)),
               **_wan_keys("blocks.1.self_attn.k", diff_b=torch.zeros(48)),
               **_wan_keys("blocks.0.self_attn.norm_k", diff=torch.zeros(48), diff_b=torch.zeros(48))}, str(path))
    with torch.device("meta"):
        model = WanDiT(CFG)
    model.blocks[0].self_attn.q.bias = None
    model.blocks[1].ffn[2].bias = None
    said = "^" + re.escape(f"{path}: bias deltas for layers that have no bias: ") + r"[^\n]*$"
    with pytest.raises(LoraError, match=said) as refused:
        read_lora(path, model, meta=True)
    assert sorted(str(refused.value).rsplit(": ", 1)[1].split(", ")) == [
        "blocks.0.self_attn.norm_k.diff_b", "blocks.0.self_attn.q.diff_b", "blocks.1.ffn.2.diff_b"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_captured_merge_replays_a_full_weight_delta_at_each_new_scale(tmp_path):
    """The `.diff` terms are added inside the captured program, their scale read from the scales tensor: a live
    change replays them at the new scale without recapture (a linear layer's and the norms' weights, the
    LayerNorm's bias, all written in place), and scale 0 gives the original weights back."""
    model = random_model().to("cuda", torch.bfloat16)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(9)
    down, up = torch.randn(4, 48, generator=g) * 0.2, torch.randn(48, 4, generator=g) * 0.2
    diff = torch.randn(48, 48, generator=g) * 0.1
    norms = {name: torch.randn(48, generator=g) * 0.1 for name in
             ("blocks.0.norm3.weight", "blocks.0.norm3.bias", "blocks.1.cross_attn.norm_k.weight")}
    path = tmp_path / "full.safetensors"
    save_file({**_wan_keys("blocks.0.self_attn.q", lora_down=down, lora_up=up, diff=diff),
               **_wan_keys("blocks.0.norm3", diff=norms["blocks.0.norm3.weight"], diff_b=norms["blocks.0.norm3.bias"]),
               **_wan_keys("blocks.1.cross_attn.norm_k", diff=norms["blocks.1.cross_attn.norm_k.weight"])}, str(path))
    merger = LoraMerger(model)
    merger.add(read_lora(path, model), scale=0.5)
    merger.capture()
    addresses = [p.data_ptr() for p in model.parameters()]
    for scale in (-1.2, 0.5, 0.0):
        merger.set_scale("full", scale)
        torch.cuda.synchronize()
        base = original["blocks.0.self_attn.q.weight"].double().cpu()
        bf = torch.bfloat16
        expect = base + scale * (up.to(bf).double() @ down.to(bf).double()) + scale * diff.to(bf).double()
        got = model.blocks[0].self_attn.q.weight.double().cpu()
        assert (got - expect).abs().max() < 0.02, scale
        weights = model.state_dict()
        for name, delta in norms.items():  # summed in float32, rounded to bf16 once
            ref = original[name].double().cpu() + scale * delta.double()
            assert ((weights[name].double().cpu() - ref).abs() <= ref.abs() * 2.0**-8 + 1e-6).all(), (name, scale)
    assert merger.program.captures == 1 and [p.data_ptr() for p in model.parameters()] == addresses
    assert all(torch.equal(v, original[k]) for k, v in model.state_dict().items())
