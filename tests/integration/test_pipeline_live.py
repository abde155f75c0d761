"""The pipeline over CPU ranks while it streams: live block moves (by hand and by the scheduler),
a LoRA scale change, a step change, a new input size, and a hung rank. Oracle: the one-process
StreamSession on the same frames and seed.

A move travels the ring between two ticks, with the block's weights, KV cache rows and
cross-attention K/V, so the frames must be the ones computed without any move.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from loom_live.engine.config import load_config
from loom_live.engine.models.loading import load_models
from loom_live.engine.parallel.scheduler import BlockScheduler
from loom_live.engine.parallel.session import PipelineError, PipelineSession
from loom_live.engine.stream.session import StreamSession
from loom_live.engine.stream.slo_scheduler import Plan
from tests.integration.test_pipeline_parallel import BASE, clip, no_children_left, stream

STEPS = [*BASE, "stream.steps=[700]"]


def style_lora(folder: Path, preset: str = "tiny-random") -> list[str]:
    """The config with a style LoRA on every block's linears: a moved block must take it along. A live
    change merges at once on the one-process reference too (pipeline ranks merge only their own blocks,
    each change at once; one process spreads it over `stream.lora_merge_parts` chunks by default)."""
    dit = load_models(load_config(preset, STEPS)).dit
    g = torch.Generator().manual_seed(7)
    sd = {}
    for name, m in dit.named_modules():
        if isinstance(m, torch.nn.Linear) and name.startswith("blocks."):
            sd[f"diffusion_model.{name}.lora_down.weight"] = torch.randn(2, m.in_features, generator=g) * 0.3
            sd[f"diffusion_model.{name}.lora_up.weight"] = torch.randn(m.out_features, 2, generator=g) * 0.3
    path = folder / "style.safetensors"
    save_file(sd, str(path))
    return [*STEPS, f"lora=[{{path: {path}, scale: 1.0}}]", "stream.lora_merge_parts=1"]


@pytest.fixture(scope="module")
def styled(tmp_path_factory) -> list[str]:
    return style_lora(tmp_path_factory.mktemp("lora"))


def live(session, frames: np.ndarray, between) -> np.ndarray:
    """Push the frames in four parts; `between(i)` runs after part i (moves, a step change)."""
    cuts = [0, 9, 17, 25, len(frames)]
    outs = []
    for i in range(4):
        outs.append(session.push(frames[cuts[i]:cuts[i + 1]]))
        between(i)
    outs.append(session.flush())
    return np.concatenate([o for o in outs if len(o)])


def assert_same_frames(out: np.ndarray, reference: np.ndarray) -> None:
    assert out.shape == reference.shape
    diff = np.abs(out.astype(int) - reference.astype(int))
    assert diff.max() <= 1 and (diff > 0).mean() < 1e-3  # float32 both sides; batch-size rounding only


def resized(session) -> list[np.ndarray]:
    """A host that changes its output size mid-stream (TouchDesigner, say): frames one by one."""
    rng = np.random.default_rng(4)
    outs = [session.push(rng.integers(0, 256, (1, h, w, 3), np.uint8)) for h, w in [(32, 48)] * 7 + [(40, 64)] * 6]
    outs.append(session.flush())
    return [frame for o in outs for frame in o]


def script(session, i: int) -> None:
    """The live changes of both sessions: a LoRA scale and the sink threshold after the first part,
    steps after the second."""
    if i == 0:
        session.set_params(lora_scales={"style": 0.5}, sink_threshold=0.5)
    elif i == 1:
        session.set_params(steps=[700, 500])


@pytest.fixture(scope="module")
def reference(styled) -> tuple[np.ndarray, list[np.ndarray]]:
    one = StreamSession.from_config(load_config("tiny-random", styled))
    return live(one, clip(33), lambda i: script(one, i)), resized(one)


def test_two_ranks_move_blocks_both_ways_across_a_step_change(styled, reference):
    with PipelineSession(load_config("tiny-random", [*styled, "parallel.gpus=2", "parallel.rebalance=false"])) as pipe:
        def between(i: int) -> None:
            script(pipe, i)
            if i == 0:
                pipe.move_block(1, 1)  # rank 0 -> rank 1 mid-stream, LoRA and all: split [1, 3]
            elif i == 1:
                pipe.move_block(1, 0)  # back to rank 0, which first collects the ticks in the ring
            elif i == 2:
                pipe.move_block(2, 0)  # [3, 1]
        out = live(pipe, clip(33), between)
        stats = pipe.stats()
        sizes = resized(pipe)
        with pytest.raises(ValueError, match="rank 0 .* only its last block"):
            pipe.move_block(0, 1)
        with pytest.raises(ValueError, match="unknown parameter 'stepz'"):
            pipe.set_params(stepz=[700])
        with pytest.raises(ValueError, match="mode"):
            pipe.set_params(mode="parallel")
    assert_same_frames(out, reference[0])
    assert [f.shape for f in sizes] == [f.shape for f in reference[1]] == [(32, 48, 3)] * 7 + [(40, 64, 3)] * 6
    assert_same_frames(np.stack(sizes[:7]), np.stack(reference[1][:7]))
    assert_same_frames(np.stack(sizes[7:]), np.stack(reference[1][7:]))
    assert stats["split"] == [3, 1] and stats["block_moves"] == 3 and stats["steps"] == [700, 500]
    assert stats["lora_scales"] == {"style": 0.5}
    assert [r["blocks"] for r in sorted(stats["ranks"], key=lambda r: r["rank"])] == [[0, 3], [3, 4]]
    assert no_children_left()


def test_the_default_preset_on_two_ranks_gives_the_one_process_frames(tmp_path):
    """The trained embedded model (the `default` preset, its own VAE and style text encoder): each
    rank holds only its blocks, so a block that moves after a LoRA scale change arrives with the
    original weights and is merged at the current scale on its new rank; its edge control's scale,
    changed live, reaches the source the first rank builds from the next chunk on."""
    styled = [*style_lora(tmp_path, "default"), "model.dtype=float32"]  # not bfloat16, which AMX CPUs would pick

    def between(session, i: int) -> None:
        if i == 0:
            session.set_params(lora_scales={"style": 0.5})
            if isinstance(session, PipelineSession):
                session.move_block(1, 1)
        if i == 1:
            session.set_params(context_scale=0.3)

    one = StreamSession.from_config(load_config("default", styled))
    reference = live(one, clip(25), lambda i: between(one, i))
    with PipelineSession(load_config("default", [*styled, "parallel.gpus=2", "parallel.rebalance=false"])) as pipe:
        held = [b for b, block in enumerate(pipe.models.dit.blocks) if not next(block.parameters()).is_meta]
        assert held == [0, 1]
        out = live(pipe, clip(25), lambda i: between(pipe, i))
        assert pipe.split == [1, 3]
        assert pipe.stats()["control"] == {"source": "edges", "context_scale": 0.3, "reference": None,
                                           "edges_only": True}
    assert_same_frames(out, reference)
    assert no_children_left()


def test_the_input_latents_travel_through_a_middle_rank_to_the_head():
    """The default preset reads each chunk's clean latents in rank 0's embedding and the last rank's
    head; on three ranks they pass through the middle one, and the frames stay the one-process ones."""
    cfg = [*STEPS, "model.dtype=float32"]
    reference = live(StreamSession.from_config(load_config("default", cfg)), clip(25), lambda i: None)
    with PipelineSession(load_config("default", [*cfg, "parallel.gpus=3", "parallel.rebalance=false"])) as pipe:
        out = live(pipe, clip(25), lambda i: None)
    assert_same_frames(out, reference)
    assert no_children_left()


def switch_plans(session, i: int) -> None:
    """Sequential after the first part, 2-latent chunks after the second, 1 after the third."""
    if i == 0:
        session.set_params(mode="sequential")
    elif i == 1:
        session.set_params(mode="batch")
        session.slo.plan = Plan("batch", 2)  # as the scheduler in auto mode would pick it
    elif i == 2:
        session.slo.plan = Plan("batch", 1)


def check_plan_switches(overrides: list[str], gpus: int) -> None:
    overrides = [*overrides, "stream.steps=[700,500,300]"]  # 3 rows: a drain re-noises a row (draw order)
    one = StreamSession.from_config(load_config("tiny-random", overrides), warmup=False)
    reference = live(one, clip(33), lambda i: switch_plans(one, i))
    seen = []
    with PipelineSession(load_config("tiny-random", [*overrides, f"parallel.gpus={gpus}"])) as pipe:
        def between(i: int) -> None:
            stats = pipe.stats()
            seen.append((stats["frames_in"] - stats["frames_out"], stats["plan"]))
            switch_plans(pipe, i)
        out = live(pipe, clip(33), between)
    if pipe.device.type == "cuda":  # GPU kernels differ with the batch size: a level or two, rarely
        diff = np.abs(out.astype(int) - reference.astype(int))
        assert out.shape == reference.shape and diff.max() <= 2 and (diff > 0).mean() < 1e-2
    else:
        assert_same_frames(out, reference)
    # batch: chunks in the ring; sequential: every chunk out within its push (nothing in flight)
    assert seen[0][0] > 0 and seen[1] == (0, {"mode": "sequential", "chunk_latents": 1})
    assert seen[2][1] == {"mode": "batch", "chunk_latents": 2}
    assert no_children_left()


@pytest.mark.parametrize("gpus", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_mode_and_chunk_size_changes_give_the_one_process_frames(gpus):
    """The plans of the SLO scheduler on the ring: stream-batch, sequential (the ring drained
    first, then each chunk round the ring n times alone), 2-latent chunks, and back, switched at
    the same chunks as one process; `stream.mode` is a live parameter on the pipeline too."""
    check_plan_switches(BASE, gpus)


def test_auto_mode_learns_from_the_ranks_and_switches_as_one_process_would():
    """Auto mode with a budget no plan meets: the scheduler learns the ranks' stage times and,
    after its patience, takes the lowest-latency plan (sequential). One process given the same
    decisions at the same chunks gives the same frames."""
    overrides = [*BASE, "stream.steps=[700,500,300]", "stream.mode=auto", "slo.latency_budget_ms=1"]
    # the first window is asked for after 8 chunks and comes back through the ring when the ranks get to it (later on
    # a loaded machine), then the patience: 25 chunks leave room for that and for the windows of chunks 16 and 24
    frames = clip(1 + 4 * 25)
    decisions: list[Plan] = []
    cfg = load_config("tiny-random", [*overrides, "parallel.gpus=2", "parallel.rebalance=false"])
    with PipelineSession(cfg) as pipe:
        decide = pipe.slo.decide
        pipe.slo.decide = lambda: decisions.append(decide()) or decisions[-1]
        out = stream(pipe, frames, push=4)
        assert pipe.stats()["plan"] == {"mode": "sequential", "chunk_latents": 1}
    assert decisions[0] == Plan("batch", 1) and set(decisions) == {Plan("batch", 1), Plan("sequential", 1)}
    one = StreamSession.from_config(load_config("tiny-random", overrides))
    script = iter(decisions)

    def replay() -> Plan:
        one.slo.plan = next(script)
        return one.slo.plan
    one.slo.decide = replay
    assert_same_frames(out, stream(one, frames, push=4))
    assert next(script, None) is None and no_children_left()


class Scripted(BlockScheduler):
    """The live scheduler's path (TIMES through the ring, windows back, a move) with scripted
    decisions: which way a CPU's timings point is not what this test is about."""

    def __init__(self, moves: list[tuple[int, int]]) -> None:
        super().__init__(threshold=0.0, dwell=1)
        self.script, self.seen = moves, []

    def decide(self, windows, split):
        self.seen.append([w["ticks"] > 0 and "dit" in w["seconds"] for w in windows])
        self.chunks = 0
        return self.script.pop(0) if self.script else None


@pytest.mark.slow
def test_three_ranks_follow_the_scheduler_without_a_glitch(styled, reference):
    with PipelineSession(load_config("tiny-random", [*styled, "parallel.gpus=3", "parallel.split=[1,2,1]"])) as pipe:
        # both boundaries, both directions: [1,2,1] -> [1,1,2] -> [1,2,1] -> [2,1,1]
        pipe.scheduler = Scripted([(2, 2), (2, 1), (1, 0)])
        out = live(pipe, clip(33), lambda i: script(pipe, i))
        stats = pipe.stats()
    assert_same_frames(out, reference[0])
    assert pipe.scheduler.seen and all(all(s) for s in pipe.scheduler.seen)  # every rank measured its window
    # how many rounds fit depends on when the ranks' answers arrive; each is one move
    moves = stats["block_moves"]
    assert moves >= 1 and stats["split"] == [[1, 2, 1], [1, 1, 2], [1, 2, 1], [2, 1, 1]][moves]
    assert no_children_left()


def test_a_hung_rank_ends_the_session_with_a_clear_error():
    pipe = PipelineSession(load_config("tiny-random", [*STEPS, "parallel.gpus=2"]))
    frames = clip(13)
    pipe.push(frames[:9])
    rank = pipe.ranks.procs[0]
    os.kill(rank.pid, signal.SIGSTOP)  # alive but silent: no exit code, no closed pipe
    try:
        with pytest.raises(PipelineError, match=r"rank 1 .*hung: no heartbeat"):
            pipe.push(frames[9:])
            pipe.flush()
    finally:
        if rank.is_alive():
            os.kill(rank.pid, signal.SIGCONT)
    rank.join(10)
    assert not rank.is_alive()
    assert no_children_left()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_move_blocks_over_nccl_across_a_step_change(styled):
    """The same live script on two GPUs: blocks (weights, KV rows, cross K/V, LoRA) move over NCCL,
    and graphs are captured afresh after each move and the step change."""
    overrides = [*styled, "model.device=cuda"]
    one = StreamSession.from_config(load_config("tiny-random", overrides), warmup=False)
    reference = live(one, clip(33), lambda i: script(one, i))
    cfg = load_config("tiny-random", [*overrides, "parallel.gpus=2", "parallel.rebalance=false"])
    with PipelineSession(cfg) as pipe:
        moves = {0: (1, 1), 1: (1, 0), 2: (2, 0)}  # as on the CPU ranks above: [1, 3], [2, 2], [3, 1]

        def between(i: int) -> None:
            script(pipe, i)
            if i in moves:
                pipe.move_block(*moves[i])
        out = live(pipe, clip(33), between)
        assert pipe.stats()["split"] == [3, 1]
    diff = np.abs(out.astype(int) - reference.astype(int))
    assert out.shape == reference.shape and diff.max() <= 2 and (diff > 0).mean() < 1e-2
    assert no_children_left()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_switch_plans_as_one_gpu():
    """The same plan switches on two GPUs: graphs captured for batch micro-batches, eager
    sequential passes, 2-latent rows over NCCL."""
    check_plan_switches([*BASE, "model.device=cuda"], 2)
