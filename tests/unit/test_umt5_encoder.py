"""The umT5 text encoder path through transformers, on a tiny locally built model and tokenizer.

Real umT5-XXL weights are 11 GB; the integration (local-only loading, fixed 512-token padding,
zeroed padding positions, the 4096-d check) is the same for a tiny UMT5 saved the same way.
"""

from __future__ import annotations

import re

import pytest
import torch

REASON = "the UMT5 oracle needs the t5 or test extra (transformers, sentencepiece)"
transformers = pytest.importorskip("transformers", reason=REASON)
sentencepiece = pytest.importorskip("sentencepiece", reason=REASON)

from loom_live.engine.config import load_config  # noqa: E402
from loom_live.engine.models.loading import check_weight_files  # noqa: E402
from loom_live.engine.stream.prompts import TEXT_LEN, PromptError, UMT5TextEncoder, make_text_encoder  # noqa: E402

WORDS = "ink wash painting neon city charcoal sketch watercolour oil pastel van gogh brush strokes vivid"


@pytest.fixture(scope="module")
def tiny_umt5(tmp_path_factory):
    folder = tmp_path_factory.mktemp("umt5")
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(f"{WORDS} {i}" for i in range(200)))
    sentencepiece.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(folder / "spm"), vocab_size=60,
                                             pad_id=0, eos_id=1, unk_id=2, bos_id=-1)
    tokenizer = transformers.T5Tokenizer(vocab_file=str(folder / "spm.model"), extra_ids=0)
    tokenizer.save_pretrained(folder)
    cfg = transformers.UMT5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)
    torch.manual_seed(0)
    transformers.UMT5EncoderModel(cfg).save_pretrained(folder)
    return folder


def test_umt5_encodes_to_fixed_length_with_zeroed_padding(tiny_umt5):
    enc = UMT5TextEncoder(tiny_umt5, device="cpu", dtype=torch.float32)
    out = enc.encode(["ink wash painting", "neon city"])
    assert out.shape == (2, TEXT_LEN, 32) and enc.dim == 32
    tokens = (out.abs().sum(-1) > 0).sum(-1)
    assert 2 <= int(tokens[0]) < 20  # a few real tokens, the rest zeroed padding
    assert out[0, 30:].abs().sum() == 0
    assert not torch.equal(out[0], out[1])
    assert torch.equal(enc.encode(["ink wash painting"])[0], out[0])


def test_umt5_width_must_match_the_model(tiny_umt5):
    with pytest.raises(PromptError, match="32-d but the model expects text_dim 4096"):
        make_text_encoder("umt5", 4096, str(tiny_umt5), "cpu")


def test_missing_umt5_directory(tmp_path):
    with pytest.raises(PromptError, match="umT5 directory not found"):
        UMT5TextEncoder(tmp_path / "nope")


def test_a_folder_that_is_not_umt5_is_refused_naming_it_and_what_it_lacks(tmp_path, tiny_umt5):
    """`loom encode-prompts --encoder-path DIR` (or prompt.path) on a folder that is not umT5 got transformers'
    own message, which named no folder and blamed a missing sentencepiece; and `loom play` started an engine
    that failed on it. Now the folder and what it lacks are named, and the run is refused before an engine."""
    wrong = tmp_path / "downloads"
    wrong.mkdir()
    (wrong / "notes.txt").write_text("not a model")
    lacks = "lacks a tokenizer (tokenizer.json or spiece.model), the encoder's config.json, the encoder's weights"
    with pytest.raises(PromptError, match=re.escape(f"{wrong}: not a umT5 directory (prompt.path): it {lacks}")):
        UMT5TextEncoder(wrong)
    with pytest.raises(PromptError, match="not a umT5 directory"):
        check_weight_files(load_config("tiny-random", ["prompt.encoder=umt5", f"prompt.path={wrong}"]))
    check_weight_files(load_config("tiny-random", ["prompt.encoder=umt5", f"prompt.path={tiny_umt5}"]))
    from loom_live.engine.stream.prompts import umt5_folders

    pulled = tmp_path / "pulled"  # the diffusers layout `loom pull` fetches, sharded
    for name in ("text_encoder/config.json", "text_encoder/model-00001-of-00001.safetensors", "tokenizer/spiece.model"):
        (pulled / name).parent.mkdir(parents=True, exist_ok=True)
        (pulled / name).write_bytes(b"")
    assert umt5_folders(pulled) == (pulled / "tokenizer", pulled / "text_encoder")
