"""The Wan VAE's convs with 3 channels on one side, rewritten as well-shaped GEMMs: they must
compute what the conv computes (float rounding apart), in a stream too, and refuse other convs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from loom_live.engine.layers.thin_conv import ThinConv3d, thin_kind
from loom_live.engine.models.wan_vae import VAE_PRESETS, CausalConv3d, WanVAE


@torch.no_grad()
@pytest.mark.parametrize("cin, cout, kind", [(3, 16, "stack"), (16, 3, "taps"), (3, 3, "stack"), (4, 40, "stack"),
                                             (40, 1, "taps")])
@pytest.mark.parametrize("shape", [(1, 6, 5, 7), (2, 3, 4, 1), (1, 4, 1, 9)])  # (batch, T + 2 frames, H, W)
@pytest.mark.parametrize("bias", [True, False])
def test_thin_conv_equals_the_conv(cin, cout, kind, shape, bias):
    n, frames, h, w = shape
    torch.manual_seed(cin * 7 + cout + h)
    conv = nn.Conv3d(cin, cout, 3, padding=(0, 1, 1), bias=bias).double()
    x = torch.randn(n, cin, frames, h, w, dtype=torch.float64)
    layer = ThinConv3d(conv)
    assert layer.kind == kind == thin_kind(conv)
    y = layer(x)
    assert y.shape == (n, cout, frames - 2, h, w)
    assert (y - conv(x)).abs().max() < 1e-12


@torch.no_grad()
@pytest.mark.parametrize("cin, cout", [(3, 16), (16, 3)])
def test_thin_conv_keeps_channels_last(cin, cout):
    """A channels-last model gets channels-last frames back: the order the next conv wants."""
    conv = nn.Conv3d(cin, cout, 3, padding=(0, 1, 1)).to(memory_format=torch.channels_last_3d)
    x = torch.randn(1, cin, 6, 5, 4).contiguous(memory_format=torch.channels_last_3d)
    layer = ThinConv3d(conv)
    assert not layer.kernel.is_contiguous()
    y = layer(x)
    assert y.is_contiguous(memory_format=torch.channels_last_3d)
    assert (y - conv(x)).abs().max() < 1e-5


def test_thin_conv_refuses_other_convs():
    assert thin_kind(nn.Conv3d(16, 16, 3, padding=(0, 1, 1))) is None
    assert thin_kind(nn.Conv3d(3, 16, (3, 1, 1))) is None
    assert thin_kind(nn.Conv3d(3, 16, 3, stride=2, padding=(0, 1, 1))) is None
    with pytest.raises(ValueError, match=r"at most 4 input or output channels .*got kernel \(3, 3, 3\).* 16 -> 16"):
        ThinConv3d(nn.Conv3d(16, 16, 3, padding=(0, 1, 1)))
    with pytest.raises(ValueError, match=r"got kernel \(3, 1, 1\).* kind 'stack'"):
        ThinConv3d(nn.Conv3d(3, 16, (3, 1, 1)), "stack")


@torch.no_grad()
@pytest.mark.parametrize("kind", ["stack", "taps"])
def test_either_form_computes_any_fitting_conv(kind):
    """Forced forms (the benchmark times `stack` on the 96-channel convs) compute the same conv."""
    conv = nn.Conv3d(12, 10, 3, padding=(0, 1, 1)).double()
    x = torch.randn(2, 12, 5, 6, 7, dtype=torch.float64)
    assert (ThinConv3d(conv, kind)(x) - conv(x)).abs().max() < 1e-12


def _tiny(seed: int = 0) -> WanVAE:
    torch.manual_seed(seed)
    return WanVAE(VAE_PRESETS["tiny"]).eval().requires_grad_(False)


def _assert_same_stream(plain: WanVAE, other: WanVAE, seed: int) -> None:
    """Two chunks through both VAEs' stream caches (the first with zero history, then real history):
    the same latents and frames, float rounding apart."""
    x = torch.rand(1, 3, 9, 16, 24, generator=torch.Generator().manual_seed(seed)) * 2 - 1
    plain_state, other_state = plain.new_stream_state(), other.new_stream_state()
    for frames in (x[:, :, :5], x[:, :, 5:]):
        z = plain.encode_stream(frames, plain_state)
        assert (other.encode_stream(frames, other_state) - z).abs().max() < 1e-5
        assert (other.decode_stream(z, other_state) - plain.decode_stream(z, plain_state)).abs().max() < 1e-5


@torch.no_grad()
@pytest.mark.parametrize("channels_last", [False, True])
def test_streaming_vae_with_thin_convs_equals_without(channels_last):
    """The encoder's first and the decoder's last conv take the rewrite; chunks carried through the
    stream caches (the first chunk's zero history, then real history) give the same latents and frames."""
    plain, thin = _tiny(), _tiny()
    thin.use_thin_convs()
    if channels_last:
        thin.use_channels_last()
    rewritten = [m for m in thin.modules() if isinstance(m, CausalConv3d) and m.thin is not None]
    assert [m.thin.kind for m in rewritten] == ["stack", "taps"]
    assert thin.encoder.conv_in.thin is not None and thin.decoder.conv_out.thin is not None
    _assert_same_stream(plain, thin, seed=1)
    assert thin.state_dict().keys() == plain.state_dict().keys(), "checkpoints keep the conv weights only"
    thin.use_thin_convs(("taps",))
    assert thin.encoder.conv_in.thin is None and thin.decoder.conv_out.thin.kind == "taps"
    thin.use_thin_convs(())
    assert all(m.thin is None for m in rewritten)
    with pytest.raises(ValueError, match=r"unknown kinds \['gather'\]; allowed: \('stack', 'taps'\)"):
        thin.use_thin_convs(("gather",))


@torch.no_grad()
def test_thin_weights_follow_the_model():
    vae = _tiny()
    vae.use_thin_convs()
    vae.to(torch.float64)
    assert vae.encoder.conv_in.thin.kernel.dtype == torch.float64
    assert vae.decoder.conv_out.thin.bias.dtype == torch.float64


@torch.no_grad()
def test_wide_stacking_takes_the_full_resolution_convs_and_keeps_the_stream():
    """`stack_upto` (`vae.thin_convs=wide` asks for 96, the real model's full-resolution width; the tiny
    preset's is 8) stacks every fitting conv up to that width; the stream's output does not change."""
    plain, wide = _tiny(), _tiny()
    wide.use_thin_convs(stack_upto=8)
    kinds = {name: m.thin.kind for name, m in wide.named_modules() if isinstance(m, CausalConv3d) and m.thin}
    assert kinds["encoder.conv_in"] == "stack" and kinds["decoder.conv_out"] == "taps"
    full_res = [n for n in kinds if n not in ("encoder.conv_in", "decoder.conv_out")]
    assert full_res and all(kinds[n] == "stack" for n in full_res)
    assert all(wide.get_submodule(n).in_channels <= 8 for n in full_res)
    _assert_same_stream(plain, wide, seed=2)
