"""Saved compiled steps: a new process loads what the last one compiled, for any weights of the same
layout, with the same results and histories as the eager step; a damaged file is built again."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loom_live.engine.cache.vae_cache import FrameCache
from loom_live.engine.graphs import saved_compiles
from loom_live.engine.graphs.saved_compiles import SAVED, SavedCompile, compiled_folder, make_folder, signature

ROOT = Path(__file__).resolve().parents[2]

# A step shaped like the VAE's: a module whose forward reads and rewrites a history cache it is given.
SCRIPT = '''
import json, sys
import torch
from torch import nn
from loom_live.engine.cache.vae_cache import FrameCache
from loom_live.engine.graphs.saved_compiles import SAVED, SavedCompile

class Step(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, cache):
        full = cache.extend("proj", x, 2, dim=1)
        return torch.tanh(self.proj(full)).mean(1, keepdim=True) + x

def run(step, module, seed):
    torch.manual_seed(seed)
    cache = FrameCache()
    module(torch.randn(1, 2, 8), cache)  # primes the history, as a stream's plain first call does
    xs = [torch.randn(1, 3, 8) for _ in range(3)]
    with torch.no_grad():
        outs = [step(x, cache) for x in xs]
    return torch.cat(outs, 1), cache.buffers["proj"]

folder, weights_seed, prebuild = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "prebuild"
torch.manual_seed(weights_seed)
module = Step().requires_grad_(False)
step = SavedCompile(type(module).forward, __import__("pathlib").Path(folder), "step", owner=module)
out, history = run(step, module, 7)
ref_out, ref_history = run(module, module, 7)
other = FrameCache()
with torch.no_grad():
    module(torch.randn(1, 2, 8), other)
    if prebuild:  # a second signature, built and saved before the stance
        step(torch.randn(1, 4, 8), other)
    torch.compiler.set_stance("eager_on_recompile")  # as a session after its warm-up
    step(torch.randn(1, 4, 8), other)  # saved: loaded; otherwise it would run eagerly
    step(torch.randn(1, 5, 8), other)  # never saved: eager, nothing built
print(json.dumps({"loaded": SAVED.loaded, "built": SAVED.built, "fallbacks": SAVED.fallbacks,
                  "out": (out - ref_out).abs().max().item(), "history": (history - ref_history).abs().max().item(),
                  "files": sorted(p.name for p in __import__("pathlib").Path(folder).iterdir())}))
'''


def _run(tmp_path: Path, folder: Path, seed: int, prebuild: bool = False) -> dict:
    script = tmp_path / "step_script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "TORCHINDUCTOR_FX_GRAPH_CACHE": "1"}
    out = subprocess.run([sys.executable, str(script), str(folder), str(seed), "prebuild" if prebuild else "-"],
                         cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "log": out.stderr}


@pytest.mark.slow
def test_a_new_process_loads_the_saved_steps_for_other_weights_and_rebuilds_a_damaged_file(tmp_path):
    folder = tmp_path / "compiled"
    first = _run(tmp_path, folder, seed=0, prebuild=True)
    assert (first["loaded"], first["built"], first["fallbacks"]) == (0, 2, 0)
    assert first["out"] < 1e-5 and first["history"] == 0.0
    assert len(first["files"]) == 2  # two signatures; the eager call under the stance saved nothing

    # other weights, same layout: the same files serve, the second one loaded under the stance
    second = _run(tmp_path, folder, seed=1)
    assert (second["loaded"], second["built"], second["fallbacks"]) == (2, 0, 0)
    assert second["out"] < 1e-5 and second["history"] == 0.0 and second["files"] == first["files"]

    damaged = folder / first["files"][0]
    damaged.write_bytes(b"not a saved function")
    third = _run(tmp_path, folder, seed=2)
    assert (third["loaded"], third["built"]) == (1, 1) and "did not load" in third["log"]
    assert third["out"] < 1e-5 and third["history"] == 0.0 and third["files"] == first["files"]
    assert damaged.stat().st_size > 1000  # written again, whole


def test_signatures_key_on_layout_not_on_values_and_refuse_what_they_cannot_key():
    a, b = FrameCache(), FrameCache()
    a.buffers["conv"], b.buffers["conv"] = torch.zeros(1, 4, 2), torch.ones(1, 4, 2)
    assert signature((torch.zeros(2, 3), a)) == signature((torch.ones(2, 3), b))
    b.started = True
    assert signature(a) != signature(b)
    assert signature(torch.zeros(2, 3)) != signature(torch.zeros(3, 2).t())  # strides count
    assert signature(torch.zeros(2, 3)) != signature(torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(TypeError, match="cannot key a step on a Linear"):
        signature(torch.nn.Linear(2, 2))


def test_an_argument_it_cannot_key_falls_back_to_torch_compile_with_a_warning(tmp_path, caplog):
    step = SavedCompile(lambda x, op: op(x) + 1, tmp_path / "compiled", "odd")
    before = SAVED.fallbacks
    with torch.compiler.set_stance("force_eager"), caplog.at_level(logging.WARNING):  # no compile needed here
        out = step(torch.ones(2), torch.neg)
        step(torch.ones(2), torch.neg)
    assert torch.equal(out, torch.zeros(2)) and SAVED.fallbacks == before + 1
    assert sum("cannot key a step on a builtin_function_or_method" in r.message for r in caplog.records) == 1
    assert not (tmp_path / "compiled").exists()


def test_a_torch_that_cannot_save_compiles_falls_back_saying_so_once(tmp_path, monkeypatch, caplog):
    monkeypatch.delattr(torch.compiler, "load_compiled_function")
    saved_compiles.torch_saves_compiles.cache_clear()
    steps = [SavedCompile(lambda x: x * 2, tmp_path, name) for name in ("a", "b")]
    try:
        with torch.compiler.set_stance("force_eager"), caplog.at_level(logging.WARNING):
            assert [torch.equal(step(torch.ones(2)), torch.full((2,), 2.0)) for step in steps] == [True, True]
    finally:
        saved_compiles.torch_saves_compiles.cache_clear()
    assert sum("cannot save compiled functions" in r.message for r in caplog.records) == 1
    assert not any(tmp_path.iterdir())


def test_a_torch_that_gates_aot_compile_behind_its_setting_still_builds_whole(tmp_path, monkeypatch):
    """torch 2.11 attaches `aot_compile` to a compiled function only under `enable_aot_compile` (off there)."""
    import torch._dynamo.config

    monkeypatch.setattr(torch._dynamo.config, "enable_aot_compile", False)
    step = SavedCompile(lambda x: torch.tanh(x) * 2, tmp_path, "gated")
    before = (SAVED.built, SAVED.fallbacks)
    out = step(torch.linspace(-1, 1, 8))
    assert torch.allclose(out, torch.tanh(torch.linspace(-1, 1, 8)) * 2)
    assert (SAVED.built - before[0], SAVED.fallbacks - before[1]) == (1, 0) and len(list(tmp_path.iterdir())) == 1
    assert torch._dynamo.config.enable_aot_compile is False  # turned on only while the step was made


class _Step:
    """What `aot_compile` returns, writing its file in place as torch 2.11 does; `fail` stops halfway."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail

    def __call__(self, x):
        return x * 2

    def save_compiled_function(self, path: str) -> None:
        with open(path, "wb") as f:
            f.write(b"half a file")
            if self.fail:
                raise OSError("disk full")
            f.write(b" and the rest")


@pytest.mark.parametrize("fail", [False, True])
def test_a_step_is_saved_whole_or_not_at_all(tmp_path, monkeypatch, caplog, fail):
    class Compiled:
        def __init__(self, fn, **kwargs):
            pass

        def aot_compile(self, example):
            return _Step(fail)

    monkeypatch.setattr(torch, "compile", Compiled)
    step = SavedCompile(lambda x: x * 2, tmp_path, "half")
    with caplog.at_level(logging.WARNING):
        assert torch.equal(step(torch.ones(2)), torch.full((2,), 2.0))  # the step runs either way
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    if fail:  # nothing a later start would load, no temporary file left behind
        assert files == {} and "not saved (disk full)" in caplog.text
    else:
        assert files == {step.path(signature((torch.ones(2),))).name: b"half a file and the rest"}


def test_a_start_that_only_loads_compiles_a_missing_step_as_usual_and_loads_a_kept_one(tmp_path, monkeypatch):
    """Without `build` (an ordinary start): no file, the caller's plain compile and nothing written; once
    `loom prepare` (build) has kept the step, the next start loads it."""
    class Compiled:
        def __init__(self, fn, **kwargs):
            pass

        def aot_compile(self, example):
            return _Step(fail=False)

    monkeypatch.setattr(torch, "compile", Compiled)
    monkeypatch.setattr(torch.compiler, "load_compiled_function", lambda f, f_globals: lambda x: x * 5)
    before = (SAVED.loaded, SAVED.built, SAVED.unsaved)
    lazy = SavedCompile(lambda x: x * 2, tmp_path, "lazy", build=False, plain=lambda x: x * 3)
    assert torch.equal(lazy(torch.ones(2)), torch.full((2,), 3.0)) and not any(tmp_path.iterdir())
    assert (SAVED.loaded, SAVED.built, SAVED.unsaved) == (before[0], before[1], before[2] + 1)
    builder = SavedCompile(lambda x: x * 2, tmp_path, "lazy")
    assert torch.equal(builder(torch.ones(2)), torch.full((2,), 2.0)) and len(list(tmp_path.iterdir())) == 1
    again = SavedCompile(lambda x: x * 2, tmp_path, "lazy", build=False, plain=lambda x: x * 3)
    assert torch.equal(again(torch.ones(2)), torch.full((2,), 5.0))  # what load_compiled_function returned
    assert (SAVED.loaded, SAVED.built, SAVED.unsaved) == (before[0] + 1, before[1] + 1, before[2] + 1)


def test_each_signatures_first_call_is_timed_once_under_the_steps_name(tmp_path, monkeypatch):
    monkeypatch.setattr(SAVED, "first_calls", {})
    step = SavedCompile(lambda x: x * 2, tmp_path, "timed", build=False, plain=lambda x: x * 3)
    for n in (2, 2, 3, 2, 3):
        step(torch.ones(n))
    assert list(SAVED.first_calls) == ["timed"] and len(SAVED.first_calls["timed"]) == 2
    assert all(0.0 <= s < 30.0 for s in SAVED.first_calls["timed"])


def test_a_vae_that_only_loads_streams_its_missing_steps_compiled_as_usual(tmp_path):
    from loom_live.engine.models.wan_vae import VAE_PRESETS, WanVAE

    torch.manual_seed(0)
    vae, ref = WanVAE(VAE_PRESETS["tiny"]).eval(), WanVAE(VAE_PRESETS["tiny"]).eval()
    ref.load_state_dict(vae.state_dict())
    vae.compile_step(saved=tmp_path, build_saved=False)
    frames = torch.rand(1, 3, 9, 16, 16) * 2 - 1
    before = (SAVED.built, SAVED.unsaved)
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):  # the plain compile's path, run eagerly
        got, want = vae.new_stream_state(), ref.new_stream_state()
        for piece in (frames[:, :, :1], frames[:, :, 1:5], frames[:, :, 5:]):
            z = vae.encode_stream(piece, got)
            assert torch.equal(z, ref.encode_stream(piece, want))
            assert torch.equal(vae.decode_stream(z, got), ref.decode_stream(z, want))
    signatures = sum(len(step._steps) for step in vae._saved_steps)  # one steady step a direction
    assert signatures == 2 and (SAVED.built, SAVED.unsaved) == (before[0], before[1] + signatures)
    assert not any(tmp_path.iterdir())


def test_the_decoder_s_steady_step_meets_one_signature_from_a_stream_s_first_latent_on(tmp_path):
    """The first latent decodes alone and plain (its temporal upsampling passes it through); every later
    latent, the stream's second included, goes through the same compiled step: one graph to compile, not a
    second one for the call that follows the first latent."""
    from loom_live.engine.models.wan_vae import VAE_PRESETS, WanVAE

    torch.manual_seed(0)
    vae = WanVAE(VAE_PRESETS["tiny"]).eval()
    vae.compile_step(saved=tmp_path, build_saved=False)
    z = torch.randn(1, VAE_PRESETS["tiny"].z_dim, 5, 2, 2)
    state = vae.new_stream_state()
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        for _ in range(2):  # a fresh state, then one reset in place
            for i in range(5):
                vae.decode_stream(z[:, :, i:i + 1], state)
            state.reset()
    assert len(vae._saved_steps[1]._steps) == 1


def test_a_new_folder_removes_its_oldest_siblings_and_keeps_the_recent_ones(tmp_path):
    root = tmp_path / "compiled"
    keys = [c * 16 for c in "edcba"]  # "a..." oldest
    for age, name in enumerate([*keys, "mine"]):
        (root / name).mkdir(parents=True)
        (root / name / "step.bin").write_bytes(b"x")
        os.utime(root / name, (1e9 - age * 1e5, 1e9 - age * 1e5))
    new = compiled_folder(tmp_path, torch.device("cpu"))
    make_folder(new)
    # KEEP_FOLDERS keys in all; a folder no key names is never the engine's to remove
    assert sorted(p.name for p in root.iterdir()) == sorted([*keys[:3], new.name, "mine"])
    make_folder(new)  # an existing folder removes nothing
    assert len(list(root.iterdir())) == saved_compiles.KEEP_FOLDERS + 1


def test_a_folder_of_the_callers_choosing_leaves_its_neighbours_alone(tmp_path):
    """A step saved to a folder the caller names (`WanVAE.compile_step(saved=...)`) removes nothing beside it,
    however many folders sit there."""
    for name in ("work", "photos", "0123456789abcdef", "notes", "music"):
        (tmp_path / name).mkdir()
    make_folder(tmp_path / "steps")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["work", "photos", "0123456789abcdef", "notes", "music", "steps"])


def test_the_folder_changes_with_the_engine_sources_and_the_device(tmp_path, monkeypatch):
    cpu = compiled_folder(tmp_path, torch.device("cpu"))
    assert cpu.parent == tmp_path / "compiled" and cpu == compiled_folder(tmp_path, torch.device("cpu"))
    monkeypatch.setattr(saved_compiles, "_engine_digest", lambda: "another engine")
    other_engine = compiled_folder(tmp_path, torch.device("cpu"))
    monkeypatch.setattr(saved_compiles, "_device_kind", lambda device: "another GPU")
    assert len({cpu, other_engine, compiled_folder(tmp_path, torch.device("cpu"))}) == 3


VAE_SCRIPT = '''
import json, sys
from pathlib import Path
import torch
from loom_live.engine.graphs.saved_compiles import SAVED
from loom_live.engine.models.wan_vae import WanVAE, WanVAEConfig

torch.backends.cudnn.allow_tf32 = False  # float32 convs on both sides: cuDNN's TF32 rounds both differently
torch.manual_seed(int(sys.argv[2]))
cfg = WanVAEConfig(base_dim=16)
vae, ref = WanVAE(cfg).cuda().eval(), WanVAE(cfg).cuda().eval()
ref.load_state_dict(vae.state_dict())
vae.use_channels_last(True)
vae.compile_step(saved=Path(sys.argv[1]))
frames = torch.rand(1, 3, 1 + 4 * 3, 64, 96, device="cuda") * 2 - 1
pieces = [frames[:, :, :1]] + list(frames[:, :, 1:].split(4, dim=2))

def stream(model):
    state = model.new_stream_state()
    z = [model.encode_stream(p, state) for p in pieces]
    return torch.cat(z, 2), torch.cat([model.decode_stream(l, state) for l in z], 2)

with torch.inference_mode():
    (z, x), (z_ref, x_ref) = stream(vae), stream(ref)
print(json.dumps({"loaded": SAVED.loaded, "built": SAVED.built, "fallbacks": SAVED.fallbacks,
                  "z": (z - z_ref).abs().max().item(), "x": (x - x_ref).abs().max().item(),
                  "sum": [z.double().sum().item(), x.double().sum().item()]}))
'''


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the VAE's compiled steps run on CUDA (triton)")
def test_the_vae_steps_saved_by_one_process_stream_in_the_next_as_the_eager_vae(tmp_path):
    script = tmp_path / "vae_script.py"
    script.write_text(VAE_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    runs = []
    for seed in (0, 1, 0):  # the later processes load the steps, for other weights and for the first again
        out = subprocess.run([sys.executable, str(script), str(tmp_path / "compiled"), str(seed)], cwd=ROOT,
                             capture_output=True, text=True, timeout=600, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    built = runs[0]["built"]  # one steady step a direction, in the GPU's channels-last layout too
    assert built == 2 and [(r["loaded"], r["built"], r["fallbacks"]) for r in runs] == [(0, built, 0)] + [
        (built, 0, 0)] * 2
    for r in runs:  # float32: the fused kernels' rounding only
        assert r["z"] < 1e-3 and r["x"] < 1e-3, r
    assert runs[2]["sum"] == runs[0]["sum"]  # loaded, the same code as built


def test_the_vae_streams_its_steady_chunks_through_its_saved_steps(tmp_path, monkeypatch):
    from loom_live.engine.models.wan_vae import VAE_PRESETS, WanVAE

    resolved = []
    monkeypatch.setattr(SavedCompile, "_resolve", lambda self, key, full: resolved.append(self.name) or self.fn)
    torch.manual_seed(0)
    vae, ref = WanVAE(VAE_PRESETS["tiny"]).eval(), WanVAE(VAE_PRESETS["tiny"]).eval()
    ref.load_state_dict(vae.state_dict())
    vae.compile_step(saved=tmp_path)
    frames = torch.rand(1, 3, 9, 16, 16) * 2 - 1
    with torch.no_grad():
        got, want = vae.new_stream_state(), ref.new_stream_state()
        for piece in (frames[:, :, :1], frames[:, :, 1:5], frames[:, :, 5:]):
            z = vae.encode_stream(piece, got)
            assert torch.equal(z, ref.encode_stream(piece, want))
            assert torch.equal(vae.decode_stream(z, got), ref.decode_stream(z, want))
    # the first chunk of each direction runs plain; the steady ones through its one step
    assert set(resolved) == {"wan_vae.encoder", "wan_vae.decoder"}


def _dit_stream(model, device: str) -> torch.Tensor:
    """A tiny DiT streaming four chunks with adaptive sinks, so every block function takes part."""
    torch.manual_seed(1)
    chunks = [torch.randn(1, 16, f, 4, 6, device=device) for f in (2, 1, 1, 1)]
    cache = model.new_cache(1, (4, 6), num_kv_cache=3, sink=1, refresh_at=5, sink_threshold=0.2, device=device)
    cross = model.cross_kv(torch.randn(1, 5, 4096, device=device))
    t = torch.tensor([700.0], device=device)
    return torch.cat([model.forward_stream(x, t, cache, cross) for x in chunks], dim=2)


def test_the_dit_runs_its_block_functions_through_saved_compiles(tmp_path, monkeypatch):
    from loom_live.engine.models.wan_dit import DIT_PRESETS, WanDiT
    from loom_live.engine.models.wan_dit_ops import BlockOps

    resolved = []
    monkeypatch.setattr(SavedCompile, "_resolve", lambda self, key, full: resolved.append(self.name) or self.fn)
    torch.manual_seed(0)
    model = WanDiT(DIT_PRESETS["tiny"]).eval()
    with torch.no_grad():
        want = _dit_stream(model, "cpu")
        model.fuse_elementwise(BlockOps.compiled(saved=tmp_path))
        got = _dit_stream(model, "cpu")
    assert torch.equal(got, want)
    assert {"dit.norm_modulate", "dit.affine_norm", "dit.gated_residual", "dit.rms_norm", "dit.rotate",
            "dit.sink_similarity", "dit.merge_sinks"} <= set(resolved)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled block functions run on CUDA (triton)")
def test_the_dit_block_functions_saved_then_loaded_stream_as_the_eager_ones(tmp_path):
    from loom_live.engine.models.wan_dit import DIT_PRESETS, WanDiT
    from loom_live.engine.models.wan_dit_ops import BlockOps

    torch.manual_seed(0)
    model = WanDiT(DIT_PRESETS["tiny"]).cuda().eval()
    before = (SAVED.loaded, SAVED.built, SAVED.fallbacks)
    with torch.no_grad():
        want = _dit_stream(model, "cuda")
        model.fuse_elementwise(BlockOps.compiled(saved=tmp_path))
        built = _dit_stream(model, "cuda")
        model.fuse_elementwise(BlockOps.compiled(saved=tmp_path))  # fresh functions: they load the files
        loaded = _dit_stream(model, "cuda")
    new = SAVED.built - before[1]
    assert new >= 7 and SAVED.loaded - before[0] == new and SAVED.fallbacks == before[2]
    torch.testing.assert_close(built, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loaded, built, rtol=0, atol=0)
