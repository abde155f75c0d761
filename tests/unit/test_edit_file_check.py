"""The edit family's weight files as a user gives them: each wrong one refused before an engine starts, in one
line naming its key, the file and what the key takes (engine/edit/file_check.py, LoomConfig's path checks)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from loom_live.engine.config import ConfigError, load_config
from loom_live.engine.models.checkpoint_io import CheckpointError
from loom_live.engine.models.loading import check_weight_files

WIDTH = 64  # the tiny Qwen3-VL's hidden size, and the conditioning width of the UNet saved beside it


def _save(module: torch.nn.Module, path: Path) -> Path:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(path))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """edit-tiny's UNet and VAE as bare files, and a DreamLite-layout folder whose UNet takes WIDTH-wide tokens."""
    from loom_live.engine.edit.unet import EditUNet, EditUNetConfig
    from loom_live.engine.edit.unet_config import TINY
    from loom_live.engine.edit.vae import VAE_PRESETS, TinyVAE

    root = tmp_path_factory.mktemp("edit_files")
    torch.manual_seed(0)
    unet = _save(EditUNet(EditUNetConfig.from_diffusers(TINY)), root / "unet.safetensors")
    _save(TinyVAE(VAE_PRESETS["tiny"]), root / "vae.safetensors")
    wide = {**TINY, "encoder_hid_dim": WIDTH}
    (root / "wide" / "unet").mkdir(parents=True)
    (root / "wide" / "unet" / "config.json").write_text(json.dumps(wide))
    _save(EditUNet(EditUNetConfig.from_diffusers(wide)), root / "wide" / "unet" / "model.safetensors")
    (root / "mixed" / "vae").mkdir(parents=True)  # a DreamLite folder whose vae/ holds the UNet's weights
    shutil.copy(unet, root / "mixed" / "unet.safetensors")
    shutil.copy(unet, root / "mixed" / "vae" / "model.safetensors")
    return root


@pytest.mark.parametrize(("key", "given", "what"), [
    ("edit.vae_checkpoint", "unet.safetensors", "expected a TAESD tiny autoencoder"),
    ("edit.checkpoint", "vae.safetensors", "expected a DreamLite UNet"),
    ("edit.lllite", "unet.safetensors", "expected a temporal-LLLite adapter file"),
    ("edit.checkpoint", "mixed", "expected a TAESD tiny autoencoder"),
])
def test_a_file_of_another_part_is_refused_naming_its_key_and_what_it_takes(files, key, given, what):
    """The UNet given as the VAE was refused as `PATH: checkpoint does not match the model; 62 missing keys...`:
    which of the four keys, and what it wanted, was left to guess."""
    with pytest.raises(CheckpointError) as refused:
        check_weight_files(load_config("edit-tiny", [f"{key}={files / given}"]))
    text = str(refused.value)
    assert text.startswith(f"{key}") and str(files / given) in text and what in text and "\n" not in text, text


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
    """A tiny random Qwen3-VL directory as save_pretrained writes it, tokenizer included."""
    pytest.importorskip("transformers.models.qwen3_vl")
    from transformers import Qwen3VLForConditionalGeneration

    from loom_live.engine.edit.encoder import tiny_qwen3vl_config
    from tests.unit.test_edit_oracles import _word_tokenizer

    folder = tmp_path_factory.mktemp("qwen") / "qwen"
    torch.manual_seed(0)
    Qwen3VLForConditionalGeneration(tiny_qwen3vl_config()).save_pretrained(folder)
    _word_tokenizer("make it a watercolor").save_pretrained(folder)
    return folder


def _qwen_run(files: Path, encoder_path: Path | str) -> list[str]:
    return [f"edit.checkpoint={files / 'wide'}", "edit.encoder=qwen3-vl", f"edit.encoder_path={encoder_path}"]


@pytest.mark.parametrize(("damage", "said"), [
    ("tokenizer", "no tokenizer files"),  # transformers built an empty tokenizer and the first encode failed
    ("weights", "missing keys"),  # transformers drew every weight at random and said so in its log only
    ("width", "hidden size 64; this UNet's conditioning is 24 wide"),  # the UNet's first call failed
])
def test_a_qwen3_vl_folder_the_encoder_cannot_use_is_refused_before_an_engine_starts(files, qwen, tmp_path,
                                                                                     damage, said):
    check_weight_files(load_config("edit-tiny", _qwen_run(files, qwen)))  # the whole folder passes
    folder = tmp_path / "qwen"
    shutil.copytree(qwen, folder)
    run = _qwen_run(files, folder)
    if damage == "tokenizer":
        for f in folder.glob("tokenizer*"):
            f.unlink()
    elif damage == "weights":  # another model's weights under the model's file name
        shutil.copy(files / "unet.safetensors", folder / "model.safetensors")
    else:  # edit-tiny's own UNet takes 24-wide tokens
        run = run[1:]
    with pytest.raises(CheckpointError) as refused:
        check_weight_files(load_config("edit-tiny", run))
    text = str(refused.value)
    assert text.startswith("edit.encoder_path: ") and str(folder) in text and said in text, text
    assert "expected a Qwen3-VL-2B model directory" in text and "\n" not in text


def test_a_qwen3_vl_folder_given_under_home_loads(files, qwen, tmp_path, monkeypatch):
    """`~/...` passed the check, and transformers then took it for the name of a hub repository."""
    from loom_live.engine.edit.encoder import Qwen3VLEncoder

    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(qwen, tmp_path / "qwen")
    check_weight_files(load_config("edit-tiny", _qwen_run(files, "~/qwen")))
    encoder = Qwen3VLEncoder.from_pretrained("~/qwen", torch.device("cpu"), torch.float32)
    assert encoder.dim == WIDTH and encoder.tokenizer is not None


@pytest.mark.parametrize("saved_from", ["Qwen3VLForConditionalGeneration", "Qwen3VLModel"])
def test_a_qwen3_vl_saved_from_the_full_or_the_base_class_passes_the_check_and_loads(files, qwen, tmp_path,
                                                                                     saved_from):
    """The base class saves its keys without the hub's `model.` before them, and no language head: transformers
    loads that, yet the check refused it as missing every key."""
    import transformers

    from loom_live.engine.edit.encoder import Qwen3VLEncoder, tiny_qwen3vl_config

    folder = tmp_path / "qwen"
    shutil.copytree(qwen, folder)
    torch.manual_seed(1)  # other weights than the fixture's, saved over them
    saved = getattr(transformers, saved_from)(tiny_qwen3vl_config())
    saved.save_pretrained(folder)
    check_weight_files(load_config("edit-tiny", _qwen_run(files, folder)))
    loaded = Qwen3VLEncoder.from_pretrained(str(folder), torch.device("cpu"), torch.float32).model.state_dict()
    base = saved if saved_from == "Qwen3VLModel" else saved.model
    assert all(torch.equal(loaded[k], v) for k, v in base.state_dict().items())


def test_a_qwen3_vl_in_the_older_layout_transformers_does_not_map_is_refused(files, qwen, tmp_path):
    """`model.layers.*` beside a top-level `visual.*` (the Qwen2-VL-era layout): transformers maps it for no
    Qwen3-VL class and draws the language model at random, so the check refuses it. Should transformers learn
    the layout, the last assertion fails and `qwen3_vl_key` should accept it too."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "qwen"
    shutil.copytree(qwen, folder)
    hub = load_file(str(qwen / "model.safetensors"))
    older = {re.sub(r"^model\.(language_model|visual)\.", lambda m: "model." if m[1] == "language_model"
                    else "visual.", k): v for k, v in hub.items()}
    assert any(k.startswith("model.layers.") for k in older) and any(k.startswith("visual.") for k in older)
    save_file(older, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="missing keys"):
        check_weight_files(load_config("edit-tiny", _qwen_run(files, folder)))


def test_the_hash_encoder_is_as_wide_as_the_checkpoints_unet(files):
    """A checkpoint's own unet/config.json builds the UNet; the hash encoder took the edit.unet preset's width
    and the first batch failed in the UNet's conditioning projection."""
    from loom_live.engine.edit.loading import load_edit_models
    from loom_live.engine.edit.session import EditSession
    from tests.fakes.edit_tiny import B, random_frames, tiny_edit_cfg

    cfg = tiny_edit_cfg(f"edit.checkpoint={files / 'wide'}", "edit.two_streams=false")
    models = load_edit_models(cfg)
    assert models.encoder.dim == models.unet.cfg.context_in == WIDTH
    with EditSession(cfg, models) as session:
        outs = [session.push(random_frames(B)), session.flush()]
    assert sum(len(o) for o in outs) == B


@pytest.mark.parametrize(("preset", "given", "key"), [
    ("dreamlite-edit", "model.checkpoint=/weights/DreamLite-mobile", "model.checkpoint"),
    ("edit-tiny", "vae.taehv_checkpoint=/weights/taesd.pth", "vae.taehv_checkpoint"),
    ("edit-tiny", "lora=[{path: /weights/style.safetensors, scale: 1}]", "lora"),
    ("edit-tiny", "edit.encoder_path=/weights/Qwen3-VL-2B", "edit.encoder_path"),  # edit-tiny's encoder: hash
    ("edit-tiny", "edit.lllite=/weights/lllite.safetensors;edit.lllite_hooks=none", "edit.lllite"),
    ("default", "edit.checkpoint=/weights/DreamLite-mobile", "edit.checkpoint"),
])
def test_a_weights_path_the_family_does_not_read_is_refused(preset, given, key):
    """Each of these was left unread without a word (a --lora on the edit model, the DreamLite folder given as
    model.checkpoint, the edit family's keys on a Wan run)."""
    with pytest.raises(ConfigError, match=rf"{re.escape(key)}: (this run|model\.family=\w+) does not read it"):
        load_config(preset, given.split(";"))
