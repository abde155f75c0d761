"""The Hugging Face repositories and files `loom pull` fetches for each Wan preset.

These names were checked against the upstream projects (the README's weights section says where);
a test pins them so that a change to one is deliberate, never a typo that only shows as a 404 at a
user's first `loom pull`.
"""

from __future__ import annotations

import json

import pytest

from loom_live.engine.models.weights import PRESET_WEIGHTS


@pytest.mark.parametrize(("preset", "size", "causal"), [("wan2.1-1.3b", "1.3B", "wan_causal_dmd_v2v"),
                                                        ("wan2.1-14b", "14B", "wan_causal_dmd_v2v_14b")])
def test_each_wan_preset_pulls_the_checked_upstream_files(preset, size, causal):
    sources = {s.key: s for s in PRESET_WEIGHTS[preset]}
    assert set(sources) == {"model.checkpoint", "vae.checkpoint", "prompt.path"}
    generator, vae, text = sources["model.checkpoint"], sources["vae.checkpoint"], sources["prompt.path"]
    assert (generator.repo, generator.files, generator.target) == (
        "jerryfeng/StreamDiffusionV2", (f"{causal}/model.pt",), f"{causal}/model.pt")
    assert (vae.repo, vae.files, vae.target) == (f"Wan-AI/Wan2.1-T2V-{size}", ("Wan2.1_VAE.pth",), "Wan2.1_VAE.pth")
    # Loom's umT5 encoder reads the transformers layout: the diffusers copy's tokenizer/ and text_encoder/
    assert (text.repo, set(text.files), text.target) == (
        f"Wan-AI/Wan2.1-T2V-{size}-Diffusers", {"tokenizer/*", "text_encoder/*"}, "")
    assert all(s.licence.startswith("Apache-2.0") for s in sources.values())


def test_the_dreamlite_edit_preset_pulls_the_released_files_and_says_they_are_non_commercial(capsys):
    from loom_live.engine.config import load_config
    from loom_live.engine.models.weights import weight_sources
    from loom_live.plugin.cli.main import main

    sources = {s.key: s for s in weight_sources(load_config("dreamlite-edit"))}
    unet, encoder, lllite = sources["edit.checkpoint"], sources["edit.encoder_path"], sources["edit.lllite"]
    # diffusers' layout of DreamLite-mobile is its `diffusers` revision (unet/, vae/, scheduler/)
    assert (unet.repo, unet.revision, set(unet.files), unet.target) == (
        "carlofkl/DreamLite-mobile", "diffusers", {"unet/*", "vae/*", "scheduler/*"}, "")
    assert (encoder.repo, encoder.licence) == ("Qwen/Qwen3-VL-2B-Instruct", "Apache-2.0")
    assert lllite.target == "temporal_lllite_step001440.safetensors"
    assert "non-commercial" in unet.licence and "non-commercial" in lllite.licence
    assert main(["pull", "dreamlite-edit", "--list"]) == 0
    out = capsys.readouterr()
    assert "NON-COMMERCIAL" in out.err and "carlofkl/DreamLite-mobile (revision diffusers)" in out.out
    assert weight_sources(load_config("edit-tiny")) == ()  # seeded tiny weights: nothing to pull


def test_an_unpulled_dreamlite_edit_run_is_refused_naming_its_pull(tmp_path, monkeypatch):
    from loom_live.engine.config import load_config
    from loom_live.host_bridge.wire.errors import UserError
    from loom_live.plugin.cli.preflight import check_weights

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # an empty cache
    with pytest.raises(UserError, match=r"preset 'dreamlite-edit' needs .*edit\.checkpoint.*edit\.encoder_path.*"
                                        r"Run `loom pull dreamlite-edit`"):
        check_weights(load_config("dreamlite-edit"))
    check_weights(load_config("dreamlite-edit", ["model.random_weights=true"]))  # a benchmark: no adapter needed
@pytest.mark.parametrize(("preset", "size"), [("wan2.1-vace-1.3b", "1.3B"), ("wan2.1-vace-14b", "14B")])
def test_each_vace_preset_pulls_the_vace_release(preset, size):
    sources = {s.key: s for s in PRESET_WEIGHTS[preset]}
    assert set(sources) == {"model.checkpoint", "vae.checkpoint", "prompt.path"}
    dit, vae = sources["model.checkpoint"], sources["vae.checkpoint"]
    assert dit.repo == vae.repo == f"Wan-AI/Wan2.1-VACE-{size}"
    assert vae.files == ("Wan2.1_VAE.pth",)
    assert sources["prompt.path"].repo == f"Wan-AI/Wan2.1-T2V-{size}-Diffusers"


def test_sharded_vace_dit_is_found_in_the_cache_by_its_pattern(tmp_path):
    from loom_live.engine.models.weights import cached_path

    (source,) = [s for s in PRESET_WEIGHTS["wan2.1-vace-14b"] if s.key == "model.checkpoint"]
    snapshot = tmp_path / "models--Wan-AI--Wan2.1-VACE-14B" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (tmp_path / "models--Wan-AI--Wan2.1-VACE-14B" / "refs").mkdir()
    (tmp_path / "models--Wan-AI--Wan2.1-VACE-14B" / "refs" / "main").write_text("abc")
    assert cached_path(source, tmp_path) is None
    for i in range(1, 7):  # a pull stopped before the last shard: not the model yet
        (snapshot / f"diffusion_pytorch_model-{i:05d}-of-00007.safetensors").write_bytes(b"")
        assert cached_path(source, tmp_path) is None
    (snapshot / "diffusion_pytorch_model-00007-of-00007.safetensors").write_bytes(b"")
    assert cached_path(source, tmp_path) == snapshot


def test_a_text_encoder_pull_stopped_between_its_shards_is_not_taken_for_the_encoder(tmp_path):
    """A Ctrl-C during the umT5 shards leaves the tokenizer, the config and some shards (the index, listed
    after them, not yet); a shard whose download failed its check leaves a link to nothing. Neither passes
    for the encoder, so a run says it is missing instead of failing at load mid-show."""
    from loom_live.engine.models.weights import cached_path

    (source,) = [s for s in PRESET_WEIGHTS["wan2.1-1.3b"] if s.key == "prompt.path"]
    repo = tmp_path / "models--Wan-AI--Wan2.1-T2V-1.3B-Diffusers"
    snapshot = repo / "snapshots" / "abc"
    for folder in ("tokenizer", "text_encoder"):
        (snapshot / folder).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc")
    (snapshot / "tokenizer" / "spiece.model").write_bytes(b"t")
    (snapshot / "text_encoder" / "config.json").write_text("{}")
    shards = [f"model-{i:05d}-of-00002.safetensors" for i in (1, 2)]
    (snapshot / "text_encoder" / shards[0]).write_bytes(b"w")
    assert cached_path(source, tmp_path) is None
    (snapshot / "text_encoder" / shards[1]).symlink_to(repo / "blobs" / "removed")  # a link to nothing
    assert cached_path(source, tmp_path) is None
    (snapshot / "text_encoder" / shards[1]).unlink()
    (snapshot / "text_encoder" / shards[1]).write_bytes(b"w")
    weight_map = {"a": shards[0], "b": shards[1], "c": "model-extra.safetensors"}
    (snapshot / "text_encoder" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert cached_path(source, tmp_path) is None  # the index names a shard that is not there
    (snapshot / "text_encoder" / "model-extra.safetensors").write_bytes(b"w")
    assert cached_path(source, tmp_path) == snapshot


@pytest.mark.parametrize("command", ["play", "serve"])
def test_a_mistyped_path_is_said_before_the_weights_still_to_pull(tmp_path, monkeypatch, command):
    """`-c wan2.1-1.3b --set model.checkpoint=/nope` with nothing pulled listed the VAE and encoder to pull and
    never said that /nope is not there."""
    import argparse

    from loom_live.engine.config import load_config
    from loom_live.engine.server.main import _session_factory
    from loom_live.host_bridge.wire.errors import UserError
    from loom_live.plugin.cli.preflight import check_weights

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # an empty cache
    nope = tmp_path / "nope.pt"
    overrides = [f"model.checkpoint={nope}"]
    with pytest.raises((UserError, ValueError), match=rf"^{nope}: no such file or directory$"):  # said as exit 2
        if command == "play":
            check_weights(load_config("wan2.1-1.3b", overrides))
        else:
            _session_factory(argparse.Namespace(config="wan2.1-1.3b", overrides=overrides, loras=[], gpus=None,
                                                passthrough=False, warmup=False, warmup_share=1.0))


def test_a_vace_preset_checks_a_given_checkpoint_against_its_own_architecture(tmp_path):
    """A VACE preset's checkpoint (given, or found once pulled) was looked up among the plain DiT presets:
    a KeyError and a traceback (exit 1) before any check."""
    from safetensors.torch import save_file

    from loom_live.engine.config import load_config
    from loom_live.engine.models.wan_vace import VACE_PRESETS, WanVaceDiT
    from loom_live.host_bridge.wire.errors import UserError
    from loom_live.plugin.cli.preflight import check_weights

    path = tmp_path / "vace.safetensors"
    save_file({k: v.contiguous() for k, v in WanVaceDiT(VACE_PRESETS["tiny-vace"]).state_dict().items()
               if not k.startswith("vace_blocks.1.")}, str(path))
    with pytest.raises(UserError, match=r"vace\.safetensors: checkpoint does not match the model; \d+ missing keys"):
        check_weights(load_config("tiny-vace", [f"model.checkpoint={path}"]))
    save_file({k: v.contiguous() for k, v in WanVaceDiT(VACE_PRESETS["tiny-vace"]).state_dict().items()}, str(path))
    check_weights(load_config("tiny-vace", [f"model.checkpoint={path}"]))


def test_the_embedded_preset_takes_a_training_runs_file_and_refuses_a_wan_checkpoint(tmp_path):
    """README: weights of a training run of your own, `--set model.checkpoint=PATH` with the default preset. The
    check read that file as a Wan DiT checkpoint and refused it (exit 2) though the engine loads it."""
    import torch
    from safetensors.torch import save_file

    from loom_live.engine.config import load_config
    from loom_live.engine.models.embedded import EMBEDDED_DIT, EMBEDDED_VAE, save_embedded
    from loom_live.engine.models.frame_vae import FrameVAE
    from loom_live.engine.models.wan_dit import DIT_PRESETS, WanDiT
    from loom_live.host_bridge.wire.errors import UserError
    from loom_live.plugin.cli.preflight import check_weights

    run = tmp_path / "run.safetensors"
    save_embedded(run, WanDiT(EMBEDDED_DIT), FrameVAE(EMBEDDED_VAE), {})
    check_weights(load_config("default", [f"model.checkpoint={run}"]))
    wan = tmp_path / "dit.safetensors"
    save_file({k: v.contiguous() for k, v in WanDiT(DIT_PRESETS["tiny"]).state_dict().items()}, str(wan))
    with pytest.raises(UserError, match=r"dit\.safetensors: checkpoint does not match the model; \d+ missing keys"):
        check_weights(load_config("default", [f"model.checkpoint={wan}"]))
    torch.save({"generator": {"patch_embedding.weight": torch.zeros(1)}}, tmp_path / "model.pt")
    with pytest.raises(UserError, match=r"model\.pt: the embedded preset reads one \.safetensors file"):
        check_weights(load_config("default", [f"model.checkpoint={tmp_path / 'model.pt'}"]))


def test_a_weights_path_this_user_cannot_read_is_one_line_not_a_traceback(tmp_path, monkeypatch):
    """A checkpoint inside a folder the user may not enter: `Path.exists` raises PermissionError (not a
    ValueError), which ended `loom play` and `loom serve` with a traceback."""
    from loom_live.engine.config import load_config
    from loom_live.host_bridge.wire.errors import UserError
    from loom_live.plugin.cli.preflight import check_weights
    from tests.fakes.disk import deny_entering

    closed = tmp_path / "closed"
    deny_entering(monkeypatch, closed)
    with pytest.raises(UserError, match=rf"^{closed / 'dit.safetensors'}: cannot be read \(Permission denied\)$"):
        check_weights(load_config("tiny-random", [f"model.checkpoint={closed / 'dit.safetensors'}"]))
