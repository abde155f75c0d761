"""Wan2.1 VAE: parity with diffusers, streaming == one-shot, stream state, bad input, checkpoints."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import save_file

from loom_live.engine.config import VAEConfig
from loom_live.engine.models.checkpoint_io import CheckpointError
from loom_live.engine.models.taehv import TinyVAE
from loom_live.engine.models.wan_vae import VAE_PRESETS, WanVAE

TOL = 1e-4
TINY = VAE_PRESETS["tiny"]


def _randomize(module: torch.nn.Module, seed: int) -> None:
    """Give the RMS-norm gains (initialised to ones) random values too; weights are random already."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("gamma"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))


def _video(frames: int, size: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(batch, 3, frames, size, size, generator=gen) * 2 - 1


@pytest.fixture(scope="module")
def tiny_vae() -> WanVAE:
    torch.manual_seed(0)
    vae = WanVAE(TINY).eval()
    _randomize(vae, 1)
    return vae


@torch.no_grad()
def test_default_architecture_matches_diffusers(tmp_path):
    """9 frames through the real Wan2.1 architecture, weights loaded from a diffusers file.

    32x32 rather than 64x64 keeps this under ~10 s on a 2-core CPU (64x64 takes ~25 s); the
    size does not change which code paths run (first frame alone, then a 4-frame chunk with
    carried caches, both temporal resamplers, the mid-block attention). The decoder upsamples as
    loading sets it up by default (phase convolutions; the other forms are checked against it
    in test_phase_upsample.py).
    """
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    ref = AutoencoderKLWan().eval()
    _randomize(ref, 2)
    path = tmp_path / "diffusion_pytorch_model.safetensors"
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(path))
    vae = WanVAE.from_checkpoint(tmp_path, VAE_PRESETS["wan2.1"])

    x = _video(9, 32)
    z_ref = ref.encode(x).latent_dist.mode()
    z = vae.encode(x)
    assert z.shape == (1, 16, 3, 4, 4)
    assert (z - z_ref).abs().max() < TOL

    x_ref = ref.decode(z_ref).sample
    vae.use_upsample(VAEConfig().upsample)
    x_out = vae.decode(z_ref)
    assert x_out.shape == (1, 3, 9, 32, 32)
    assert (x_ref.abs() < 0.99).float().mean() > 0.25, "a saturated decoder would make the check weak"
    assert (x_out - x_ref).abs().max() < TOL

    vae.use_thin_convs()  # the GPU's form of the pixel-side convs (test_thin_conv.py)
    assert (vae.encode(x) - z_ref).abs().max() < TOL
    assert (vae.decode(z_ref) - x_ref).abs().max() < TOL

    vae.use_attention("matmul")  # the mid blocks' attention as two matrix products (`vae.attention`)
    assert (vae.encode(x) - z_ref).abs().max() < TOL
    assert (vae.decode(z_ref) - x_ref).abs().max() < TOL
    with pytest.raises(ValueError, match="allowed: kernel, matmul"):
        vae.use_attention("flash")


@torch.no_grad()
@pytest.mark.parametrize("chunks", [[1, 4, 4, 4], [5, 8], [9, 4], [13]])
def test_stream_encode_equals_one_shot(tiny_vae, chunks):
    x = _video(sum(chunks), 32, seed=3, batch=2)
    whole = tiny_vae.encode(x)
    state = tiny_vae.new_stream_state()
    parts, start = [], 0
    for n in chunks:
        parts.append(tiny_vae.encode_stream(x[:, :, start:start + n], state))
        start += n
    assert [p.shape[2] for p in parts] == [1 + (chunks[0] - 1) // 4] + [n // 4 for n in chunks[1:]]
    assert (torch.cat(parts, dim=2) - whole).abs().max() < TOL


@torch.no_grad()
@pytest.mark.parametrize("chunks", [[1, 1, 1, 1], [2, 2], [1, 3]])
def test_stream_decode_equals_one_shot(tiny_vae, chunks):
    z = torch.randn(1, 16, sum(chunks), 4, 4, generator=torch.Generator().manual_seed(4))
    whole = tiny_vae.decode(z)
    assert whole.shape[2] == 1 + 4 * (z.shape[2] - 1)
    state = tiny_vae.new_stream_state()
    parts, start = [], 0
    for n in chunks:
        parts.append(tiny_vae.decode_stream(z[:, :, start:start + n], state))
        start += n
    assert parts[0].shape[2] == 1 + 4 * (chunks[0] - 1)
    assert all(p.shape[2] == 4 * n for p, n in zip(parts[1:], chunks[1:]))
    assert (torch.cat(parts, dim=2) - whole).abs().max() < TOL


@torch.no_grad()
def test_state_copy_and_reset(tiny_vae):
    x = _video(13, 16, seed=5)
    state = tiny_vae.new_stream_state()
    first = tiny_vae.encode_stream(x[:, :, :5], state)
    snapshot = state.copy()
    a = tiny_vae.encode_stream(x[:, :, 5:9], state)
    tiny_vae.encode_stream(-x[:, :, 9:13], state)  # advance the original with other frames
    b = tiny_vae.encode_stream(x[:, :, 5:9], snapshot)  # the copy did not move
    assert torch.equal(a, b)
    state.reset()
    assert torch.equal(tiny_vae.encode_stream(x[:, :, :5], state), first)


@torch.no_grad()
def test_stream_memory_is_flat(tiny_vae):
    """The stream state is allocated on the first chunks and then only overwritten in place."""
    state = tiny_vae.new_stream_state()
    x = _video(1 + 4 * 8, 16, seed=6)
    tiny_vae.decode_stream(tiny_vae.encode_stream(x[:, :, :5], state), state)
    tiny_vae.decode_stream(tiny_vae.encode_stream(x[:, :, 5:9], state), state)

    def layout():
        caches = (state.encoder, state.decoder)
        return {k: (v.data_ptr(), tuple(v.shape)) for c in caches for k, v in c.buffers.items()}

    before, size = layout(), state.nbytes()
    for i in range(9, x.shape[2], 4):
        tiny_vae.decode_stream(tiny_vae.encode_stream(x[:, :, i:i + 4], state), state)
    assert layout() == before and state.nbytes() == size
    assert size < 2 * 1024 * 1024  # 2 frames per causal conv at 16x16, tiny widths


@torch.no_grad()
def test_normalisation_switches(tiny_vae):
    x = _video(5, 16, seed=7)
    raw = tiny_vae.encode(x)
    mean = torch.tensor(TINY.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(TINY.latents_std).view(1, -1, 1, 1, 1)
    normed = WanVAE(dataclasses.replace(TINY, normalize_on_encode=True, denormalize_on_decode=True)).eval()
    normed.load_state_dict(tiny_vae.state_dict())
    assert torch.allclose(normed.encode(x), (raw - mean) / std, atol=1e-5)
    assert torch.allclose(normed.decode((raw - mean) / std), tiny_vae.decode(raw), atol=TOL)


@pytest.mark.parametrize("vae_class", [WanVAE, TinyVAE])
def test_bad_pixel_input_is_explained(vae_class, tiny_vae):
    vae = tiny_vae if vae_class is WanVAE else TinyVAE().eval()
    state = vae.new_stream_state()
    with pytest.raises(ValueError, match="3 \\(RGB\\) channels"):
        vae.encode_stream(torch.zeros(1, 4, 5, 16, 16), state)
    with pytest.raises(ValueError, match="1 \\+ 4k frames"):
        vae.encode_stream(torch.zeros(1, 3, 4, 16, 16), state)
    with pytest.raises(ValueError, match="multiples of 8"):
        vae.encode_stream(torch.zeros(1, 3, 5, 20, 16), state)
    with pytest.raises(ValueError, match=r"\[B, 3, T, H, W\]"):
        vae.encode(torch.zeros(3, 5, 16, 16))
    with torch.no_grad():
        vae.encode_stream(torch.zeros(1, 3, 1, 16, 16), state)
        with pytest.raises(ValueError, match="multiple of 4 frames"):
            vae.encode_stream(torch.zeros(1, 3, 5, 16, 16), state)
        with pytest.raises(ValueError, match="reset"):
            vae.encode_stream(torch.zeros(1, 3, 4, 24, 16), state)
    with pytest.raises(ValueError, match="16 latent channels"):
        vae.decode(torch.zeros(1, 4, 2, 2, 2))


def test_checkpoint_of_another_model_is_explained(tmp_path, tiny_vae):
    taehv = tmp_path / "taew2_1.pth"
    torch.save(TinyVAE().state_dict(), taehv)
    with pytest.raises(CheckpointError, match="taew2_1.pth") as err:
        WanVAE.from_checkpoint(taehv, TINY)
    assert "encoder.2.conv.weight" in str(err.value) and "encoder.conv_in.weight" in str(err.value)
    assert "TAEHV" in str(err.value)

    dit = tmp_path / "diffusion_pytorch_model.safetensors"
    save_file({"blocks.0.self_attn.q.weight": torch.zeros(4, 4), "patch_embedding.weight": torch.zeros(4)},
              str(dit))
    with pytest.raises(CheckpointError, match="DiT") as err:
        WanVAE.from_checkpoint(dit, TINY)
    assert "patch_embedding.weight" in str(err.value) and str(dit) in str(err.value)

    wan = tmp_path / "wan_vae.safetensors"
    save_file({k: v.contiguous() for k, v in tiny_vae.state_dict().items()}, str(wan))
    with pytest.raises(CheckpointError, match="Wan2.1 VAE"):
        TinyVAE.from_checkpoint(wan)
    # the tiny preset's file into the full-size architecture
    with pytest.raises(CheckpointError, match="shape mismatches"):
        WanVAE.from_checkpoint(wan, VAE_PRESETS["wan2.1"])


def test_partial_checkpoint_names_missing_keys(tmp_path, tiny_vae):
    sd = {k: v.contiguous() for k, v in tiny_vae.state_dict().items()
          if not k.startswith("decoder.mid_block")}
    path = tmp_path / "partial.safetensors"
    save_file(sd, str(path))
    with pytest.raises(CheckpointError, match="missing keys.*decoder.mid_block"):
        WanVAE.from_checkpoint(path, TINY)


@pytest.mark.gpu
@torch.no_grad()
def test_graphed_decode_step_matches_eager_on_gpu(tiny_vae):
    from loom_live.engine.graphs.vae_steps import GraphedStep

    vae = WanVAE(TINY).to("cuda").eval()
    vae.load_state_dict(tiny_vae.state_dict())
    z = torch.randn(1, 16, 4, 8, 8, device="cuda")
    state = vae.new_stream_state()
    vae.decode_stream(z[:, :, :1], state)
    eager_state = state.copy()
    step = GraphedStep(lambda latents: vae.decode_stream(latents, state), z[:, :, 1:2], cache=state.decoder)
    for i in range(1, 4):
        expected = vae.decode_stream(z[:, :, i:i + 1], eager_state)
        assert (step(z[:, :, i:i + 1]) - expected).abs().max() < 1e-3


@pytest.mark.gpu
@torch.no_grad()
def test_graphed_session_steps_after_a_first_frame_alone_match_eager_on_gpu(tiny_vae):
    """The session's path: the first frame (first latent) alone and uncompiled, then every later piece
    from a graph captured right after it, while some layers' histories do not exist yet (the first
    frame passes the temporal resamplers alone); the graphs' stream equals the eager one."""
    from loom_live.engine.graphs.vae_steps import VAEGraphs

    vae = WanVAE(TINY).to("cuda").eval()
    vae.load_state_dict(tiny_vae.state_dict())
    x = _video(13, 16, seed=6).cuda()
    graphs, eager = VAEGraphs(enabled=True), VAEGraphs(enabled=False)
    got_state, ref_state = vae.new_stream_state(), vae.new_stream_state()

    def both(direction, step, t, spans):
        return [torch.cat([g.run(direction, step, t[:, :, a:b], st) for a, b in spans], 2)
                for g, st in ((graphs, got_state), (eager, ref_state))]

    z_got, z_ref = both("encode", vae.encode_stream, x, ((0, 5), (5, 13)))
    assert (z_got - z_ref).abs().max() < 1e-3
    x_got, x_ref = both("decode", vae.decode_stream, z_ref, ((0, 2), (2, 4)))
    assert (x_got - x_ref).abs().max() < 1e-3


@torch.no_grad()
def test_bfloat16_stream_stays_close_to_float32(tiny_vae):
    """The fast dtype: same stream in bf16, compared with float32 (diffusers' bf16 error is ~1e-2 here)."""
    x = _video(9, 16, seed=8)
    z32, x32 = tiny_vae.encode(x), tiny_vae.decode(tiny_vae.encode(x))
    vae = WanVAE(TINY).eval()
    vae.load_state_dict(tiny_vae.state_dict())
    vae.to(torch.bfloat16)
    state = vae.new_stream_state()
    z = torch.cat([vae.encode_stream(x[:, :, :5], state), vae.encode_stream(x[:, :, 5:], state)], dim=2)
    out = torch.cat([vae.decode_stream(z32[:, :, i:i + 1].bfloat16(), state) for i in range(3)], dim=2)
    assert z.dtype == out.dtype == torch.bfloat16
    assert (z.float() - z32).abs().max() < 0.05 and (out.float() - x32).abs().max() < 0.1


@torch.no_grad()
def test_a_float16_vae_hands_back_the_models_dtype_and_stays_closer_to_float32_than_bfloat16(tiny_vae):
    """`vae.dtype=float16` under a bfloat16 model: what goes out is the model's dtype, and float16's three
    more mantissa bits keep the stream nearer float32 than the bfloat16 VAE it replaces."""
    x = _video(9, 16, seed=8)
    z32 = tiny_vae.encode(x)
    x32 = tiny_vae.decode(z32)

    def errors(dtype: torch.dtype, io: torch.dtype | None) -> tuple[float, float]:
        vae = WanVAE(TINY).eval()
        vae.load_state_dict(tiny_vae.state_dict())
        vae.to(dtype)
        vae.use_io_dtype(io)
        state = vae.new_stream_state()
        z = torch.cat([vae.encode_stream(x[:, :, :5], state), vae.encode_stream(x[:, :, 5:], state)], dim=2)
        out = torch.cat([vae.decode_stream(z32[:, :, i:i + 1].bfloat16(), state) for i in range(3)], dim=2)
        assert z.dtype == out.dtype == (io or dtype)
        return (z.float() - z32).abs().max().item(), (out.float() - x32).abs().max().item()

    assert errors(torch.float16, torch.bfloat16)[1] < 0.1  # the bfloat16 edges: bfloat16 noise, as the test above
    half, bf16 = errors(torch.float16, torch.float32), errors(torch.bfloat16, None)
    assert half[0] < bf16[0] / 2 and half[1] < bf16[1] / 2, (half, bf16)


@pytest.mark.gpu
@torch.no_grad()
def test_the_full_size_vae_in_float16_on_gpu_stays_closer_to_float32_than_bfloat16():
    """The 1.3B's VAE layout (random weights, channels-last, cuDNN's whole kernel list, as a float16 VAE
    loads): float16's error against float32 is under half bfloat16's, in both directions."""
    from loom_live.engine.config import load_config
    from loom_live.engine.models.loading import load_models

    torch.backends.cudnn.benchmark_limit = 10
    load_models(load_config("tiny-random", ["model.device=cuda", "vae.dtype=float16"]))
    assert torch.backends.cudnn.benchmark_limit == 0  # what loading a float16 VAE sets on a GPU
    torch.manual_seed(0)
    ref = WanVAE(VAE_PRESETS["wan2.1"]).eval()
    _randomize(ref, 3)
    x = _video(9, 64, seed=9).cuda()

    def run(dtype: torch.dtype, z_in: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode the clip, and decode `z_in` (the float32 latents) or its own."""
        vae = WanVAE(VAE_PRESETS["wan2.1"]).eval()
        vae.load_state_dict(ref.state_dict())
        vae.to("cuda", dtype)
        vae.use_io_dtype(torch.float32)
        vae.use_channels_last()
        z = vae.encode(x)
        return z, vae.decode(z if z_in is None else z_in)

    z32, x32 = run(torch.float32)
    (zh, xh), (zb, xb) = run(torch.float16, z32), run(torch.bfloat16, z32)
    assert torch.isfinite(xh).all()
    assert (zh - z32).abs().max() < (zb - z32).abs().max() / 2
    assert (xh - x32).abs().max() < (xb - x32).abs().max() / 2


@torch.no_grad()
def test_batch_rows_are_independent(tiny_vae):
    x = _video(5, 16, seed=9, batch=2)
    z = tiny_vae.encode(x)
    assert (z[1:] - tiny_vae.encode(x[1:])).abs().max() < TOL
    assert (tiny_vae.decode(z)[:1] - tiny_vae.decode(z[:1])).abs().max() < TOL


@torch.no_grad()
def test_session_steps_run_one_latent_at_a_time_and_equal_whole_chunks(tiny_vae):
    """VAEGraphs starts a stream with its first frame alone and cuts everything after into one-latent
    steps (one graph / compiled shape for every chunk size); the streaming caches make that exact."""
    from loom_live.engine.graphs.vae_steps import VAEGraphs

    x = _video(13, 16, seed=3)
    steps, seen = VAEGraphs(enabled=False), []

    def encode(piece, state):
        seen.append(piece.shape[2])
        return tiny_vae.encode_stream(piece, state)

    whole, pieces = tiny_vae.new_stream_state(), tiny_vae.new_stream_state()
    z_whole = torch.cat([tiny_vae.encode_stream(x[:, :, :5], whole), tiny_vae.encode_stream(x[:, :, 5:], whole)], 2)
    z_pieces = torch.cat([steps.run("encode", encode, x[:, :, :5], pieces),
                          steps.run("encode", encode, x[:, :, 5:], pieces)], 2)
    assert seen == [1, 4, 4, 4]
    assert (z_pieces - z_whole).abs().max() < TOL
    out_whole = torch.cat([tiny_vae.decode_stream(z_whole[:, :, :1], whole),
                           tiny_vae.decode_stream(z_whole[:, :, 1:], whole)], 2)
    out_pieces = torch.cat([steps.run("decode", tiny_vae.decode_stream, z_whole[:, :, :1], pieces),
                            steps.run("decode", tiny_vae.decode_stream, z_whole[:, :, 1:], pieces)], 2)
    assert out_pieces.shape == out_whole.shape == (1, 3, 13, 16, 16)
    assert (out_pieces - out_whole).abs().max() < TOL


@pytest.mark.parametrize("tune", [False, True])
def test_compile_step_passes_the_tuning_switch_to_inductor(monkeypatch, tune):
    """`vae.tune_kernels` reaches Inductor as its coordinate-descent option, for both halves."""
    calls = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: calls.append((type(self).__name__, kw)))
    WanVAE(VAE_PRESETS["tiny"]).compile_step(tune=tune)
    options = {"coordinate_descent_tuning": True} if tune else None
    assert calls == [("Encoder", {"dynamic": False, "options": options}),
                     ("Decoder", {"dynamic": False, "options": options})]


@torch.no_grad()
def test_a_compiled_vae_runs_a_streams_first_call_uncompiled():
    """`compile_step` compiles the steady step only: a stream's first call (its own shapes, an empty
    history) runs the plain forward, so it costs no graph of its own; the stream's output is unchanged."""
    import torch._dynamo

    torch.manual_seed(0)
    vae = WanVAE(TINY).eval()
    _randomize(vae, 1)
    x = _video(9, 32, seed=5)
    ref_state = vae.new_stream_state()
    ref = [vae.encode_stream(x[:, :, :1], ref_state), vae.encode_stream(x[:, :, 1:5], ref_state)]
    torch._dynamo.reset()
    vae.encoder.compile(backend="eager", dynamic=False)  # the mechanism compile_step uses, without Inductor
    try:
        torch._dynamo.utils.counters.clear()
        state = vae.new_stream_state()
        got = [vae.encode_stream(x[:, :, :1], state)]
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0
        got.append(vae.encode_stream(x[:, :, 1:5], state))
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    finally:
        torch._dynamo.reset()
    for a, b in zip(got, ref):
        assert (a - b).abs().max() < TOL
