"""`edit.encoder_split`: a prompt-encoder refresh spread over several batches (engine/edit/encoder.py
`encode_parts`, engine/edit/session.py `_conditioning`), on a CPU with the tiny edit config."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from loom_live.engine.config import ConfigError, load_config
from loom_live.engine.edit.encoder import HashEditEncoder
from loom_live.engine.edit.loading import load_edit_models
from loom_live.engine.edit.session import EditSession
from tests.fakes.edit_tiny import B, random_frames, tiny_edit_cfg

TEXT = "make it a watercolor"


@pytest.fixture(scope="module")
def tiny_qwen():
    pytest.importorskip("transformers.models.qwen3_vl")
    from loom_live.engine.edit.encoder import Qwen3VLEncoder, tiny_qwen3vl_config

    return Qwen3VLEncoder.random(tiny_qwen3vl_config(), torch.device("cpu"), torch.float32)



def _session(*overrides: str) -> EditSession:
    cfg = tiny_edit_cfg(*overrides)
    return EditSession(cfg, load_edit_models(cfg))



def _push(session: EditSession, frames: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    assert sum(sizes) == len(frames)
    outs, i = [], 0
    for n in sizes:
        outs.append(session.push(frames[i:i + n]))
        i += n
    return outs


def _stream(session: EditSession, frames: np.ndarray, sizes: list[int]) -> np.ndarray:
    """Push in these sizes, then flush: every output, in order."""
    outs = [*_push(session, frames, sizes), session.flush()]
    return np.concatenate([o for o in outs if len(o)])


def _record_conditioning(session: EditSession) -> list[torch.Tensor]:
    """The conditioning each UNet batch is called with, in batch order."""
    used: list[torch.Tensor] = []
    denoise = session._denoise

    def recording(noise, ref, ctx, mask):
        used.append(ctx.clone())
        return denoise(noise, ref, ctx, mask)

    session._denoise = recording
    return used


def _run_parts(parts):
    outs = [part() for part in parts]
    assert all(o is None for o in outs[:-1])
    return outs[-1]


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_hash_encoder_parts_equal_encode(parts):
    encoder = HashEditEncoder(16, 24, torch.device("cpu"), torch.float32)
    images = torch.rand(B, 3, 32, 32) * 2 - 1
    ctx, mask = _run_parts(encoder.encode_parts(TEXT, images, parts))
    ref_ctx, ref_mask = encoder.encode(TEXT, images)
    assert len(encoder.encode_parts(TEXT, images, parts)) == parts
    assert torch.equal(ctx, ref_ctx) and torch.equal(mask, ref_mask)
    with pytest.raises(ValueError, match="4 is not allowed for the hash encoder.*expected 1 to 3"):
        encoder.encode_parts(TEXT, images, 4)


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_qwen3vl_parts_equal_encode_bit_for_bit(tiny_qwen, parts):
    images = torch.rand(B, 3, 64, 48) * 2 - 1
    ctx, mask = _run_parts(tiny_qwen.encode_parts(TEXT, images, parts))
    ref_ctx, ref_mask = tiny_qwen.encode(TEXT, images)
    assert ctx.shape == (B, 448, 64) and torch.equal(ctx, ref_ctx) and torch.equal(mask, ref_mask)


def test_qwen3vl_parts_split_the_work_vision_tower_first_then_language_model_halves(tiny_qwen):
    """What each batch's slot really runs: the split is only worth it if no part holds the whole burst."""
    model, ran, hooks = tiny_qwen.model, [], []
    modules = {"vision": model.visual, **{f"layer{i}": m for i, m in enumerate(model.language_model.layers)}}
    for name, module in modules.items():
        hooks.append(module.register_forward_hook(lambda *_, name=name: ran[-1].append(name)))
    try:
        for part in tiny_qwen.encode_parts(TEXT, torch.rand(1, 3, 32, 32) * 2 - 1, 3):
            ran.append([])
            part()
    finally:
        for hook in hooks:
            hook.remove()
    assert ran == [["vision"], ["layer0"], ["layer1"]]
    with pytest.raises(ValueError, match="4 is not allowed for Qwen3-VL"):
        tiny_qwen.encode_parts(TEXT, torch.rand(1, 3, 32, 32), 4)  # the tiny model has 2 layers


@pytest.mark.parametrize("split", [2, 3])
def test_split_refresh_is_the_unsplit_one_handed_over_split_minus_one_batches_later(split):
    """What a user relies on: the same refreshes (same frames, same prompt) as without the split, each
    used from a fixed batch `split - 1` batches later, a new prompt included; nothing else changes."""
    frames = random_frames(14 * B, seed=1)
    used = {}
    for n in (1, split):
        session = _session("edit.prompt_refresh_every=6", f"edit.encoder_split={n}")
        used[n] = _record_conditioning(session)
        _push(session, frames[:9 * B], [3, 1, 5, 0, 9])  # batches 0..8 (refreshes at 0 and 6)
        session.set_prompt("a charcoal sketch")  # encoded with batch 9
        _push(session, frames[9 * B:], [7, 3])  # batches 9..13 (refresh at 12)
        session.flush()
        stats = session.stats()  # the last refresh (batch 12) has started two of its parts by batch 13
        assert (stats["encoder_split"], stats["prompt_encodes"], stats["prompt_parts"]) == (n, 4, 3 * n + min(n, 2))
    assert len(used[1]) == len(used[split]) == 14
    for i in range(14):
        assert torch.equal(used[split][i], used[1][max(0, i - (split - 1))]), i
    distinct = [i for i in range(1, 14) if not torch.equal(used[1][i], used[1][i - 1])]
    assert distinct == [7, 10, 13]  # the test is not vacuous: refreshes from batches 6, 9 (new prompt) and 12


def test_a_refresh_due_while_one_runs_starts_when_it_is_handed_over():
    """Refreshing every batch under a three-part split: one refresh at a time, at fixed batches."""
    session = _session("edit.prompt_refresh_every=1", "edit.encoder_split=3")
    used = _record_conditioning(session)
    frames = random_frames(10 * B, seed=2)
    _push(session, frames, [5, 1, 6, 8])
    stats = session.stats()
    assert (stats["encoder_split"], stats["prompt_encodes"], stats["prompt_parts"]) == (3, 4, 12)
    # started at 0 (all parts at once: nothing cached yet), 1, 4, 7; each used from three batches on
    sources = [0, 0, 0, 0, 1, 1, 1, 4, 4, 4]
    with torch.inference_mode():
        for i, k in enumerate(sources):
            x = session.mapper.to_model(frames[k * B:(k + 1) * B])
            ctx, _ = session.models.encoder.encode(TEXT, x[:1])
            assert torch.equal(used[i], ctx.expand(B, -1, -1)), (i, k)
    session.close()


class _SlowParts:
    """An encoder whose parts take a while, and which says how many finished."""

    def __init__(self, inner) -> None:
        self.inner, self.tokens, self.dim, self.finished = inner, inner.tokens, inner.dim, 0
        self.lock = threading.Lock()

    def encode(self, text, images):
        return self.inner.encode(text, images)

    def encode_parts(self, text, images, parts):
        def slow(part):
            time.sleep(0.2)
            out = part()
            with self.lock:
                self.finished += 1
            return out

        return [lambda part=part: slow(part) for part in self.inner.encode_parts(text, images, parts)]


def test_reset_waits_for_the_parts_already_started():
    cfg = tiny_edit_cfg("edit.prompt_refresh_every=2", "edit.encoder_split=2")
    models = load_edit_models(cfg)
    models.encoder = slow = _SlowParts(models.encoder)
    session = EditSession(cfg, models)
    session.push(random_frames(3 * B, seed=3))  # batch 2 starts a refresh's first part; its second is not started
    assert session.prompt_parts == 3
    session.reset()
    assert slow.finished == 3  # nothing of the old stream runs on into the new one
    session.close()


@pytest.mark.parametrize("split", [2, 3])
def test_every_frame_comes_back_once_in_order_with_odd_push_sizes(split):
    frames = random_frames(17, seed=4)
    session = _session("edit.prompt_refresh_every=2", f"edit.encoder_split={split}")
    whole = _stream(session, frames, [17])
    for sizes in ([1, 0, 4, 3, 5, 4], [2] * 8 + [1], [0, 7, 9, 1]):
        out = _stream(session, frames, sizes)
        assert out.shape == frames.shape and np.array_equal(out, whole), sizes  # a function of the input alone
    # the restyle replaced by the input itself: the frames out are the frames in, each once, in order
    session.mapper.to_host = lambda y, inputs: torch.as_tensor(np.array(inputs))
    assert np.array_equal(_stream(session, frames, [3, 5, 1, 2, 6]), frames)
    session.close()


def test_a_bad_split_is_refused_at_load_naming_the_allowed_values(tmp_path):
    assert load_config("edit-tiny").edit.encoder_split == 1  # off by default: one refresh in one batch
    for value in ("0", "4"):
        with pytest.raises(ConfigError, match=rf"edit\.encoder_split: {value} is not allowed; expected one of 1, 2, 3"):
            load_config("edit-tiny", [f"edit.encoder_split={value}"])
    path = tmp_path / "split.yaml"
    path.write_text("model: {family: edit}\nedit: {encoder_split: two}\n")
    with pytest.raises(ConfigError, match=r"split\.yaml.*edit\.encoder_split: 'two' is not allowed; expected an int"):
        load_config(str(path))
