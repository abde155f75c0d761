"""Free-text prompt -> style condition, with a table that ships with Loom (no model, no download).

The embedded model knows a fixed set of styles (engine/train/styles.py). This encoder finds the
style a prompt means: the prompt's words are looked up in a word-vector table distilled from a
sentence-embedding model at build time (engine/train/text_table.py), averaged with IDF-like
weights, and compared (cosine) with every description of every style embedded the same way.
The nearest style wins, and its condition vector (what the DiT was trained on) is returned. An
unrelated prompt still gets the nearest style; `describe` says which and how near, and the
session reports it in its stats.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import torch

TABLE_PACKAGE = "loom_live.engine.models"
TABLE_NAME = "weights/style_text.npz"
TOKEN = re.compile(r"[a-z][a-z\-]*")


class StyleTableError(ValueError):
    """The shipped table is missing or does not fit the model (a prompt error to the session)."""


def table_path() -> Path:
    return Path(str(resources.files(TABLE_PACKAGE).joinpath(TABLE_NAME)))


@dataclass(frozen=True)
class StyleMatch:
    style: str
    similarity: float  # cosine, -1..1; about 0.5 and above: the prompt names this style
    runner_up: str
    known_words: int  # prompt words found in the table

    def to_dict(self) -> dict:
        return {"style": self.style, "similarity": round(self.similarity, 3), "runner_up": self.runner_up,
                "known_words": self.known_words}


class StyleTextEncoder:
    """`encode(texts) -> [N, text_len, dim]`: the nearest style's condition vector in token 0."""

    def __init__(self, text_dim: int, text_len: int, path: str | Path | None = None) -> None:
        path = Path(path) if path is not None else table_path()
        if not path.is_file():
            raise StyleTableError(f"{path}: the style text table is missing (reinstall Loom)")
        with np.load(path) as t:
            self.words = {str(w): i for i, w in enumerate(t["words"])}
            self.vectors = t["vectors"].astype(np.float32) * t["scales"].astype(np.float32)
            self.styles = [str(s) for s in t["styles"]]
            self.condition = torch.from_numpy(t["condition"].astype(np.float32))
            descriptions, self.owner = [str(d) for d in t["descriptions"]], t["owner"].astype(np.int64)
        if self.condition.shape[1] != text_dim:
            raise StyleTableError(f"{path}: condition vectors are {self.condition.shape[1]}-d, "
                              f"the model expects {text_dim}")
        self.dim, self.text_len = text_dim, text_len
        self._desc = np.stack([self._vector(d)[0] for d in descriptions])

    def _vector(self, text: str) -> tuple[np.ndarray, int]:
        ids = [self.words[w] for w in TOKEN.findall(text.lower()) if w in self.words]
        if not ids:
            return np.zeros(self.vectors.shape[1], np.float32), 0
        v = self.vectors[ids].mean(0)
        return v / max(float(np.linalg.norm(v)), 1e-8), len(ids)

    def describe(self, text: str) -> StyleMatch:
        """The style a prompt lands on, how near it is, and the second nearest."""
        v, known = self._vector(text)  # the conditioner checked the prompt
        sims = self._desc @ v
        best = np.full(len(self.styles), -1.0)
        np.maximum.at(best, self.owner, sims)
        order = np.argsort(-best)
        return StyleMatch(self.styles[order[0]], float(best[order[0]]), self.styles[order[1]], known)

    def encode(self, texts: list[str]) -> torch.Tensor:
        out = torch.zeros(len(texts), self.text_len, self.dim)
        for i, text in enumerate(texts):
            out[i, 0] = self.condition[self.styles.index(self.describe(text).style)]
        return out
