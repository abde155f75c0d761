"""The edit family's conditioning: Qwen3-VL reads the instruction together with the source frame.

The UNet is conditioned on the vision-language model's last hidden state (2048-d for
Qwen3-VL-2B) over the instruction and the source image, minus the system-prompt tokens. Those
hidden states are wide (std about 37, peaks about 1160): float16 attention over them overflows,
so the encoder runs in bfloat16 (float32 on a CPU) and refuses float16.

The layout is DreamLiteMobilePipeline's edit mode: the instruction in DreamLite's edit template,
the frame at 512x512 (the vision tower's 32x32 patches merge to 256 image tokens), the last
hidden state without the first 64 tokens (the system prompt). The pipeline resizes the frame
with PIL's Lanczos filter; here it is resized on the GPU (bilinear), which is the same image when
the model resolution is 512x512 (the dreamlite-edit preset) and close to it otherwise. The
sequence is padded to a fixed 512 tokens (the padding masked, and invisible to the causal
encoder's real tokens), so the conditioning is always [B, 448, 2048] whatever the prompt: a new
prompt never changes a shape the compiled UNet was specialised on.

`transformers` is an optional extra (`pip install 'loom-live[edit]'`). With `random_weights` the
model is built from the Qwen3-VL-2B architecture without a checkpoint or tokenizer (the token ids
then come from a hash of the text, with the same layout), for benchmarks at the real shapes.
`HashEditEncoder` is a small deterministic stand-in of the same interface for tests and demos.

`encode_parts` cuts one encode into calls made in order, each of which may run in a later batch's
slot (`edit.encoder_split`): no single UNet batch then meets the whole encoder burst. Running all
the parts gives exactly what `encode` gives; Qwen3-VL's natural cut is its vision tower (with the
merge of image tokens into the text embeddings) first, then its language model's layers in ranges.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

MAX_TOKENS = 512  # fixed padded length of the template + image + instruction
DROP_TOKENS = 64  # leading system-prompt tokens left out of the conditioning (the pipeline's start index)
IMAGE_SIZE = 512  # each frame is resized to this square before the vision tower (the pipeline's)
CONDITIONING_TOKENS = MAX_TOKENS - DROP_TOKENS
EDIT_PREFIX = ("[Edit]: A diptych with two side-by-side images of the same scene. "
               "Compared to the right side, the left one has ")
SYSTEM = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
          "objects, background), then explain how the user's text instruction should alter or modify the image. "
          "Generate a new image that meets the user's requirements while maintaining consistency with the "
          "original input where appropriate.<|im_end|>\n<|im_start|>user\n")


EncodePart = Callable[[], "tuple[torch.Tensor, torch.Tensor] | None"]


class EditConditioner(Protocol):
    """Instruction + source frames -> (tokens [B, L, dim], mask [B, L] bool, True = real token)."""

    tokens: int
    dim: int

    def encode(self, text: str, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def encode_parts(self, text: str, images: torch.Tensor, parts: int) -> list[EncodePart]:
        """The same encode as `parts` calls to make in order, on one thread; the last returns what
        `encode` returns, bit for bit, and the others None. ValueError for a count it cannot cut."""
        ...

    def check_text(self, text: str) -> None:
        """ValueError, one line, for an instruction this encoder cannot read: said when the prompt is set,
        not by the batch whose refresh meets it (on the encoder's thread, losing that batch)."""
        ...


def check_parts(parts: int, most: int, what: str) -> None:
    if not 1 <= parts <= most:
        raise ValueError(f"encoder parts: {parts} is not allowed for {what}; expected 1 to {most}")


def check_dtype(dtype: torch.dtype) -> None:
    if dtype == torch.float16:
        raise ValueError("edit encoder dtype float16: Qwen3-VL's hidden states (peaks about 1160) overflow "
                         "float16 attention; use bfloat16 (or float32)")


class HashEditEncoder:
    """Deterministic stand-in: text tokens from a hash of the text, image tokens from pooled pixels."""

    def __init__(self, dim: int, tokens: int, device: torch.device, dtype: torch.dtype, seed: int = 0) -> None:
        check_dtype(dtype)
        self.dim, self.tokens, self.device, self.dtype = dim, tokens, device, dtype
        self.image_tokens = min(16, tokens // 2)
        gen = torch.Generator().manual_seed(seed)
        self._pixel_proj = torch.randn(3, dim, generator=gen).to(device, dtype)
        self._text: dict[str, torch.Tensor] = {}

    def _text_tokens(self, text: str) -> torch.Tensor:
        if text not in self._text:
            seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
            gen = torch.Generator().manual_seed(seed)
            self._text = {text: torch.randn(self.tokens - self.image_tokens, self.dim, generator=gen)
                          .to(self.device, self.dtype)}
        return self._text[text]

    def encode(self, text: str, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._assemble(self._text_tokens(text), self._image_tokens(images))

    def check_text(self, text: str) -> None:
        """Any text hashes."""

    def encode_parts(self, text: str, images: torch.Tensor, parts: int) -> list[EncodePart]:
        """Image tokens, text tokens, then the padded sequence: up to three parts."""
        if parts == 1:
            return [partial(self.encode, text, images)]
        check_parts(parts, 3, "the hash encoder (image, text, assembly)")
        run: dict[str, torch.Tensor] = {}

        def image() -> None:
            run["image"] = self._image_tokens(images)

        def words() -> None:
            run["text"] = self._text_tokens(text)

        def assemble() -> tuple[torch.Tensor, torch.Tensor]:
            return self._assemble(run["text"], run["image"])

        def words_and_assemble() -> tuple[torch.Tensor, torch.Tensor]:
            words()
            return assemble()

        return [image, words, assemble] if parts == 3 else [image, words_and_assemble]

    def _image_tokens(self, images: torch.Tensor) -> torch.Tensor:
        side = int(self.image_tokens ** 0.5)
        pooled = F.adaptive_avg_pool2d(images.to(self.dtype), (side, side)).flatten(2).transpose(1, 2)
        return pooled @ self._pixel_proj  # [B, side*side, dim]

    def _assemble(self, text: torch.Tensor, img: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b = img.shape[0]
        txt = text[None].expand(b, -1, -1)
        pad = self.tokens - txt.shape[1] - img.shape[1]
        out = torch.cat([txt, img, img.new_zeros(b, pad, self.dim)], dim=1)
        mask = torch.ones(b, self.tokens, dtype=torch.bool, device=out.device)
        mask[:, self.tokens - pad:] = False
        return out, mask


def qwen3vl_2b_config() -> Any:
    """The Qwen3-VL-2B architecture (2.13B parameters): text 2048 x 28 layers, vision 1024 x 24."""
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(
        text_config=dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                         num_key_value_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6,
                         rope_parameters=dict(rope_type="default", rope_theta=5_000_000.0,
                                              mrope_section=[24, 20, 20], mrope_interleaved=True)),
        vision_config=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, patch_size=16,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=2048,
                           deepstack_visual_indexes=[5, 11, 17], num_position_embeddings=2304),
        tie_word_embeddings=True)


def tiny_qwen3vl_config() -> Any:
    """A few-layer random Qwen3-VL with the real token layout, for tests on a CPU."""
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=1, head_dim=16, vocab_size=1024,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 2, 2],
                                              mrope_interleaved=True)),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
                           deepstack_visual_indexes=[0], num_position_embeddings=256),
        image_token_id=1000, video_token_id=1001, vision_start_token_id=1002, vision_end_token_id=1003)


class Qwen3VLEncoder:
    """Qwen3-VL through transformers: last hidden state of template + frame + instruction."""

    def __init__(self, model: Any, config: Any, tokenizer: Any | None, device: torch.device,
                 dtype: torch.dtype) -> None:
        check_dtype(dtype)
        self.model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.config, self.tokenizer, self.device, self.dtype = config, tokenizer, device, dtype
        v = config.vision_config
        self.patch, self.merge, self.temporal = v.patch_size, v.spatial_merge_size, v.temporal_patch_size
        self.grid = IMAGE_SIZE // self.patch
        self.image_tokens = (self.grid // self.merge) ** 2
        self.tokens = CONDITIONING_TOKENS
        self.dim = config.text_config.hidden_size
        self._ids: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def from_pretrained(cls, path: str, device: torch.device, dtype: torch.dtype) -> Qwen3VLEncoder:
        """A Qwen3-VL checkpoint directory (model and tokenizer files); the language head is dropped."""
        try:
            from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration
        except ImportError as exc:
            raise RuntimeError("the Qwen3-VL encoder needs transformers: pip install 'loom-live[edit]'") from exc
        check_dtype(dtype)
        log.info("loading Qwen3-VL from %s (%s)", path, dtype)
        folder = os.path.expanduser(path)  # transformers would take "~/..." for a hub repository's name
        full = Qwen3VLForConditionalGeneration.from_pretrained(folder, dtype=dtype)
        return cls(full.model, full.config, AutoTokenizer.from_pretrained(folder), device, dtype)

    @classmethod
    def random(cls, config: Any, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Qwen3VLEncoder:
        """Random weights at a given architecture (benchmarks, tests); token ids from a hash."""
        try:
            from transformers import Qwen3VLModel
        except ImportError as exc:
            raise RuntimeError("the Qwen3-VL encoder needs transformers: pip install 'loom-live[edit]'") from exc
        log.info("Qwen3-VL on random weights (%d text layers): for benchmarks, not for pictures",
                 config.text_config.num_hidden_layers)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            with torch.device(device):
                model = Qwen3VLModel(config)
        return cls(model, config, None, device, dtype)

    def check_text(self, text: str) -> None:
        """The tokenizer reads its special tokens inside any text: an instruction holding one (an image pad, a
        vision or chat marker) would be read as that marker, not as words, and break the template's layout
        (an extra image token fails the encode). Refused by name."""
        if self.tokenizer is None:  # hashed ids: the words are hashed below the special ids
            return
        special = sorted(t.content for t in self.tokenizer.added_tokens_decoder.values() if t.special)
        found = [t for t in special if t in text]
        if found:
            raise ValueError(f"prompt: {found[0][:40]!r} is a special token of the Qwen3-VL tokenizer (a marker of its "
                             "template, not words); write the instruction without it")

    def _token_ids(self, text: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """input ids and mask [1, 256] and M-RoPE positions [3, 1, 256] for the instruction, cached per
        text. The positions are worked out on the CPU here, once per prompt: transformers would
        otherwise work them out on every call, reading device tensors back to the host."""
        if text not in self._ids:
            image = "<|vision_start|>" + "<|image_pad|>" * self.image_tokens + "<|vision_end|>"
            full = f"{SYSTEM}{image}{EDIT_PREFIX}{text}<|im_end|>\n<|im_start|>assistant\n"
            if self.tokenizer is not None:
                enc = self.tokenizer(full, padding="max_length", max_length=MAX_TOKENS, truncation=True,
                                     return_tensors="pt")
                ids, mask = enc.input_ids, enc.attention_mask
            else:
                ids, mask = self._hashed_ids(text)
            if int((ids == self.config.image_token_id).sum()) != self.image_tokens:
                raise ValueError(f"prompt: too long for the encoder's {MAX_TOKENS} tokens (the image tokens were "
                                 "cut); shorten it")
            types = (ids == self.config.image_token_id).int()
            grid = torch.tensor([[1, self.grid, self.grid]])
            pos, _ = self.model.get_rope_index(ids, mm_token_type_ids=types, image_grid_thw=grid, attention_mask=mask)
            self._ids = {text: (ids.to(self.device), mask.to(self.device), pos.to(self.device))}
        return self._ids[text]

    def _hashed_ids(self, text: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The template's layout without a tokenizer: system ids, vision span, instruction ids, padding."""
        c = self.config
        vocab = min(c.text_config.vocab_size, c.image_token_id)
        words = [int.from_bytes(hashlib.sha256(w.encode()).digest()[:4], "little") % vocab for w in text.split()]
        system = [(i * 7919) % vocab for i in range(DROP_TOKENS - 4)]
        ids = system + [c.vision_start_token_id] + [c.image_token_id] * self.image_tokens
        ids = (ids + [c.vision_end_token_id] + words)[:MAX_TOKENS]
        mask = [1] * len(ids) + [0] * (MAX_TOKENS - len(ids))
        return torch.tensor([ids + [0] * (MAX_TOKENS - len(ids))]), torch.tensor([mask])

    def pixel_patches(self, images: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] in [-1, 1] (the vision tower's mean/std 0.5 normalisation already) ->
        [B * grid^2, 3 * temporal * patch^2] in the vision tower's patch order."""
        x = F.interpolate(images.float(), size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", align_corners=False)
        b, g, m, p, t = x.shape[0], self.grid, self.merge, self.patch, self.temporal
        x = x[:, None].expand(b, t, 3, IMAGE_SIZE, IMAGE_SIZE)  # a still image repeated over the temporal patch
        x = x.reshape(b, t, 3, g // m, m, p, g // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return x.reshape(b * g * g, 3 * t * p * p).to(self.dtype)

    @torch.inference_mode()
    def encode(self, text: str, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b = images.shape[0]
        ids, mask, pos = self._token_ids(text)
        grid = torch.tensor([[1, self.grid, self.grid]] * b, device=self.device)
        out = self.model(input_ids=ids.expand(b, -1), attention_mask=mask.expand(b, -1),
                         position_ids=pos.expand(-1, b, -1), pixel_values=self.pixel_patches(images.to(self.device)),
                         image_grid_thw=grid)
        hidden = out.last_hidden_state[:, DROP_TOKENS:]
        return hidden, mask[:, DROP_TOKENS:].expand(b, -1).bool()

    def encode_parts(self, text: str, images: torch.Tensor, parts: int) -> list[EncodePart]:
        """The vision tower and the merge first, then the language model's layers in `parts - 1`
        ranges of (nearly) equal length; up to one part per layer."""
        if parts == 1:
            return [partial(self.encode, text, images)]
        layers = len(self.model.language_model.layers)
        check_parts(parts, 1 + layers, f"Qwen3-VL (the vision tower, then {layers} language-model layers)")
        run = _Qwen3VLRun(self, text, images)
        cuts = [round(i * layers / (parts - 1)) for i in range(parts)]
        return [run.vision, *(partial(run.layers, lo, hi) for lo, hi in zip(cuts, cuts[1:]))]


def _joined(features: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """One tensor of every image's tokens: transformers releases return them per image or already joined."""
    return features if isinstance(features, torch.Tensor) else torch.cat(tuple(features), dim=0)


class _Qwen3VLRun:
    """One Qwen3-VL encode that can stop between its vision tower and its language model's layers.

    The steps are those of transformers' `Qwen3VLModel.forward` (images only, positions given) and
    `Qwen3VLTextModel.forward` (no cache), written out so that the layer loop can pause between
    batches; tests hold them equal to `Qwen3VLEncoder.encode` (which calls transformers' forward),
    so a transformers release that changes those steps fails there rather than drifting here.
    """

    def __init__(self, encoder: Qwen3VLEncoder, text: str, images: torch.Tensor) -> None:
        self.encoder, self.text, self.images = encoder, text, images

    @torch.inference_mode()
    def vision(self) -> None:
        """Vision tower, image tokens into the text embeddings, causal mask and rotary tables."""
        from transformers.masking_utils import create_causal_mask

        enc, model = self.encoder, self.encoder.model
        b = self.images.shape[0]
        ids, mask, pos = enc._token_ids(self.text)
        ids, self.mask = ids.expand(b, -1), mask.expand(b, -1)
        grid = torch.tensor([[1, enc.grid, enc.grid]] * b, device=enc.device)
        seen = model.get_image_features(enc.pixel_patches(self.images.to(enc.device)), grid, return_dict=True)
        embeds = model.get_input_embeddings()(ids)
        image_mask = (ids == enc.config.image_token_id)[..., None]  # the layout is checked in _token_ids
        image = _joined(seen.pooler_output).to(embeds.device, embeds.dtype)
        self.hidden = embeds.masked_scatter(image_mask, image)
        self.visual_mask = image_mask[..., 0]
        self.deepstack = [_joined(feature) for feature in seen.deepstack_features]
        lm = model.language_model
        # no cache: its argument is the fourth, named `cache` or `past_key_values` by the release
        self.causal = create_causal_mask(lm.config, self.hidden, self.mask, None, position_ids=None)
        self.rotary = lm.rotary_emb(self.hidden, pos.expand(-1, b, -1))

    @torch.inference_mode()
    def layers(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Language-model layers lo..hi-1; after the last one, the final norm and the conditioning."""
        lm = self.encoder.model.language_model
        for i in range(lo, hi):
            self.hidden = lm.layers[i](self.hidden, attention_mask=self.causal, position_ids=None,
                                       position_embeddings=self.rotary)
            if i < len(self.deepstack):  # DeepStack: visual features added to the first layers' outputs
                self.hidden = lm._deepstack_process(self.hidden, self.visual_mask, self.deepstack[i])
        if hi < len(lm.layers):
            return None
        hidden = lm.norm(self.hidden)[:, DROP_TOKENS:]
        return hidden, self.mask[:, DROP_TOKENS:].bool()
