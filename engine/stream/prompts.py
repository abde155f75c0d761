"""Prompt conditioning: text encoders, a per-prompt embedding cache, and smooth prompt changes.

The Wan text encoder (umT5-XXL, 4096-d, 512 tokens, 11 GB in bf16) is only needed when the
prompt changes, so encoding runs on a worker thread (on its own CUDA stream when on the GPU) and
the stream keeps going with the old prompt until the new embedding is ready; then the
conditioning blends from old to new over a few chunks instead of jumping.

Three encoders share one interface (`encode(texts) -> [N, TEXT_LEN, dim]`):
- `HashTextEncoder`: small and deterministic (word hashes seed token vectors); for tests and the
  embedded default. It carries no meaning: it only makes different prompts differ.
- `FileTextEncoder`: embeddings precomputed by `loom encode-prompts` on a machine with umT5.
- `UMT5TextEncoder`: umT5 through transformers from a local directory (extra `t5`).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from loom_live.host_bridge.wire.params import PROMPT, PROMPT_TAKES, TRANSITION_CHUNKS

TEXT_LEN = 512  # tokens per prompt, as the Wan DiT was trained
CACHE_PROMPTS = 32  # embeddings kept in the per-prompt cache
SLERP_EPS = 1e-4  # below this angle slerp falls back to a linear blend
FILE_KEY_PREFIX = "prompt."
UMT5_TOKENIZER_FILES = ("tokenizer.json", "spiece.model")  # either one loads umT5's tokenizer


class PromptError(ValueError):
    """A prompt that cannot be encoded (empty, unknown to an embeddings file...)."""


def check_prompt(text: str, family: str = "wan") -> str:
    """The prompt as the encoders take it (stripped); PromptError for one that is not a non-empty text of
    at most `PROMPT.max_len` characters (what the wire and the config refuse too), saying what the model
    `family` takes (the edit family an instruction, not a style)."""
    if not isinstance(text, str):
        raise PromptError(f"prompt: {type(text).__name__} {str(text)[:60]!r} is not allowed; expected "
                          f"{PROMPT.allowed()}")
    if not text.strip():
        raise PromptError(f"prompt {text[:60]!r} is empty; give {PROMPT_TAKES[family]}")
    if len(text) > (PROMPT.max_len or 0):
        raise PromptError(f"the prompt has {len(text)} characters; expected at most {PROMPT.max_len}")
    return text.strip()


def check_transition_chunks(chunks: Any) -> int:
    """A prompt change's blend length in chunks; PromptError unless a whole number in the live range
    (a NaN or a float here would blend with a NaN weight: every later frame black)."""
    problem = TRANSITION_CHUNKS.problem(chunks)
    if problem is not None:
        raise PromptError(problem)
    return chunks


def prompt_key(text: str) -> str:
    return hashlib.sha1(check_prompt(text).encode()).hexdigest()


class TextEncoder(Protocol):
    dim: int

    def encode(self, texts: list[str]) -> torch.Tensor: ...


@runtime_checkable
class DescribingEncoder(Protocol):
    """An encoder that can say what a prompt landed on (the style table: which style, how near)."""

    def describe(self, text: str) -> Any: ...


class HashTextEncoder:
    """Deterministic stand-in for umT5: each word seeds a unit-variance token vector."""

    def __init__(self, dim: int, text_len: int = TEXT_LEN) -> None:
        self.dim, self.text_len = dim, text_len

    def encode(self, texts: list[str]) -> torch.Tensor:
        out = torch.zeros(len(texts), self.text_len, self.dim)
        for i, text in enumerate(texts):
            words = check_prompt(text).lower().split()[:self.text_len]
            for j, word in enumerate(words):
                seed = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "little")
                gen = torch.Generator().manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
                out[i, j] = torch.randn(self.dim, generator=gen)
        return out


class FileTextEncoder:
    """Looks prompts up in a safetensors file written by `loom encode-prompts`."""

    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open

        self.path = Path(path).expanduser()
        if self.path.is_dir():  # a umT5 folder, most likely: say what this encoder reads instead
            raise PromptError(f"{self.path}: is a folder; prompt.encoder=file reads one .safetensors file of prompt "
                              "embeddings (written by `loom encode-prompts`), and a umT5 folder is prompt.encoder=umt5")
        if not self.path.is_file():
            raise PromptError(f"{self.path}: prompt embeddings file not found")
        try:
            with safe_open(str(self.path), framework="pt") as f:
                meta = f.metadata() or {}
                self._tensors = {k[len(FILE_KEY_PREFIX):]: f.get_tensor(k) for k in f.keys()
                                 if k.startswith(FILE_KEY_PREFIX)}
            self.texts = json.loads(meta.get("prompts", "{}"))
        except Exception as exc:  # safetensors' own errors (and a bad list of prompts) in Loom's words
            why = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise PromptError(f"{self.path}: not a prompt embeddings file ({why}); write one with "
                              "`loom encode-prompts`") from None
        if not self._tensors:
            raise PromptError(f"{self.path}: holds no prompt embeddings (write one with `loom encode-prompts`)")
        self.dim = next(iter(self._tensors.values())).shape[-1]

    def check(self, text: str) -> None:
        """Refuse a prompt the file does not hold, at once (encoding runs later, in the background)."""
        if prompt_key(text) not in self._tensors:
            known = list(self.texts.values())[:5]
            raise PromptError(f"{self.path}: has no embedding for prompt {text!r}; it holds {known}")

    def encode(self, texts: list[str]) -> torch.Tensor:
        for text in texts:
            self.check(text)
        return torch.stack([self._tensors[prompt_key(text)].float() for text in texts])


class UMT5TextEncoder:
    """umT5-XXL from a local directory (tokenizer + encoder weights), through transformers."""

    def __init__(self, path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.bfloat16) -> None:
        try:
            from transformers import AutoTokenizer, UMT5EncoderModel
        except ImportError as exc:
            raise PromptError("the umt5 encoder needs transformers: pip install 'loom-live[t5]'") from exc
        tok, enc = umt5_folders(path)
        self.tokenizer = AutoTokenizer.from_pretrained(str(tok), local_files_only=True)
        self.model = UMT5EncoderModel.from_pretrained(str(enc), torch_dtype=dtype, local_files_only=True)
        self.model.to(device).eval()
        self.device = device
        self.dim = self.model.config.d_model

    @torch.no_grad()
    def encode(self, texts: list[str]) -> torch.Tensor:
        batch = self.tokenizer([check_prompt(t) for t in texts], padding="max_length", max_length=TEXT_LEN,
                               truncation=True, return_tensors="pt").to(self.device)
        hidden = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
        # Wan zeroes the padded positions rather than masking them in cross-attention.
        return (hidden * batch.attention_mask[..., None].to(hidden.dtype)).float().cpu()


def umt5_folders(path: str | Path) -> tuple[Path, Path]:
    """The tokenizer and encoder folders of a umT5 directory: one folder holding both, or the diffusers layout
    (what `loom pull` fetches): tokenizer/ + text_encoder/. A folder that is neither is refused naming what it
    lacks, before transformers reads it (whose own error for such a folder blamed a missing sentencepiece)."""
    folder = Path(path).expanduser()
    if folder.is_file():  # an embeddings file, most likely: say what this encoder reads instead
        raise PromptError(f"{folder}: is a file; prompt.encoder=umt5 reads a umT5 folder (prompt.path: the one "
                          "`loom pull` fetches, text_encoder/ and tokenizer/), and an embeddings file is "
                          "prompt.encoder=file")
    if not folder.is_dir():
        raise PromptError(f"{folder}: umT5 directory not found (prompt.path)")
    tok, enc = (folder / "tokenizer", folder / "text_encoder") if (folder / "text_encoder").is_dir() \
        else (folder, folder)
    lacks = [what for what, found in (
        ("a tokenizer (tokenizer.json or spiece.model)", any((tok / n).is_file() for n in UMT5_TOKENIZER_FILES)),
        ("the encoder's config.json", (enc / "config.json").is_file()),
        ("the encoder's weights (*.safetensors or *.bin)", any(enc.glob("*.safetensors")) or any(enc.glob("*.bin"))),
    ) if not found]
    if lacks:
        raise PromptError(f"{folder}: not a umT5 directory (prompt.path): it lacks {', '.join(lacks)}; give the "
                          "folder `loom pull` fetches (text_encoder/ and tokenizer/) or one holding both")
    return tok, enc


def make_text_encoder(kind: str, text_dim: int, path: str | None, device: str, text_len: int = TEXT_LEN
                      ) -> TextEncoder:
    if kind == "hash":
        return HashTextEncoder(text_dim, text_len)
    if kind == "style":  # the embedded model's prompt -> style table (engine/stream/style_text.py)
        from loom_live.engine.stream.style_text import StyleTextEncoder

        return StyleTextEncoder(text_dim, text_len, path)
    if path is None:
        raise PromptError(f"prompt.encoder={kind} needs prompt.path (an embeddings file or a umT5 directory)")
    encoder: TextEncoder = FileTextEncoder(path) if kind == "file" else UMT5TextEncoder(path, device=device)
    if encoder.dim != text_dim:
        raise PromptError(f"{path}: embeddings are {encoder.dim}-d but the model expects text_dim {text_dim}")
    return encoder


def blend(a: torch.Tensor, b: torch.Tensor, w: float, mode: str) -> torch.Tensor:
    """Embedding between a (w=0) and b (w=1), per token: linear, or spherical (slerp)."""
    if mode == "linear" or w <= 0.0 or w >= 1.0:
        return a if w <= 0.0 else b if w >= 1.0 else torch.lerp(a, b, w)
    na, nb = a.norm(dim=-1, keepdim=True), b.norm(dim=-1, keepdim=True)
    cos = ((a * b).sum(-1, keepdim=True) / (na * nb).clamp_min(1e-12)).clamp(-1.0, 1.0)
    omega = torch.arccos(cos)
    so = torch.sin(omega)
    safe = so.abs() > SLERP_EPS
    sa = torch.where(safe, torch.sin((1 - w) * omega) / so.where(safe, torch.ones_like(so)), torch.full_like(so, 1 - w))
    sb = torch.where(safe, torch.sin(w * omega) / so.where(safe, torch.ones_like(so)), torch.full_like(so, w))
    zero = (na == 0) | (nb == 0)
    return torch.where(zero, torch.lerp(a, b, w), sa * a + sb * b)


class PromptConditioner:
    """The current conditioning: cached embeddings, background encoding, and blended changes.

    The session calls `advance()` once per chunk; it returns the embedding to use and whether
    it differs from the last one (so cross-attention K/V are recomputed only then), and sets
    `transition_done` once a change has fully arrived (the session then refreshes its sinks).
    """

    def __init__(self, encoder: TextEncoder, text: str, *, device: torch.device, dtype: torch.dtype,
                 transition_chunks: int = TRANSITION_CHUNKS.default, blend_mode: str = "slerp") -> None:
        self.encoder = encoder
        self.device, self.dtype = device, dtype
        self.transition_chunks = transition_chunks
        self.blend_mode = blend_mode
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loom-prompt")
        self._pending: tuple[str, int, Future] | None = None
        self._closed = False
        self.error: str | None = None  # why the newest requested prompt did not take effect
        self.text = check_prompt(text)
        self.match = self._describe(self.text)
        self._from = self._to = self._embed(self.text)
        self._steps_total = 0
        self._step = 0
        self.transition_done = False

    def _embed(self, text: str) -> torch.Tensor:
        key = prompt_key(text)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        emb = self._encode(text)
        self._cache[key] = emb
        while len(self._cache) > CACHE_PROMPTS:
            self._cache.popitem(last=False)
        return emb

    def _encode(self, text: str) -> torch.Tensor:
        if self.device.type == "cuda":
            with torch.cuda.stream(torch.cuda.Stream(self.device)):
                emb = self.encoder.encode([text])[0].to(self.device, self.dtype, non_blocking=True)
                torch.cuda.current_stream(self.device).synchronize()
            return emb
        return self.encoder.encode([text])[0].to(self.device, self.dtype)

    def _describe(self, text: str) -> dict | None:
        """What the prompt landed on, for the stats (encoders that can say it; else None)."""
        if isinstance(self.encoder, DescribingEncoder):
            return self.encoder.describe(text).to_dict()
        return None

    def set_transition_chunks(self, chunks: int) -> None:
        """Chunks over which later prompt changes blend in (0: at once); a blend under way keeps its own."""
        self.transition_chunks = check_transition_chunks(chunks)

    def request(self, text: str, transition_chunks: int | None = None) -> None:
        """Start encoding a new prompt in the background; it takes effect at a chunk boundary."""
        if self._closed:
            raise RuntimeError("prompt: this session is closed (close() was called); start a new session")
        text = check_prompt(text)
        check = getattr(self.encoder, "check", None)  # encoders that can refuse a prompt cheaply say so now
        if check is not None:
            check(text)
        chunks = self.transition_chunks if transition_chunks is None else check_transition_chunks(transition_chunks)
        if self._pending is not None:  # latest wins: a prompt typed or swept live must not queue encodes
            self._pending[2].cancel()  # (one that already runs finishes and is ignored)
        self._pending = (text, chunks, self._pool.submit(self._embed, text))

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def wait_pending(self, timeout: float | None = None) -> None:
        """Block until a requested prompt has been encoded or has failed (for tests and offline use);
        either way it takes effect, or says why not, at the next `advance()`."""
        if self._pending is not None:
            wait([self._pending[2]], timeout)

    def current(self) -> torch.Tensor:
        return self._blend_now()

    def _blend_now(self) -> torch.Tensor:
        if self._steps_total == 0 or self._step >= self._steps_total:
            return self._to
        return blend(self._from, self._to, self._step / self._steps_total, self.blend_mode)

    @property
    def weight(self) -> float:
        """Blend weight of the newest prompt (1.0 when no change is in progress)."""
        return 1.0 if self._steps_total == 0 else min(self._step / self._steps_total, 1.0)

    def advance(self) -> tuple[torch.Tensor, bool]:
        """Move one chunk along; returns (embedding, changed since the previous chunk)."""
        self.transition_done = False
        changed = False
        if self._pending is not None and self._pending[2].done():
            changed = self._arrive()
        if self._steps_total and self._step < self._steps_total:
            self._step += 1
            changed = True
            self.transition_done = self._step == self._steps_total
        elif changed:
            self.transition_done = True
        return self._blend_now(), changed

    def settle(self) -> None:
        """Jump to the newest requested prompt, waiting for its encoding, with no blend left under way: a
        new stream starts on what was asked last, never on a blend begun in the stream before it."""
        if self._pending is not None:
            self._arrive()
        self._from = self._to
        self._steps_total = self._step = 0

    def _arrive(self) -> bool:
        """The pending prompt (waited for) starts blending in; False when its encoding failed."""
        text, chunks, fut = self._pending
        self._pending = None
        try:
            new = fut.result()
        except Exception as exc:  # e.g. out of memory in the text encoder: the stream keeps its prompt
            self.error = f"prompt {text!r} could not be encoded: {type(exc).__name__}: {exc}"
            return False
        self._from, self._to, self.text, self.error = self._blend_now(), new, text, None
        self.match = self._describe(text)
        self._steps_total, self._step = chunks, 0
        return True

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)

