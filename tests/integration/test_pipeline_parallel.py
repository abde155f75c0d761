"""The DiT pipeline over 2 ranks (CPU processes, gloo) computes what one process computes.

Oracle: the single-process StreamSession on the same config (embedded tiny model, float32).
The KV window is small and RoPE refresh early, so ring wrap-around, refresh shifts and
adaptive sinks all happen on both ranks within a few chunks.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from loom_live.engine.config import ConfigError, load_config
from loom_live.engine.models.loading import load_models
from loom_live.engine.parallel.plan import NoiseLedger, balanced_split, even_split, stage_ranges
from loom_live.engine.parallel.session import PipelineError, PipelineSession
from loom_live.engine.stream.session import StreamSession
from tests.fakes.media import panning_clip

BASE = ["resolution.width=32", "resolution.height=32", "stream.mode=batch", "model.dtype=float32",
        "stream.num_kv_cache=4", "stream.sink=1", "stream.rope_refresh_at=6"]


def clip(n: int, seed: int = 0) -> np.ndarray:
    frames = panning_clip(n, 32, 32, seed, shift=2)
    frames[:, :2, :2] = np.arange(n)[:, None, None, None]  # some motion that differs per frame
    return frames


def stream(session, frames: np.ndarray, push: int = 3) -> np.ndarray:
    outs = [session.push(frames[i:i + push]) for i in range(0, len(frames), push)]
    outs.append(session.flush())
    return np.concatenate([o for o in outs if len(o)])


def no_children_left() -> bool:
    return not multiprocessing.active_children()


@pytest.mark.parametrize("steps", ["[700]", "[700,500]"])
def test_two_ranks_give_the_one_process_frames(steps):
    overrides = [*BASE, f"stream.steps={steps}"]
    frames = clip(33)  # 9 latent frames: the ring wraps and RoPE refreshes on every rank and KV row
    one = StreamSession.from_config(load_config("tiny-random", overrides))
    reference = stream(one, frames)
    # the split stays as given (CPU timings could make the scheduler move blocks: not what this checks)
    static = [*overrides, "parallel.gpus=2", "parallel.rebalance=false"]
    with PipelineSession(load_config("tiny-random", static)) as pipe:
        assert pipe.split == [2, 2]
        out = stream(pipe, frames)
        again = stream(pipe, frames, push=5)  # a flush starts a new stream: the same frames again
        changed = []
        for session in (pipe, one):  # a prompt change blended over 2 chunks, from the 4th chunk on
            head = session.push(frames[:13])
            session.set_prompt("ink drawing, cross hatching", transition_chunks=2)
            session.prompt.wait_pending()
            changed.append(np.concatenate([o for o in (head, stream(session, frames[13:])) if len(o)]))
        stats = pipe.stats()
    assert out.shape == frames.shape == reference.shape and out.dtype == np.uint8
    diff = np.abs(out.astype(int) - reference.astype(int))
    # float32 on both sides; only batch-size-dependent rounding may move a pixel by one level
    assert diff.max() <= 1 and (diff > 0).mean() < 1e-3
    assert np.array_equal(out, again)
    assert changed[0].shape == out.shape and not np.array_equal(changed[0], out)
    if steps == "[700]":  # one row per tick: the change meets the same chunks as on one GPU
        assert np.abs(changed[0].astype(int) - changed[1].astype(int)).max() <= 1
    assert stats["frames_out"] == 3 * len(frames) and stats["dropped"] == 0
    ranks = {r["rank"]: r for r in stats["ranks"]}
    assert ranks[0]["blocks"] == [0, 2] and ranks[1]["blocks"] == [2, 4]
    assert {"encode", "dit"} <= set(ranks[0]["stages_ms"]) and {"dit", "head", "decode"} <= set(ranks[1]["stages_ms"])
    assert sum(stats["suggested_split"]) == 4
    assert no_children_left()


def test_two_ranks_with_a_float16_vae_give_the_one_process_frames_and_start_afresh_after_an_overflow():
    """`vae.dtype=float16` on a pipeline: rank 0 watches the frames the last rank sends back, as one process watches
    its own. An overflow in rank 0's encoder leaves NaN in its history and, through the latents, in the last rank's
    decoder: the pipeline flushes and starts a new stream on every rank, whose frames are a fresh stream's."""
    overrides = [*BASE, "stream.steps=[700]", "vae.dtype=float16"]
    frames = clip(17)
    reference = stream(StreamSession.from_config(load_config("tiny-random", overrides)), frames)
    two = load_config("tiny-random", [*overrides, "parallel.gpus=2", "parallel.rebalance=false"])
    with PipelineSession(two) as pipe:
        out = stream(pipe, frames)
        assert pipe.stats()["vae_nonfinite_chunks"] == 0
        conv_in = pipe.models.encoder.encoder.conv_in.weight
        kept = conv_in.detach().clone()
        with torch.no_grad():
            conv_in.mul_(1e5)
        outs = [pipe.push(frames[i:i + 3]) for i in range(0, 9, 3)]
        with torch.no_grad():
            conv_in.copy_(kept)
        pushed = 9
        while pipe.vae_restarts == 0 and pushed < 60:  # the broken frames come back a tick or two later
            outs.append(pipe.push(frames[:3]))
            pushed += 3
        outs.append(pipe.flush())
        again = stream(pipe, frames)
        stats = pipe.stats()
    assert np.abs(out.astype(int) - reference.astype(int)).max() <= 1
    assert stats["vae_nonfinite_chunks"] >= 1 and stats["vae_restarts"] == 1
    assert all("vae_nonfinite_chunks" not in r for r in stats["ranks"])  # one owner: rank 0
    assert sum(len(o) for o in outs) == pushed  # one frame out for each in, the broken ones among them
    assert np.array_equal(again, out)  # every rank's KV cache and VAE history clean again
    assert no_children_left()


def test_the_comparison_can_fail():
    # the oracle test above is only meaningful if another noise seed changes the frames
    frames = clip(13)
    a = stream(StreamSession.from_config(load_config("tiny-random", BASE)), frames)
    b = stream(StreamSession.from_config(load_config("tiny-random", [*BASE, "stream.seed=1"])), frames)
    assert np.abs(a.astype(int) - b.astype(int)).max() > 8


def test_a_rank_that_fails_to_load_reports_its_error_and_leaves_nothing_behind(tmp_path):
    # a partial checkpoint: blocks 2 and 3 (rank 1's) are missing
    models = load_models(load_config("tiny-random", BASE))
    weights = {k: v.contiguous() for k, v in models.dit.state_dict().items()
               if not k.startswith(("blocks.2.", "blocks.3."))}
    path = tmp_path / "partial.safetensors"
    save_file(weights, str(path))
    cfg = load_config("tiny-random", [*BASE, "parallel.gpus=2", f"model.checkpoint={path}"])
    with pytest.raises(PipelineError, match=r"(?s)rank 1 failed.*blocks\.2\."):
        PipelineSession(cfg)
    assert no_children_left()


def test_a_rank_that_dies_mid_stream_surfaces_as_an_error():
    pipe = PipelineSession(load_config("tiny-random", [*BASE, "parallel.gpus=2"]))
    frames = clip(21)
    pipe.push(frames[:9])
    with pytest.raises(ValueError):  # bad input is refused and the ring goes on
        pipe.push(np.zeros((2, 32, 32), np.uint8))
    pipe.push(frames[9:13])
    os.kill(pipe.ranks.procs[0].pid, signal.SIGKILL)
    pipe.ranks.procs[0].join(10)
    with pytest.raises(PipelineError, match="rank 1"):
        pipe.push(frames[13:])
        pipe.flush()
    assert no_children_left()
    with pytest.raises(PipelineError, match="closed"):
        pipe.push(frames[:4])
    pipe.close()


def test_bad_settings_are_refused_before_any_process_starts():
    with pytest.raises(ConfigError, match="parallel.split"):
        load_config("tiny-random", ["parallel.gpus=2", "parallel.split=[1,1,2]"])
    with pytest.raises(ValueError, match="parallel.split"):
        PipelineSession(load_config("tiny-random", ["parallel.gpus=2", "parallel.split=[1,2]"]))  # 4 blocks
    with pytest.raises(ValueError, match="parallel.gpus"):
        PipelineSession(load_config("tiny-random", ["parallel.gpus=5"]))  # 5 ranks for 4 blocks
    assert no_children_left()


UNRUNNABLE = {  # settings a pipeline cannot run, and what the one-line refusal says
    "split": (["parallel.gpus=2", "parallel.split=[3,2]"],
              "parallel.split: [3, 2]: 5 blocks in all, the model has 4; allowed: one block count per GPU summing "
              "to 4"),
    "ranks": (["parallel.gpus=5"], "parallel.gpus: 5 ranks cannot share 4 blocks evenly (1..4)"),
    "cuda": (["parallel.gpus=2", "model.device=cuda"], "model.device: 'cuda' asked for CUDA but no CUDA GPU"),
}


@pytest.mark.parametrize("case", sorted(UNRUNNABLE))
def test_loom_serve_refuses_a_pipeline_that_cannot_run_before_it_serves(case):
    """`loom serve` said a split or GPU count that cannot run only once a host connected (and then ended, for
    that host and every later one). It refuses it at once, as a bad key: exit code 2 and one line (a host that
    launched it reads that line as the engine's refusal)."""
    overrides, expected = UNRUNNABLE[case]
    if case == "cuda" and torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    root = Path(__file__).resolve().parents[2]
    served = subprocess.run([sys.executable, "-m", "loom_live.plugin.cli", "serve", "-c", "tiny-random", "--bind",
                             "tcp://127.0.0.1:0", *[arg for override in overrides for arg in ("--set", override)]],
                            capture_output=True, text=True, timeout=120, cwd=root,
                            env={**os.environ, "PYTHONPATH": str(root)})
    lines = served.stderr.strip().splitlines()
    assert served.returncode == 2 and len(lines) == 1, (served.returncode, served.stderr)
    assert lines[0].startswith(f"loom serve: error: {expected}"), lines[0]


def test_block_splits():
    assert even_split(30, 2) == [15, 15]
    assert even_split(30, 4) == [7, 8, 8, 7]  # the VAE ranks get the smaller shares
    assert [list(r) for r in stage_ranges([1, 3])] == [[0], [1, 2, 3]]
    # rank 0 spends 20 ms outside its blocks, the last rank 35 ms (the decoder); 1 ms per block
    split = balanced_split(30, [1.0, 1.0], [20.0, 35.0])
    assert split in ([23, 7], [22, 8]) and sum(split) == 30


def test_noise_ledger_replays_the_denoiser_draw_order():
    """Draw for draw, the ledger hands out what StreamDenoiser's generator would have given."""
    from loom_live.engine.stream.denoiser import StreamDenoiser
    from loom_live.engine.stream.schedule import FlowSchedule

    shape = (1, 2, 1, 2, 2)
    seen: list[torch.Tensor] = []

    class Recorder(StreamDenoiser):
        def _noise(self, like):
            seen.append(super()._noise(like))
            return seen[-1]

    class Identity:
        def forward_stream(self, x, t, cache, cross, commit=True):
            return torch.zeros_like(x)

    class Rows:
        batch = 3

        def rows(self, index):
            return self

        def set_rows(self, index, other):
            pass

    d = Recorder(Identity(), Rows(), None, [700, 500, 300], FlowSchedule(), torch.Generator().manual_seed(5))
    ledger = NoiseLedger(3, torch.Generator().manual_seed(5), torch.device("cpu"), torch.float32)
    d.run_sequential(torch.zeros(shape), 800.0)
    ledger.sequential(0, shape)
    for c in range(1, 5):
        d.push_batch(torch.zeros(shape), 800.0, c)
        ledger.batch(c, shape)
    d.drain()
    ledger.drain()
    expected = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (1, 2), (3, 0), (3, 1), (2, 2),
                (4, 0), (4, 1), (3, 2), (4, 2)]
    assert len(seen) == len(expected)
    for noise, key in zip(seen, expected):
        assert torch.equal(ledger.take(*key), noise), key


def test_loom_bench_gpus_reports_every_rank(tmp_path, capsys):
    from loom_live.plugin.cli.main import main

    out = tmp_path / "bench.json"
    rc = main(["bench", "--config", "tiny-random", "--gpus", "2", "--frames", "16", "--warmup", "9", "--bridge", "none",
               "--no-baseline", "--set", "resolution.width=64", "--set", "resolution.height=64", "--json", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "rank 0 encode + blocks 0-1" in table and "rank 1 blocks 2-3 + decode" in table and "suggested" in table
    loom = json.loads(out.read_text())["loom"]
    assert loom["gpus"] == 2 and loom["fps"] > 0 and loom["measured_frames"] > 0
    assert {"decode", "dit"} <= set(loom["ranks"][1]["stages_ms"])
    assert no_children_left()


@pytest.mark.gpu
def test_graphed_stage_blocks_match_eager_on_a_gpu():
    from loom_live.engine.parallel.link import NEW_CONTEXT
    from loom_live.engine.parallel.stage import Stage

    stages = []
    for graphs in ("true", "false"):
        cfg = load_config("tiny-random", [*BASE, "model.device=cuda", f"stream.cuda_graphs={graphs}",
                                          "stream.steps=[700,500]"])
        stage = Stage(cfg, load_models(cfg, dit_blocks=range(0, 2)), range(0, 2))
        context = torch.randn(1, 8, stage.dit.cfg.text_dim, generator=torch.Generator().manual_seed(1)).cuda()
        stage.apply(NEW_CONTEXT, context)
        stages.append(stage)
    gen = torch.Generator("cuda").manual_seed(0)
    sigmas = torch.tensor([0.9, 0.6], device="cuda")
    with torch.inference_mode():
        for _ in range(12):  # past the window fill, round the ring and through a RoPE refresh
            tokens = torch.randn(2, 4, stages[0].dit.cfg.dim, device="cuda", generator=gen)
            a, b = (s.run(tokens.clone(), s.condition(sigmas, 1), 0, 1) for s in stages)
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert stages[0].graphed.replays > 0 and stages[0].graphed.error is None


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_give_the_one_gpu_frames():
    overrides = [*BASE, "model.device=cuda", "stream.steps=[700,500]"]
    frames = clip(61)
    reference = stream(StreamSession.from_config(load_config("tiny-random", overrides), warmup=False), frames)
    with PipelineSession(load_config("tiny-random", [*overrides, "parallel.gpus=2"])) as pipe:
        out = stream(pipe, frames)
    diff = np.abs(out.astype(int) - reference.astype(int))
    assert out.shape == frames.shape and diff.max() <= 2 and (diff > 0).mean() < 1e-2
    assert no_children_left()


def test_a_pipelined_start_says_its_phases_to_a_waiting_host():
    from loom_live.engine.startup_progress import STARTUP_PROGRESS

    said: list[str] = []
    with STARTUP_PROGRESS.to(said.append):
        with PipelineSession.from_config(load_config("tiny-random", [*BASE, "parallel.gpus=2"]), warmup=False) as pipe:
            pipe.warmup(chunks=2)
    assert said == ["loading the model on 2 GPUs", "compiling and warming up on every GPU (2 chunks)"]
    assert no_children_left()


def test_a_pipeline_engine_killed_or_closed_leaves_no_rendezvous_folder(tmp_path, monkeypatch):
    """A killed engine cannot remove its ranks' rendezvous folder: the restarted engine's pipeline sweeps the
    folders of engines that are gone, so a show with many restarts does not pile them up in /tmp. Then
    Bridge.close says bye: the engine closes its session (the ranks, their folder) before it exits, not on a
    daemon thread that exiting cuts short. (Its ranks' semaphores: test_bridge.py, the group's stop.)"""
    import signal as signals
    import tempfile
    import time
    from pathlib import Path

    from loom_live.host_bridge import Bridge, BridgeConfig

    monkeypatch.setattr(tempfile, "tempdir", tempfile.gettempdir())  # this host's own folders stay where they were
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the launched engines' temporary folders go here
    root = Path(__file__).resolve().parents[2]
    bridge = Bridge(BridgeConfig(engine_config="tiny-random", engine_overrides=[*BASE, "parallel.gpus=2"],
                                 engine_cwd=str(root), restart_backoff_s=0.1)).start()
    try:
        bridge.wait_running(180)
        first = bridge.stats()["engine_pid"]
        (old,) = tmp_path.glob("loom-pipeline-*")  # the ranks' rendezvous, while it runs
        os.kill(first, signals.SIGKILL)
        deadline = time.monotonic() + 180
        while bridge.stats()["engine_pid"] in (first, None) or bridge.status().state != "running":
            assert time.monotonic() < deadline, bridge.status()
            time.sleep(0.1)
        folders = list(tmp_path.glob("loom-pipeline-*"))
        assert old not in folders, "the killed engine's rendezvous folder is still there"
        assert len(folders) == 1
        second = bridge.stats()["engine_pid"]
    finally:
        bridge.close()
    time.sleep(0.5)  # the engine was waited for; its ranks exit with it
    assert not os.path.exists(f"/proc/{second}")
    assert not list(tmp_path.glob("loom-pipeline-*")), "the closed engine's rendezvous folder was left behind"
