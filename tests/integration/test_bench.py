"""`loom bench` end to end on the embedded default: the table and JSON a user reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loom_live.host_bridge.wire.errors import UserError
from loom_live.plugin.cli.main import main
from tests.fakes.disk import fill_the_disk


def test_bench_reports_pipeline_and_bridge(tmp_path, capsys):
    out = tmp_path / "bench.json"
    # the embedded default at 64x64: the table and the JSON have the same rows at any size
    rc = main(["bench", "--config", "tiny-random", "--width", "64", "--height", "64", "--frames", "24", "--warmup", "9",
               "--bridge", "shm", "--bridge-frames", "30", "--baseline-chunks", "2", "--json", str(out)])
    assert rc == 0
    captured = capsys.readouterr()
    table = captured.out
    for row in ("FPS", "time to first frame", "latency p95/p99/max", "chunk period", "stage dit", "stage bridge"):
        assert row in table
    assert "baseline" not in table, "the embedded model has no diffusers counterpart to compare with"
    assert "24/24" in captured.err, "progress ends at N/N"
    assert "loom bench: loading the model\nloom bench: setting up the stream\n" in captured.err  # the start's phases
    result = json.loads(out.read_text())
    loom = result["loom"]
    # the frames the timed window pushed, whatever the chunks in flight at its ends (stream_fps)
    assert loom["measured_frames"] == 24 and loom["fps"] > 0 and loom["dropped"] == 0
    assert loom["latency_ms"]["p99"] >= loom["latency_ms"]["p50"] > 0
    assert {"encode", "dit", "decode"} <= set(loom["stages_ms"])
    assert result["bridge"]["transport"] == "shm" and result["bridge"]["n"] == 30
    assert result["bridge"]["width"] == result["config"]["resolution"]["width"]
    assert result["preset"] == "tiny", "bench defaults to the same preset as every other command"


def test_a_short_warm_up_is_rounded_to_whole_chunks_and_takes_no_measured_frame(tmp_path, capsys):
    """`--warmup 0` (or one between chunks) streamed the first chunk anyway, out of the measured frames:
    `--frames 8 --warmup 0` measured 3 of them and printed FPS 0.00 with exit code 0."""
    out = tmp_path / "bench.json"
    rc = main(["bench", "--config", "tiny-random", "--width", "64", "--height", "64", "--frames", "8", "--warmup", "0",
               "--bridge", "none", "--json", str(out)])
    assert rc == 0
    captured = capsys.readouterr()
    err = captured.err
    assert "--warmup 0 rounded up to 5 frames" in err and "measuring 8 frames" in err
    assert captured.out.endswith(f"\nwrote {out}\n"), "the last line says where the results went"
    loom = json.loads(out.read_text())["loom"]
    assert loom["measured_frames"] > 0 and loom["fps"] > 0


def test_a_generated_clip_is_made_once_the_session_is_up_outside_the_engine_start_up(monkeypatch):
    """The start-up line's time before the first phase is what an engine process pays: `loom bench` makes its
    generated clip after the session is ready, not before."""
    from loom_live.engine.config import load_config
    from loom_live.engine.tools import bench
    from loom_live.plugin.cli.bench import clip_frames

    cfg = load_config("tiny-random", ["resolution.width=32", "resolution.height=32"])
    events = []
    opened = bench.open_session
    monkeypatch.setattr(bench, "open_session", lambda c: (events.append("session"), opened(c))[1])

    def make():
        events.append("frames")
        return clip_frames(cfg, None, 13)

    result = bench.run_loom(cfg, make, warmup=5, input_fps=0.0)
    assert events == ["session", "frames"] and result["fps"] > 0


def test_bench_says_why_it_will_not_run_what_cannot_finish_or_compare(capsys):
    assert main(["bench", "--baseline", "--bridge", "none"]) == 2
    assert "no such counterpart" in capsys.readouterr().err
    from loom_live.engine.config import load_config
    from loom_live.plugin.cli.bench import CPU_FRAMES, plan

    assert plan(load_config("default"), None, None, cuda=False) == (CPU_FRAMES, False)
    assert plan(load_config("wan2.1-1.3b", ["model.random_weights=true"]), None, None, cuda=True) == (3000, True)
    with pytest.raises(UserError, match="on a CPU"):
        plan(load_config("wan2.1-1.3b", ["model.random_weights=true"]), None, None, cuda=False)


def test_bench_refuses_counts_and_a_json_target_it_could_not_use_before_it_runs(tmp_path, capsys, monkeypatch):
    """A --json the results cannot be written to is said at once (not after a run of minutes); so are frame
    counts that measure nothing; an earlier result at the --json path is replaced whole, or not at all."""
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    for args, words in ((["--json", str(a_file / "x.json")], "is a file, not a folder"),
                        (["--json", str(tmp_path)], "is a folder"),
                        (["--frames", "2"], "give at least 5")):
        assert main(["bench", "-c", "tiny-random", "--bridge", "none", *args]) == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err, err
    for args in (["--frames", "-8"], ["--warmup", "-3"]):
        with pytest.raises(SystemExit) as usage:
            main(["bench", *args])
        assert usage.value.code == 2 and "expected" in capsys.readouterr().err
    from loom_live.engine.tools.bench import write_json

    out = tmp_path / "result.json"
    write_json({"fps": 1.0}, out)
    assert json.loads(out.read_text()) == {"fps": 1.0} and not list(tmp_path.glob("*.partial"))
    fill_the_disk(monkeypatch)
    with pytest.raises(OSError, match="No space left on device") as full:
        write_json({"fps": 2.0}, out)
    assert full.value.filename == str(out)
    assert json.loads(out.read_text()) == {"fps": 1.0} and not list(tmp_path.glob("*.partial"))


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc, where nobody may make a file")
def test_a_json_target_whose_folder_cannot_be_made_or_written_is_named_before_the_run(tmp_path, capsys,
                                                                                      monkeypatch):
    """`--json /proc/nope/x.json` passed the check (its nearest folder, /proc, exists) and failed after the whole
    run with "[Errno 2] No such file or directory: '/proc/nope'", naming no option. The check makes the folders
    and a file there, and leaves neither behind."""
    from loom_live.engine.tools import bench
    from loom_live.plugin.cli.bench import check_json_target

    monkeypatch.setattr(bench, "run_loom", lambda *a, **k: pytest.fail("the run started"))
    for target, folder in (("/proc/nope/x.json", "/proc/nope"), ("/proc/x.json", "/proc")):
        assert main(["bench", "-c", "tiny-random", "--bridge", "none", "--json", target]) == 2
        err = capsys.readouterr().err
        assert f"loom bench: error: --json {target}: cannot write in {folder} (" in err, err
    check_json_target(str(tmp_path / "new" / "deeper" / "bench.json"))
    assert list(tmp_path.iterdir()) == []


def test_bench_refuses_a_bad_override(capsys):
    assert main(["bench", "--config", "tiny-random", "--set", "stream.steps=[100,500]", "--bridge", "none"]) == 2
    assert "steps" in capsys.readouterr().err


def test_bench_checks_the_weights_it_is_given_before_any_model_loads(tmp_path, capsys, monkeypatch):
    """A checkpoint or LoRA given to `loom bench` was first read at model load (after the models before it),
    and a path the user may not read ended in a traceback; as in `loom play`, each is one line and exit code 2
    before any model loads."""
    from loom_live.engine.tools import bench
    from tests.fakes.disk import deny_entering

    def loaded(*args, **kwargs):
        raise AssertionError("a model loaded")

    monkeypatch.setattr(bench, "run_loom", loaded)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not weights")
    closed = tmp_path / "closed"
    deny_entering(monkeypatch, closed)
    small = ["bench", "-c", "tiny-random", "--frames", "8", "--bridge", "none"]
    for args, said in ((["--set", f"model.checkpoint={junk}"], f"{junk}: "),
                       (["--lora", str(junk)], f"{junk}: "),
                       (["--lora", str(closed / "ink.safetensors")],
                        f"{closed / 'ink.safetensors'}: cannot be read (Permission denied)")):
        assert main([*small, *args]) == 2, args
        err = capsys.readouterr().err
        assert said in err and len(err.strip().splitlines()) == 1, err


def test_bench_edit_family_reports_each_batch_size_and_the_encoder(tmp_path, capsys):
    out = tmp_path / "edit.json"
    rc = main(["bench", "-c", "edit-tiny", "--frames", "12", "--warmup", "4", "--batches", "2,4",
               "--set", "resolution.width=32", "--set", "resolution.height=32", "--json", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    for row in ("B=2 FPS", "B=4 latency p50/p99", "B=4 stage main.unet", "B=2 stage side.vae_encode",
                "encoder at B=16"):
        assert row in table
    data = json.loads(out.read_text())
    assert set(data["edit"]["runs"]) == {"2", "4"} and data["edit"]["runs"]["4"]["frames_out"] > 0


def test_bench_lora_reports_what_a_live_change_adds_to_the_stream(tmp_path):
    """`benchmarks/bench_lora.py` on the tiny model: both runs, the changes made, the merge's span and
    the push excess after each change (the figure the scale-change row is judged by)."""
    import subprocess
    import sys
    from pathlib import Path

    from loom_live.engine.config import load_config

    out = tmp_path / "lora.json"
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_lora.py"
    proc = subprocess.run([sys.executable, str(script), "--config", "tiny-random", "--frames", "24", "--warmup", "9",
                           "--period", "0.02", "--set", "resolution.width=64", "--set", "resolution.height=64",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    changes = result["runs"]["2 LoRAs, live scale"]["lora_changes"]
    parts = load_config("tiny-random").stream.lora_merge_parts  # a change's merge spans that many chunks
    assert changes >= 1 and result["runs"]["no LoRA"]["lora_changes"] == 0
    assert result["change_excess_ms"]["count"] == changes and 1 <= result["scale_change_ms"]["count"] <= changes * parts
    assert result["change_excess_ms"]["median_push"] > 0 and result["change_excess_ms"]["max"] >= \
        result["change_excess_ms"]["mean"]


def test_change_excess_is_the_longest_push_after_a_change_less_the_median():
    from loom_live.engine.tools.bench import change_excess_ms

    pushes = [0.1, 0.1, 0.1, 0.13, 0.1, 0.1, 0.1, 0.1, 0.105, 0.1]
    got = change_excess_ms(pushes, [2, 7])  # the first change's merge shows in the push after it
    assert got["count"] == 2 and got["median_push"] == 100.0
    assert abs(got["max"] - 30.0) < 1e-9 and abs(got["mean"] - 17.5) < 1e-9
    assert got["quiet_count"] == 1 and got["quiet_max"] == 0.0  # pushes 4..5; after 7 no room is left


def test_change_excess_sets_windows_without_a_change_beside_it():
    from loom_live.engine.tools.bench import change_excess_ms

    pushes = [0.1] * 24
    pushes[1], pushes[6], pushes[13], pushes[18] = 0.12, 0.104, 0.11, 0.107  # changes at 0 and 12
    got = change_excess_ms(pushes, [0, 12], after=3)
    assert got["count"] == 2 and abs(got["mean"] - 15.0) < 1e-9 and abs(got["max"] - 20.0) < 1e-9
    # the quiet windows start midway between a change's pushes and the next change: 6..8 and 18..20
    assert got["quiet_count"] == 2 and abs(got["quiet_mean"] - 5.5) < 1e-9 and abs(got["quiet_max"] - 7.0) < 1e-9


def test_bench_process_start_times_each_step_in_a_fresh_process_and_skips_what_this_machine_lacks(tmp_path):
    """`benchmarks/bench_process_start.py`: the steps up to the one asked for, each with a time or the reason
    it was not timed (no CUDA device here), in the JSON and the printed table."""
    import subprocess
    import sys
    from pathlib import Path

    import torch

    out = tmp_path / "start.json"
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_process_start.py"
    proc = subprocess.run([sys.executable, str(script), "--runs", "1", "--upto", "cudnn", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {row["step"]: row for row in json.loads(out.read_text())["results"]}
    assert list(rows) == ["interpreter", "torch", "loom", "cuda", "cublas", "cudnn"]
    assert rows["torch"]["first_s"] > rows["interpreter"]["first_s"] > 0
    assert "import torch" in proc.stdout and "in all" in proc.stdout and "bytecode: " in proc.stdout
    if not torch.cuda.is_available():
        for key in ("cuda", "cublas", "cudnn"):
            assert rows[key]["first_s"] is None and rows[key]["note"] == "no CUDA device"


def test_bench_cold_start_runs_each_variant_in_a_fresh_cache_with_its_compiler_options(tmp_path):
    """`benchmarks/bench_cold_start.py`: each variant's start-up and FPS in the JSON and the table, its compiler
    options (Inductor's, Dynamo's) read back from the child that ran it, its compile caches under a folder of
    its own (the user's stays untouched); an option torch lacks is refused by name before anything runs."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_cold_start.py"
    out, users = tmp_path / "cold.json", tmp_path / "users_cache"
    env = {**os.environ, "LOOM_CACHE_DIR": str(users)}
    proc = subprocess.run([sys.executable, str(script), "--variants", "mine", "--option",
                           "mine:triton.autotune_pointwise=false", "--option",
                           "mine:dynamo.assume_static_by_default=false", "--json", str(out), "--",
                           "-c", "tiny-random", "--frames", "8", "--set", "resolution.width=32", "--set",
                           "resolution.height=32"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = json.loads(out.read_text())["variants"]
    assert row["applied"] == {"triton.autotune_pointwise": False, "dynamo.assume_static_by_default": False}
    assert row["fps"] > 0
    assert set(row["startup"]["phases_s"]) >= {"load", "session"}
    assert "mine" in proc.stdout and "start-up s" in proc.stdout
    assert not (users / "inductor").exists(), "a variant's caches live in its own fresh folder"
    bad = subprocess.run([sys.executable, str(script), "--variants", "default", "--option", "default:triton.nope=1"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "no compiler option 'triton.nope'" in bad.stderr


def test_a_zero_the_config_does_not_allow_is_refused_not_dropped(capsys):
    """`--gpus 0`, `--width 0` and `--height 0` were dropped without a word (the run went on with the config's
    values); each is refused naming the key and what is allowed, before any session starts."""
    small = ["--config", "tiny-random", "--set", "resolution.width=64", "--set", "resolution.height=64",
             "--frames", "5", "--warmup", "5", "--bridge", "none"]
    for flag, key in (("--gpus", "parallel.gpus"), ("--width", "resolution.width"), ("--height", "resolution.height")):
        assert main(["bench", *small, flag, "0"]) == 2, flag
        captured = capsys.readouterr()
        assert f"{key}: 0 is not allowed" in captured.err and "loading the model" not in captured.err, captured.err


def test_a_cuda_ipc_bridge_round_trip_without_a_gpu_is_refused_before_the_run(capsys):
    """`--bridge cuda-ipc` on a CPU ran the whole bench, then said under the table only "not measured:
    RuntimeError: wait_running: the bridge is not started; call start() first"."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: cuda-ipc may work")
    small = ["--config", "tiny-random", "--set", "resolution.width=64", "--set", "resolution.height=64",
             "--frames", "5", "--warmup", "5"]
    assert main(["bench", *small, "--bridge", "cuda-ipc"]) == 2
    captured = capsys.readouterr()
    assert "--bridge cuda-ipc: no CUDA device here; use --bridge shm" in captured.err, captured.err
    assert "loading the model" not in captured.err and captured.out == ""


def test_a_wan_only_option_on_the_edit_family_is_refused_by_its_own_name(capsys):
    """`--encoder taehv` / `--decoder taehv` on edit-tiny set vae.encoder / vae.decoder, which the edit family does
    not read, and ran without a word; `--steps 700,500` (the default) too. Each names the option and what the edit
    family reads instead, before any session starts."""
    small = ["--config", "edit-tiny", "--frames", "8", "--warmup", "0", "--batches", "2", "--bridge", "none"]
    for flag, value, instead in (("--encoder", "taehv", "edit.vae"), ("--decoder", "wan", "edit.vae"),
                                 ("--steps", "700,500", "edit.steps"), ("--mode", "auto", "edit.batch")):
        assert main(["bench", *small, flag, value]) == 2, flag
        captured = capsys.readouterr()
        assert f"{flag} {value}: the edit family does not read it" in captured.err, captured.err
        assert instead in captured.err and captured.out == "", captured.err
