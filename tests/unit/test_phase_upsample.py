"""Phase convolutions for nearest-x2-then-3x3 upsampling, and channels-last Wan VAE chunks:
both must compute what the plain layers compute, up to float32 rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from loom_live.engine.layers.phase_upsample import UPSAMPLE_KINDS, PhaseUpsampleConv
from loom_live.engine.models.wan_vae import VAE_PRESETS, Resample, WanVAE

FAST_KINDS = ("phase", "transposed")


def _reference(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    return conv(F.interpolate(x, scale_factor=2.0, mode="nearest-exact"))


def _close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> bool:
    """Equal up to float32 rounding of sums of a few hundred products (relative to the output's scale)."""
    return bool((a - b).abs().max() <= rel * b.abs().max())


@pytest.fixture(scope="module")
def tiny_vae() -> WanVAE:
    torch.manual_seed(0)
    vae = WanVAE(VAE_PRESETS["tiny"]).eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # random norm gains too, so every weight matters
        for name, p in vae.named_parameters():
            if name.endswith("gamma"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
    return vae


def _fresh(tiny_vae: WanVAE) -> WanVAE:
    vae = WanVAE(VAE_PRESETS["tiny"]).eval().requires_grad_(False)
    vae.load_state_dict(tiny_vae.state_dict())
    return vae


@torch.no_grad()
@pytest.mark.parametrize("kind", FAST_KINDS)
@pytest.mark.parametrize("shape", [(2, 6, 5, 7), (1, 4, 1, 1), (1, 8, 3, 8), (3, 5, 8, 2)])
@pytest.mark.parametrize("bias", [True, False])
def test_phase_conv_equals_upsample_then_conv(kind, shape, bias):
    n, cin, h, w = shape
    torch.manual_seed(h * 31 + w)
    conv = nn.Conv2d(cin, 3, 3, padding=1, bias=bias)
    x = torch.randn(n, cin, h, w)
    y = PhaseUpsampleConv(conv, kind)(x)
    assert y.shape == (n, 3, 2 * h, 2 * w)
    assert _close(y, _reference(conv, x))


@torch.no_grad()
@pytest.mark.parametrize("kind", FAST_KINDS)
def test_phase_conv_keeps_channels_last(kind):
    torch.manual_seed(3)
    conv = nn.Conv2d(8, 4, 3, padding=1).to(memory_format=torch.channels_last)
    x = torch.randn(2, 8, 6, 5).contiguous(memory_format=torch.channels_last)
    layer = PhaseUpsampleConv(conv, kind)
    assert layer.kernel.is_contiguous(memory_format=torch.channels_last)
    y = layer(x)
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert _close(y, _reference(conv, x))


def test_phase_conv_refuses_what_it_cannot_compute():
    with pytest.raises(ValueError, match="3x3 conv with padding 1"):
        PhaseUpsampleConv(nn.Conv2d(4, 4, 5, padding=2))
    with pytest.raises(ValueError, match="kind 'bilinear'; allowed"):
        PhaseUpsampleConv(nn.Conv2d(4, 4, 3, padding=1), "bilinear")
    with pytest.raises(ValueError, match="this resampler is a downsample2d"):
        Resample(4, "downsample2d").use_upsample("phase")


@torch.no_grad()
@pytest.mark.parametrize("kind", FAST_KINDS)
def test_streaming_decode_with_phase_upsampling_equals_nearest(tiny_vae, kind):
    """Both temporal upsamplers' first-frame path, then chunks carried through the stream caches."""
    z = torch.randn(1, 16, 5, 3, 5, generator=torch.Generator().manual_seed(4))
    fast = _fresh(tiny_vae)
    fast.use_upsample(kind)
    plain_state, fast_state = tiny_vae.new_stream_state(), fast.new_stream_state()
    for piece in (z[:, :, :2], z[:, :, 2:3], z[:, :, 3:]):
        expected = tiny_vae.decode_stream(piece, plain_state)
        assert _close(fast.decode_stream(piece, fast_state), expected)
    assert fast.state_dict().keys() == tiny_vae.state_dict().keys(), "checkpoints keep the 3x3 weights only"
    assert fast_state.decoder.nbytes() == plain_state.decoder.nbytes()


@torch.no_grad()
def test_phase_weights_follow_dtype_and_can_be_switched_off(tiny_vae):
    vae = _fresh(tiny_vae)
    vae.use_upsample("phase")
    vae.to(torch.float64)
    resamplers = [m for m in vae.decoder.modules() if isinstance(m, Resample)]
    assert resamplers and all(m.phase.kernel.dtype == torch.float64 for m in resamplers)
    vae.use_upsample("nearest")
    assert all(m.phase is None for m in resamplers)


@torch.no_grad()
@pytest.mark.parametrize("upsample", ["nearest", "phase"])
def test_channels_last_stream_equals_default_layout(tiny_vae, upsample):
    gen = torch.Generator().manual_seed(5)
    x = torch.rand(1, 3, 9, 24, 16, generator=gen) * 2 - 1
    fast = _fresh(tiny_vae)
    fast.use_upsample(upsample)
    fast.use_channels_last()
    plain_state, fast_state = tiny_vae.new_stream_state(), fast.new_stream_state()
    for frames in (x[:, :, :5], x[:, :, 5:]):
        z = tiny_vae.encode_stream(frames, plain_state)
        assert _close(fast.encode_stream(frames, fast_state), z)
        assert _close(fast.decode_stream(z, fast_state), tiny_vae.decode_stream(z, plain_state))
    fast.use_channels_last(False)
    assert all(p.is_contiguous() for p in fast.parameters())


def _convs_keep_channels_last() -> bool:
    conv = nn.Conv3d(2, 2, 3, padding=1).to(torch.bfloat16).to(memory_format=torch.channels_last_3d)
    x = torch.randn(1, 2, 2, 4, 4, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last_3d)
    return conv(x).is_contiguous(memory_format=torch.channels_last_3d)


@pytest.fixture
def layout_keeping_convs(monkeypatch):
    """Where this CPU's convolutions hand back channels-last input in the plain layout (oneDNN keeps it
    only on some CPUs, with AVX-512), make them answer as cuDNN does (channels-last out where the input
    or the weight is channels-last), so that what is checked is whether Loom's own layers keep it."""
    if _convs_keep_channels_last():
        return

    def keeping(conv, layout):
        def run(x, weight, *args, **kwargs):
            y = conv(x, weight, *args, **kwargs)
            last = x.is_contiguous(memory_format=layout) or weight.is_contiguous(memory_format=layout)
            return y.contiguous(memory_format=layout) if last else y

        return run

    for name, layout in (("conv3d", torch.channels_last_3d), ("conv2d", torch.channels_last),
                         ("conv_transpose2d", torch.channels_last)):
        monkeypatch.setattr(F, name, keeping(getattr(F, name), layout))


@torch.no_grad()
@pytest.mark.parametrize("upsample", UPSAMPLE_KINDS)
@pytest.mark.usefixtures("layout_keeping_convs")
def test_channels_last_is_kept_through_the_stream(tiny_vae, upsample):
    """Every history the causal layers keep stays channels-last (a layer that dropped the layout
    would make the next conv convert it back). bf16: CPU convs keep channels-last only there."""
    fast = _fresh(tiny_vae).to(torch.bfloat16)
    fast.use_upsample(upsample)
    fast.use_channels_last()
    state = fast.new_stream_state()
    x = torch.rand(1, 3, 9, 16, 8, generator=torch.Generator().manual_seed(6)) * 2 - 1
    for frames in (x[:, :, :5], x[:, :, 5:]):
        out = fast.decode_stream(fast.encode_stream(frames, state), state)
    histories = [*state.encoder.buffers.values(), *state.decoder.buffers.values()]
    assert out.is_contiguous(memory_format=torch.channels_last_3d)
    assert histories and all(h.is_contiguous(memory_format=torch.channels_last_3d) for h in histories)
    temporal = next(m for m in fast.decoder.modules() if isinstance(m, Resample) and m.mode == "upsample3d")
    doubled = temporal._double_frames(torch.randn(1, 32, 2, 3, 2, dtype=torch.bfloat16)
                                      .contiguous(memory_format=torch.channels_last_3d), state.decoder)
    assert doubled.shape[2] == 4 and doubled.is_contiguous(memory_format=torch.channels_last_3d)


def test_config_switches_reach_the_loaded_vae():
    """`vae.upsample` offers exactly the layer's kinds, and loading applies the chosen one."""
    from loom_live.engine.config import VAEConfig, load_config
    from loom_live.engine.models.loading import load_models

    assert VAEConfig.__dataclass_fields__["upsample"].metadata["choices"] == UPSAMPLE_KINDS
    assert load_config("tiny-random").vae.upsample == "phase"
    models = load_models(load_config("tiny-random", ["vae.upsample=transposed"]))
    kinds = {m.phase.kind for m in models.decoder.decoder.modules() if isinstance(m, Resample)}
    assert kinds == {"transposed"}
    with pytest.raises(ValueError, match="upsample"):
        load_config("tiny-random", ["vae.upsample=bilinear"])
