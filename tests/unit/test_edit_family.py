"""The edit family (engine/edit) on a CPU with the tiny config: adapter, compile, streams, batching."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loom_live.engine.config import ConfigError, load_config
from loom_live.engine.edit.checkpoint import CheckpointError, load_lllite, load_unet
from loom_live.engine.edit.lllite import LLLite, select_hooks
from loom_live.engine.edit.loading import load_edit_models
from loom_live.engine.edit.schedule import EulerFlowSchedule, dynamic_shift, shifted_sigmas
from loom_live.engine.edit.session import EditSession
from loom_live.engine.edit.unet import UNET_PRESETS, EditUNet
from loom_live.engine.session_api import EngineSession
from tests.fakes.edit_tiny import B, random_frames, tiny_edit_cfg


def _stream(session: EditSession, frames: np.ndarray, sizes: list[int]) -> np.ndarray:
    outs, i = [], 0
    for n in sizes:
        outs.append(session.push(frames[i:i + n]))
        i += n
    outs.append(session.flush())
    return np.concatenate([o for o in outs if len(o)])


def _unet_inputs(unet: EditUNet, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, 4, 4, 8, generator=g), torch.full((B,), 1000.0), torch.randn(B, 6, 24, generator=g),
            torch.ones(B, 6, dtype=torch.bool), torch.tensor([[32.0, 32.0]] * B))


def _lllite(unet: EditUNet, subset: str = "all") -> LLLite:
    return LLLite(unet.hook_sizes(4), select_hooks(unet.hook_points(), subset), (32, 32), B).eval()


@torch.inference_mode()
def test_zero_initialised_adapter_leaves_the_unet_output_unchanged():
    torch.manual_seed(0)
    unet = EditUNet(UNET_PRESETS["tiny"]).eval()
    lllite = _lllite(unet)
    lllite.set_condition(torch.rand(B, 3, 32, 32) * 2 - 1)
    args = _unet_inputs(unet)
    plain = unet(*args)
    assert torch.equal(unet(*args, adapter=lllite), plain)
    for hook in lllite.modules_dict.values():  # a trained adapter does change it ...
        torch.nn.init.normal_(hook.up[0].weight)
    assert not torch.allclose(unet(*args, adapter=lllite), plain)
    lllite.set_strength(0.0)  # ... unless its strength is zero
    assert torch.equal(unet(*args, adapter=lllite), plain)


def test_hook_subsets():
    with torch.device("meta"):
        unet = EditUNet(UNET_PRESETS["dreamlite-mobile"])
    points = unet.hook_points()
    assert len(select_hooks(points, "all")) == 108 and len(select_hooks(points, "down")) == 38
    assert select_hooks(points, "none") == []
    with pytest.raises(ValueError, match="'some' is not allowed; expected one of all, down, none"):
        select_hooks(points, "some")


def test_flow_matching_schedule_shift_and_one_step():
    assert dynamic_shift(64, 64) == pytest.approx(0.5 + (1.16 - 0.5) / (4096 - 256) * (1024 - 256))
    assert shifted_sigmas(1, 0.63) == [1.0, 0.0]  # one step starts at pure noise whatever the shift
    four = shifted_sigmas(4, 0.63)
    assert four[0] == 1.0 and four[-1] == 0.0 and all(a > b for a, b in zip(four, four[1:]))
    assert four[2] > 0.5  # shifted toward noise (unshifted: 0.5)
    s = EulerFlowSchedule(1, 64, 64)
    noise, v = torch.randn(3), torch.randn(3)
    assert s.timestep(0) == 1000.0 and torch.allclose(s.step(0, noise, v), noise - v)


def test_compiled_equals_eager_and_never_recompiles_across_50_batches_of_changing_frames_prompts():
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    torch._dynamo.reset()
    cfg = tiny_edit_cfg("edit.prompt_refresh_every=1", "edit.cond_refresh_every=2")
    eager = EditSession(cfg, load_edit_models(cfg))
    compiled = EditSession(tiny_edit_cfg("edit.compile=true", "edit.prompt_refresh_every=1",
                                         "edit.cond_refresh_every=2"),
                           load_edit_models(cfg), compile_backend=counting_backend)
    for i in range(50):
        outs = []
        for session in (eager, compiled):
            if i % 5 == 0:
                session.set_prompt(f"style number {i}, with {'many ' * (i % 7)}words")
            if i % 7 == 0:
                session.set_params(adapter_strength=0.5 + i / 100)
            outs.append(session.push(random_frames(B, seed=100 + i)))
        assert outs[0].shape == outs[1].shape == (B, 32, 32, 3)
        assert np.abs(outs[0].astype(int) - outs[1].astype(int)).max() <= 1
    assert compiled.stats()["batches"] == 50 and compiled.stats()["prompt_encodes"] == 50
    assert len(graphs) == 3  # UNet + adapter + Euler, VAE encode, VAE decode: each compiled once


def test_two_streams_give_the_same_frames_as_sequential():
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    frames = random_frames(5 * B, seed=2)
    for device in devices:
        results = []
        for two in ("true", "false"):
            cfg = tiny_edit_cfg(f"model.device={device}", f"edit.two_streams={two}", "edit.cond_refresh_every=2",
                       "edit.prompt_refresh_every=2", "model.dtype=float32")
            results.append(_stream(EditSession(cfg, load_edit_models(cfg)), frames, [3, 4, 3]))
        assert np.array_equal(results[0], results[1]), device


def test_frames_in_equal_frames_out_for_any_push_sizes():
    frames = random_frames(13, seed=3)
    session = EditSession(tiny_edit_cfg(), load_edit_models(tiny_edit_cfg()))
    assert isinstance(session, EngineSession)
    whole = _stream(session, frames, [13])
    for sizes in ([1, 0, 4, 3, 5], [13], [2] * 6 + [1], [0, 7, 6]):
        session.reset()
        out = _stream(session, frames, sizes)
        assert out.shape == frames.shape
        assert np.array_equal(out, whole)  # batches are cut by frame count, not by push
    session.reset()  # a size change mid-batch: the old frames leave first, nothing is lost
    small, large = random_frames(3, seed=4, hw=(24, 40)), random_frames(4, seed=5, hw=(40, 40))
    first = session.push(small)
    second = session.push(large)
    rest = session.flush()
    shapes = [f.shape for part in (first, second, rest) for f in part if part.size]
    assert shapes == [(24, 40, 3)] * 3 + [(40, 40, 3)] * 4


class _CountingEncoder:
    def __init__(self, inner) -> None:
        self.inner, self.tokens, self.dim = inner, inner.tokens, inner.dim
        self.frames_per_call: list[int] = []

    def encode(self, text, images):
        self.frames_per_call.append(images.shape[0])
        return self.inner.encode(text, images)


@pytest.mark.parametrize("one_frame", [True, False])
def test_encoder_runs_once_per_n_batches_under_static_caching(one_frame):
    cfg = tiny_edit_cfg("edit.prompt_refresh_every=3", f"edit.prompt_one_frame={str(one_frame).lower()}")
    models = load_edit_models(cfg)
    models.encoder = counter = _CountingEncoder(models.encoder)
    session = EditSession(cfg, models)
    for i in range(10):
        session.push(random_frames(B, seed=i))
    session.set_prompt("a charcoal sketch")  # a new instruction is encoded with the next batch
    session.push(random_frames(B, seed=20))
    session.flush()  # waits for the refresh still running
    assert counter.frames_per_call == [1 if one_frame else B] * 5  # batches 0, 3, 6, 9, and 10 (new prompt)


def test_checkpoints_load_strictly_and_name_what_does_not_match(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    unet = EditUNet(UNET_PRESETS["tiny"]).eval()
    state = {k: v.contiguous() for k, v in unet.state_dict().items()}
    save_file(state, tmp_path / "unet.safetensors")  # a bare weights file: the preset gives the architecture
    loaded = load_unet(tmp_path / "unet.safetensors", UNET_PRESETS["tiny"], torch.device("cpu"), torch.float32)
    args = _unet_inputs(unet)
    with torch.inference_mode():
        assert torch.equal(loaded(*args), unet(*args))
    bad = dict(state)
    gone = bad.pop("conv_out.weight")
    bad["mid_block.attentions.0.extra.weight"] = gone
    bad["conv_in.weight"] = torch.zeros(3, 3, 3, 3)
    save_file(bad, tmp_path / "bad.safetensors")
    with pytest.raises(CheckpointError) as err:
        load_unet(tmp_path / "bad.safetensors", UNET_PRESETS["tiny"], torch.device("cpu"), torch.float32)
    for name in ("conv_out.weight", "mid_block.attentions.0.extra.weight", "conv_in.weight"):
        assert name in str(err.value)
    (tmp_path / "model" / "unet").mkdir(parents=True)  # a config.json that Loom does not build is named
    (tmp_path / "model" / "unet" / "config.json").write_text('{"dual_cross_attention": true}')
    with pytest.raises(CheckpointError, match="dual_cross_attention=True is not supported"):
        load_unet(tmp_path / "model", UNET_PRESETS["tiny"], torch.device("cpu"), torch.float32)
    # another diffusers UNet's config (SD1.5's) is refused by its class, before any weights are looked for
    (tmp_path / "model" / "unet" / "config.json").write_text('{"_class_name": "UNet2DConditionModel"}')
    with pytest.raises(CheckpointError, match="_class_name 'UNet2DConditionModel' is not DreamLite's UNet"):
        load_unet(tmp_path / "model", UNET_PRESETS["tiny"], torch.device("cpu"), torch.float32)

    full = _lllite(unet, "all")  # a released adapter file holds every hook point ...
    save_file({k: v.contiguous() for k, v in full.state_dict().items()}, tmp_path / "lllite.safetensors")
    down = _lllite(unet, "down")  # ... and a run on the down-block subset takes only those
    load_lllite(down, tmp_path / "lllite.safetensors", unet.hook_points(), torch.device("cpu"), torch.float32)
    assert len(down.modules_dict) < len(full.modules_dict)
    stray = {k: v.contiguous() for k, v in full.state_dict().items()}
    stray["modules_dict.up_blocks__9__nowhere.down.0.weight"] = torch.zeros(1)
    save_file(stray, tmp_path / "stray.safetensors")
    with pytest.raises(CheckpointError, match="up_blocks__9__nowhere"):
        load_lllite(_lllite(unet, "down"), tmp_path / "stray.safetensors", unet.hook_points(),
                    torch.device("cpu"), torch.float32)


def test_config_refuses_float16_and_live_params_are_validated():
    with pytest.raises(ConfigError, match="float16 overflows"):
        load_config("edit-tiny", ["model.dtype=float16"])
    with pytest.raises(ConfigError, match="edit.lllite_hooks"):
        load_config("edit-tiny", ["edit.lllite_hooks=up"])
    assert load_config("dreamlite-edit").edit.lllite_hooks == "down"
    session = EditSession(tiny_edit_cfg(), load_edit_models(tiny_edit_cfg()))
    with pytest.raises(ValueError, match="unknown parameter 'steps'"):
        session.set_params(steps=[700])
    with pytest.raises(ValueError, match="adapter_strength"):
        session.set_params(adapter_strength=5.0)
    session.set_params(adapter_strength=0.25, cond_refresh_every=4)
    assert float(session.models.lllite.strength) == 0.25 and session.cfg.edit.cond_refresh_every == 4
    # the edit family takes an instruction: an empty one is refused in its words, not the Wan family's style
    with pytest.raises(ValueError, match=r"empty; give an instruction, such as 'make it a watercolor painting'"):
        session.set_prompt("  ")


def test_the_session_says_where_its_callers_thread_waited():
    """Every hand-over a batch waits for is a stage: the adapter's flow and the prompt refresh (each
    started every 2 batches, handed over one batch later; the first batch's are its own) and the GPU."""
    cfg = tiny_edit_cfg("edit.cond_refresh_every=2", "edit.prompt_refresh_every=2")
    session = EditSession(cfg, load_edit_models(cfg))
    for i in range(10):
        session.push(random_frames(B, seed=i))
    stages = session.stats()["stages_ms"]
    assert stages["host.wait_flow"]["count"] == 4  # started at batches 2, 4, 6, 8; taken at 3, 5, 7, 9
    assert stages["host.wait_prompt"]["count"] == 4
    assert stages["host.wait_gpu"]["count"] == 10
    for name in ("host.wait_flow", "host.wait_prompt", "host.wait_gpu"):
        assert stages[name]["max"] >= stages[name]["mean"] >= 0.0


def test_an_edit_start_says_its_phases_to_a_waiting_host():
    from loom_live.engine.startup_progress import STARTUP_PROGRESS

    said: list[str] = []
    with STARTUP_PROGRESS.to(said.append):
        session = EditSession.from_config(tiny_edit_cfg(), warmup=False)
        session.warmup(batches=1)
    assert said == ["loading the model", f"compiling and warming up on {session.batch} frames"]
