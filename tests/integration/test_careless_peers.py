"""Careless and hostile peers, round two (issue 32), through real processes, sockets, engines and bridges:
one host's messages go only to that host, nothing a host sends can freeze it or park the engine, and a
bad file is refused up front."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from loom_live.host_bridge import Bridge, BridgeConfig, EngineRefused, EngineState
from loom_live.host_bridge.wire import pixels
from loom_live.host_bridge.wire.channel import Channel, SharedSecret, apply_curve_keys, read_secret_file
from loom_live.host_bridge.wire.protocol import encode, make
from tests.fakes.engines import served_engine, wait_until

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with served_engine(tmp_path_factory.mktemp("served")) as endpoint_and_secret:
        yield endpoint_and_secret


def _waiting_host(endpoint: str, secret_file: str, ctx: zmq.Context) -> Channel:
    """A second host that holds the secret and says hello, as a connecting bridge does."""
    return Channel(ctx, endpoint, bind=False, curve=SharedSecret(read_secret_file(secret_file), server=False))


def test_a_waiting_host_hears_only_that_it_waits_and_the_attached_host_loses_nothing(served):
    """Point 1: the engine's replies went round-robin to every peer past the handshake, so a host waiting
    to get in took the attached host's heartbeats, acks and stats (and its set_params timed out)."""
    endpoint, secret = served
    ctx = zmq.Context()
    cfg = BridgeConfig(launch=False, endpoint=endpoint, secret_file=secret, transport="tcp", heartbeat_s=0.1,
                       request_timeout_s=3.0)
    waiting = None
    try:
        with Bridge(cfg) as attached:
            attached.wait_running(30)
            waiting = _waiting_host(endpoint, secret, ctx)
            heard: list[dict] = []
            hello = make("hello", role="host", token=read_secret_file(secret), pid=os.getpid() + 1,
                         transports=["tcp"])
            for i in range(3):
                waiting.send(hello)
                attached.set_params(wait=True, noise_scale=0.5 + 0.1 * i)  # each answered, none taken
                attached.set_prompt(f"style {i}", wait=True)
                deadline = time.monotonic() + 0.4
                while time.monotonic() < deadline:
                    heard += [m for m, _ in waiting.poll(0.05)]
            frames = [np.full((8, 8, 3), i * 30, np.uint8) for i in range(4)]
            assert all(np.array_equal(a, b) for a, b in zip(frames, attached.process(frames, timeout_s=20)))
            assert attached.status().state == EngineState.RUNNING and attached.status().restarts == 0
        kinds = [m["type"] for m in heard]
        assert kinds and set(kinds) == {"wait"}, kinds
        assert "another host" in heard[0]["reason"]
    finally:
        if waiting is not None:
            waiting.close()
        ctx.term()


def _intruder_on(lane_endpoint: str, secret_file: str, ctx: zmq.Context) -> zmq.Socket:
    """A peer holding the secret that found the served engine's frame lane port: connected (its handshake
    done, so a DEALER engine would deal it notices) before this returns."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    apply_curve_keys(sock, SharedSecret(read_secret_file(secret_file), server=False))
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        sock.connect(lane_endpoint)
        assert monitor.poll(20_000), "the intruder's lane handshake did not succeed"
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
    return sock


def test_a_second_holder_of_the_secret_on_the_frame_lane_takes_none_of_the_attached_hosts_frames(served):
    """Point 1's last hole: the served engine's frame lane was a DEALER on a random port, so a peer holding
    the secret that found the port took a round-robin share of the frame notices and releases meant for the
    attached host (whose frames then never came back), and the engine took its notices as the host's."""
    endpoint, secret = served
    ctx = zmq.Context()
    cfg = BridgeConfig(launch=False, endpoint=endpoint, secret_file=secret, transport="tcp", heartbeat_s=0.1)
    intruder = None
    try:
        with Bridge(cfg) as attached:
            attached.wait_running(30)
            first = np.full((8, 8, 3), 1, np.uint8)
            assert np.array_equal(attached.process([first], timeout_s=15)[0], first)  # its rings are made
            intruder = _intruder_on(attached._link.lane.endpoint, secret, ctx)
            notice = make("frame", dir="in", slot=0, seq=10**6, gen=attached._link.generation, nbytes=192)
            intruder.send_multipart([encode(notice), bytes([255]) * 192])  # taken, it would go out as the host's
            frames = [np.full((8, 8, 3), 10 + i * 20, np.uint8) for i in range(12)]
            outputs = attached.process(frames, timeout_s=15)
            assert len(outputs) == len(frames) and all(np.array_equal(a, b) for a, b in zip(frames, outputs))
            assert wait_until(lambda: attached.stats()["engine"].get("refused", 0) >= 1, 10), attached.stats()
            heard = intruder.poll(300) and intruder.recv_multipart(zmq.NOBLOCK)
            assert not heard, heard
    finally:
        if intruder is not None:
            intruder.close(linger=0)
        ctx.term()


def test_a_bridge_without_the_secret_of_a_served_engine_is_refused_when_it_is_made(served):
    """Point 2: it showed `restarting` and tried again every 20 s, never saying why."""
    endpoint, _ = served
    line = (f"endpoint {endpoint}: an engine served on this machine takes only hosts that hold its session "
            "secret; give secret_file FILE, the file its `loom serve --secret-file` uses")
    with pytest.raises(ValueError) as refused:
        Bridge(launch=False, endpoint=endpoint, transport="tcp")
    assert str(refused.value) == f"BridgeConfig: {line}"  # the hosts' own line, as every BridgeConfig error
    with pytest.raises(ValueError, match="give secret_file FILE"):
        BridgeConfig(launch=False, endpoint="ipc:///tmp/loom-engine", transport="tcp")


def _launched(**kw) -> BridgeConfig:
    base = dict(passthrough=True, engine_cwd=str(ROOT), heartbeat_s=0.1, hang_timeout_s=1.0, restart=False,
                stop_timeout_s=1.0)
    return BridgeConfig(**{**base, **kw})


def test_an_8k_frame_never_holds_up_the_hosts_frame_loop(monkeypatch):
    """Point 3: `submit()` of an 8192x8192 frame shrank it on the caller's thread (2-3 s of a frozen frame
    loop). The shrink is held here until the host's calls have returned: they must not wait for it."""
    gate = threading.Event()
    shrink = pixels.limit_size

    def held_shrink(frame, max_side):
        gate.wait(60)
        return shrink(frame, max_side)

    monkeypatch.setattr(pixels, "limit_size", held_shrink)
    frame = np.full((8192, 8192, 3), 9, np.uint8)
    frame[:, 4096:] = 200
    with Bridge(_launched(max_frame_side=1024)) as bridge:
        bridge.wait_running(30)
        returned = threading.Event()

        def frame_loop():
            bridge.submit(frame)
            bridge.latest()
            bridge.submit(frame)  # a second one while the first is still being shrunk: latest wins
            bridge.latest()
            returned.set()

        threading.Thread(target=frame_loop, daemon=True).start()
        try:
            assert returned.wait(30), "submit() or latest() waited for the shrink"
        finally:
            gate.set()
        assert bridge.wait_for_output(bridge.last_seq, 30)
        out, status = bridge.latest()
        assert out.shape == (1024, 1024, 3) and not status.fallback
        assert (out[:, :512] == 9).all() and (out[:, 512:] == 200).all()
        assert bridge.stats()["dropped"] == 1  # the first frame, replaced before it reached the engine
        nan = np.full((8192, 8192, 3), np.nan, np.float32)
        assert bridge.submit(nan) is False  # refused off the caller's thread, and counted
        assert wait_until(lambda: bridge.stats()["refused_frames"] == 1, 30)
        assert "NaN" in bridge.stats()["last_error"]


def _not_a_checkpoint(folder: Path, kind: str) -> Path:
    """A file that exists and is not the DiT's weights: text, a pickle of no tensors, a foreign pickle,
    or a tensor file with a DiT key of the wrong shape."""
    import torch

    path = folder / ("passwd" if kind == "text" else "model.pt")
    if kind == "text":
        path.write_text("root:x:0:0:root:/root:/bin/bash\n")
    elif kind == "pickle":
        torch.save({"step": 3, "note": "not weights"}, path)
    elif kind == "foreign pickle":
        torch.save({"weights": {"w": torch.zeros(2)}, "loss": torch.nn.MSELoss()}, path)
    else:
        torch.save({"patch_embedding.weight": torch.zeros(3, 3)}, path)
    return path


@pytest.mark.parametrize("kind", ["text", "pickle", "foreign pickle", "wrong shapes"])
def test_what_each_weights_file_holds_is_checked_without_reading_its_weights(tmp_path, kind):
    from loom_live.engine.config import load_config
    from loom_live.host_bridge.wire.errors import UserError
    from loom_live.plugin.cli.preflight import check_weights

    path = _not_a_checkpoint(tmp_path, kind)
    with pytest.raises(UserError) as refused:  # a Wan DiT's file (the embedded preset reads its own layout)
        check_weights(load_config("tiny-random", [f"model.checkpoint={path}"]))
    assert str(path) in str(refused.value) and "\n" not in str(refused.value) and "\x1b" not in str(refused.value)
    expected = {"text": "unknown checkpoint format", "pickle": "holds no tensor dictionary",
                "foreign pickle": "unreadable checkpoint", "wrong shapes": "file (3, 3) vs model"}[kind]
    assert expected in str(refused.value)


def test_a_fitting_checkpoint_passes_the_check(tmp_path):
    """The check read keys and shapes onto the meta device and then took every weight it left there (all
    of them) for a missing one, so it refused every real checkpoint."""
    import torch
    from safetensors.torch import save_file

    from loom_live.engine.config import load_config
    from loom_live.engine.models.loading import check_weight_files
    from loom_live.engine.models.wan_dit import DIT_PRESETS, WanDiT

    path = tmp_path / "dit.safetensors"
    save_file({k: v.contiguous() for k, v in WanDiT(DIT_PRESETS["tiny"]).state_dict().items()}, str(path))
    check_weight_files(load_config("tiny-random", [f"model.checkpoint={path}"]))
    torch.save({"state_dict": {"patch_embedding.weight": torch.zeros(1)}}, tmp_path / "short.pt")
    with pytest.raises(ValueError, match="missing keys"):
        check_weight_files(load_config("tiny-random", [f"model.checkpoint={tmp_path / 'short.pt'}"]))


def test_a_file_that_is_not_a_checkpoint_is_refused_before_an_engine_starts(tmp_path):
    """Point 4: it crashed the engine (exit 1), the bridge restarted it for ever, and `loom play` ended with
    exit 3 after 16 s. Now: exit 2, one line naming the file, no engine started (the other kinds of file:
    the test above)."""
    path = _not_a_checkpoint(tmp_path, "text")
    out = subprocess.run([sys.executable, "-m", "loom_live.plugin.cli", "play", "-n", "4", "--size", "32x32", "-o",
                          str(tmp_path / "out.mp4"), "--set", f"model.checkpoint={path}"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and str(path) in lines[0], out.stderr
    assert "root:x" not in out.stderr and "engine" not in out.stderr.lower().replace("loom serve", "")


def test_an_engine_whose_build_fails_on_its_inputs_refuses_its_run(tmp_path):
    """Point 4: an engine whose session cannot be built from its inputs (here a LoRA for another model
    size, found only when the DiT is built) refuses its run (dead, said once) instead of crashing with
    exit 1 and being restarted for ever."""
    import torch
    from safetensors.torch import save_file

    lora = tmp_path / "ink.safetensors"
    save_file({"lora_unet_blocks_0_self_attn_q.lora_down.weight": torch.zeros(4, 7),
               "lora_unet_blocks_0_self_attn_q.lora_up.weight": torch.zeros(192, 4)}, str(lora))
    cfg = BridgeConfig(engine_cwd=str(ROOT), engine_args=["--lora", str(lora)], restart_backoff_s=0.05)
    with Bridge(cfg) as bridge:
        with pytest.raises(EngineRefused, match="shapes that do not fit this model"):
            bridge.wait_running(60)
        assert bridge.status().restarts == 0


def _lora(folder: Path, kind: str, name: str = "ink") -> Path:
    """A LoRA file for the default (embedded) model: a good one, or one a run must refuse."""
    import torch
    from safetensors.torch import save_file

    from loom_live.engine.models.wan_dit import DIT_PRESETS, WanDiT

    with torch.device("meta"):
        q = WanDiT(DIT_PRESETS["embedded"]).blocks[0].self_attn.q.weight
    path = folder / (name if kind == "no suffix" else f"{name}.safetensors")
    down, up = "lora_unet_blocks_0_self_attn_q.lora_down.weight", "lora_unet_blocks_0_self_attn_q.lora_up.weight"
    if kind in ("text", "no suffix"):
        path.write_text("root:x:0:0:root:/root:/bin/bash\n")
    elif kind == "not a lora":  # a DiT weight, not a low-rank pair
        save_file({"blocks.0.self_attn.q.weight": torch.zeros(tuple(q.shape))}, str(path))
    elif kind == "wrong shapes":  # a LoRA for another model size
        save_file({down: torch.zeros(4, q.shape[1] + 3), up: torch.zeros(q.shape[0] * 2, 4)}, str(path))
    else:
        save_file({down: torch.zeros(4, q.shape[1]), up: torch.zeros(q.shape[0], 4), "lora_unet_blocks_0_self_attn_q"
                   ".alpha": torch.tensor(4.0)}, str(path))
    return path


LORA_REFUSALS = {"text": "unreadable safetensors file", "no suffix": "unknown checkpoint format",
                 "not a lora": "keys that are not LoRA weights", "wrong shapes": "shapes that do not fit this model"}


@pytest.mark.parametrize("kind", sorted(LORA_REFUSALS))
def test_a_lora_file_is_checked_for_its_layout_and_shapes_before_an_engine_starts(tmp_path, kind):
    """Point 4's last hole: a LoRA file was first read when the engine built its DiT."""
    from loom_live.engine.config import load_config
    from loom_live.engine.host_overrides import lora_override
    from loom_live.engine.models.loading import check_weight_files

    good, path = _lora(tmp_path, "good", "paper"), _lora(tmp_path, kind)
    check_weight_files(load_config("default", lora_override([f"{good}:0.5"])))  # a fitting one passes
    with pytest.raises(ValueError) as refused:
        check_weight_files(load_config("default", lora_override([str(good), f"{path}:0.8"])))
    text = str(refused.value)
    assert text.startswith(str(path)) and LORA_REFUSALS[kind] in text and "\n" not in text, text
    assert "root:x" not in text


def _edit_file(folder: Path, key: str) -> Path:
    """A file (or directory) that is not what edit.KEY needs: text, foreign keys, or another model."""
    import torch
    from safetensors.torch import save_file

    if key == "encoder_path":
        (folder / "encoder").mkdir()
        (folder / "encoder" / "config.json").write_text('{"model_type": "llama"}')
        return folder / "encoder"
    path = folder / f"{key}.safetensors"
    if key == "checkpoint":
        path.write_text("root:x:0:0:root:/root:/bin/bash\n")
    else:  # a tensor file whose keys belong to no such model
        save_file({"model.layers.0.mlp.up_proj.weight": torch.zeros(4, 4)}, str(path))
    return path


def _fitting_edit_files(folder: Path) -> list[str]:
    """Weights of the edit-tiny models, saved as a run would be given them: overrides naming them."""
    from safetensors.torch import save_file

    from loom_live.engine.edit.lllite import LLLite, select_hooks
    from loom_live.engine.edit.unet import UNET_PRESETS, EditUNet
    from loom_live.engine.edit.vae import VAE_PRESETS, TinyVAE

    folder.mkdir()
    unet = EditUNet(UNET_PRESETS["tiny"])
    points = select_hooks(unet.hook_points(), "down")
    lllite = LLLite(unet.hook_sizes(64 // 8), points, (64, 64), 4)
    files = {"checkpoint": unet, "vae_checkpoint": TinyVAE(VAE_PRESETS["tiny"]), "lllite": lllite}
    for key, module in files.items():
        save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(folder / f"{key}.safetensors"))
    return [f"edit.{key}={folder / key}.safetensors" for key in files]


EDIT_REFUSALS = {"checkpoint": "unreadable safetensors file", "vae_checkpoint": "model.layers.0.mlp.up_proj.weight",
                 "lllite": "model.layers.0.mlp.up_proj.weight", "encoder_path": "is not a Qwen3-VL model"}


@pytest.mark.parametrize("key", sorted(EDIT_REFUSALS))
def test_each_edit_family_file_is_checked_before_an_engine_starts(tmp_path, key):
    """Point 4's last hole: the edit family's files were first read when the engine built its models."""
    from loom_live.engine.config import load_config
    from loom_live.engine.models.loading import check_weight_files

    check_weight_files(load_config("edit-tiny", _fitting_edit_files(tmp_path / "fitting")))  # these pass
    path = _edit_file(tmp_path, key)
    extra = ["edit.encoder=qwen3-vl"] if key == "encoder_path" else []
    with pytest.raises(ValueError) as refused:
        check_weight_files(load_config("edit-tiny", [f"edit.{key}={path}", *extra]))
    text = str(refused.value)
    assert str(path) in text and EDIT_REFUSALS[key] in text and "\n" not in text, text


def _refused_at_once(tmp_path: Path, *argv: str) -> str:
    out = subprocess.run([sys.executable, "-m", "loom_live.plugin.cli", *argv], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, (out.returncode, out.stderr)
    return lines[0]


def test_a_bad_lora_or_edit_file_is_refused_by_loom_play_and_loom_serve_with_exit_2_and_one_line(tmp_path):
    """Point 4's last hole, through the commands: exit 2 and one line naming the file, no engine started."""
    lora = _lora(tmp_path, "wrong shapes")
    line = _refused_at_once(tmp_path, "play", "-n", "4", "--size", "32x32", "-o", str(tmp_path / "out.mp4"),
                            "--lora", f"{lora}:0.7")
    assert str(lora) in line and "shapes that do not fit this model" in line, line
    lllite = _edit_file(tmp_path, "lllite")
    line = _refused_at_once(tmp_path, "serve", "--bind", "tcp://127.0.0.1:0", "-c", "edit-tiny", "--set",
                            f"edit.lllite={lllite}")
    assert str(lllite) in line and "model.layers.0.mlp.up_proj.weight" in line, line


CONFIG_FILES = {  # point 5: what each file holds, and what its one-line refusal must say
    "syntax": (b"model:\n  preset: tiny\n  seed: [1, 2\nvae:\n  x: 1\n", "not valid YAML at line 4, column 4"),
    "twice": (b"model:\n  seed: 3\nvae: {encoder: taehv}\nmodel:\n  seed: 4\n",
              "line 4, column 1: 'model' is written twice"),
    "encoding": (b"model:\n  seed: 3 \xff\xfe\n", "not UTF-8 text"),
    "shadow": (b"root:$6$abcdefgh$SECRETHASH:19000:0:99999:7:::\ndaemon:*:19000:0:99999:7:::\n",
               "a key that is not a name"),
    "unused": (b"model: {preset: embedded}\nvae: {encoder: taehv, decoder: taehv, checkpoint: /models/vae.pth}\n",
               "vae.checkpoint: this run does not read it"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_FILES))
def test_a_config_file_is_refused_in_one_line_that_names_it_and_echoes_none_of_it(tmp_path, case):
    from loom_live.engine.config import load_config

    content, expected = CONFIG_FILES[case]
    path = tmp_path / ("run.yaml" if case != "shadow" else "shadow")
    path.write_bytes(content)
    with pytest.raises(ValueError) as refused:
        load_config(str(path))
    text = str(refused.value)
    if case == "unused":  # the default preset given a Wan VAE's weights: said, not ignored
        with pytest.raises(ValueError, match=expected):
            load_config("default", ["vae.checkpoint=/models/Wan2.1_VAE.pth"])
    assert "\n" not in text and str(path) in text and expected in text, text
    assert "SECRET" not in text and "seed: [1" not in text


def test_a_file_that_is_not_a_config_is_refused_by_the_command_without_a_line_of_it(tmp_path):
    shadow = tmp_path / "shadow"
    shadow.write_bytes(CONFIG_FILES["shadow"][0])
    out = subprocess.run([sys.executable, "-m", "loom_live.plugin.cli", "play", "-c", str(shadow), "-o",
                          str(tmp_path / "out.mp4")], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert str(shadow) in out.stderr and "SECRET" not in out.stderr and "$6$" not in out.stderr


def test_an_embeddings_file_that_is_not_one_is_refused_in_loom_words(tmp_path):
    from loom_live.engine.config import load_config
    from loom_live.engine.models.loading import check_weight_files

    path = tmp_path / "prompts.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}   garbage")
    cfg = load_config("default", ["prompt.encoder=file", f"prompt.path={path}"])
    with pytest.raises(ValueError) as refused:
        check_weight_files(cfg)
    text = str(refused.value)
    assert text.startswith(f"{path}: not a prompt embeddings file") and "loom encode-prompts" in text, text


def test_flushes_naming_frames_that_never_come_park_nothing():
    """Point 6: each flush that named a frame notice that never came parked the engine's frame worker for
    2 s, frames and requests alike; six of them froze the stream for 12 s."""
    with Bridge(_launched(transport="tcp", request_timeout_s=30.0)) as bridge:
        bridge.wait_running(30)
        link = bridge._link
        for i in range(6):  # what a careless or hostile host holding the secret can send (before: 12 s parked)
            link.send(make("flush", id=10_000 + i, seq=10**9))
        bridge.submit(np.full((16, 16, 3), 77, np.uint8))
        assert bridge.wait_for_output(bridge.last_seq, 10), "the frame worker was parked"
        assert (bridge.latest()[0] == 77).all()
        bridge.set_params(wait=True, noise_scale=0.4)  # answered once the flushes gave up: each bounded


def test_an_input_size_that_changes_every_frame_keeps_the_stream_going():
    """Point 6: a new input size on every frame made new rings (and, in a model session, a drained stream)
    for every frame, so no output came until the churn stopped, and then seconds of nothing. The size the
    engine sees changes only once a new one has held for a chunk of frames; until then frames are fitted
    to the size in use, so a size change costs at most one chunk."""
    sizes = [(24, 32), (30, 40), (36, 48), (20, 20)]
    with Bridge(_launched()) as bridge:
        bridge.wait_running(30)
        bridge.submit(np.full((24, 32, 3), 5, np.uint8))
        assert bridge.wait_for_output(bridge.last_seq, 10)
        generation = bridge._link.generation
        for i in range(40):
            h, w = sizes[i % len(sizes)]
            bridge.submit(np.full((h, w, 3), 100 + i, np.uint8))
            assert bridge.wait_for_output(bridge.last_seq, 10), f"no output for churning frame {i}"
            out, status = bridge.latest()
            assert out.shape == (24, 32, 3) and (out == 100 + i).all() and not status.fallback
        assert bridge._link.generation == generation  # no new rings while the size churned
        for i in range(8):  # a size that holds: taken after a chunk of frames
            bridge.submit(np.full((36, 48, 3), 200 + i, np.uint8))
            assert bridge.wait_for_output(bridge.last_seq, 10)
        assert bridge.latest()[0].shape == (36, 48, 3) and bridge._link.generation == generation + 1


@pytest.mark.skipif(os.name == "nt", reason="POSIX signals")
def test_after_a_restart_the_state_shown_with_a_frame_matches_the_frame():
    """Point 7: after a restart the status said `running` while fallback frames still went out (223 frames in
    one run): a ready engine that has not sent this host a restyled frame yet is not shown as running."""
    import signal

    with Bridge(_launched(restart=True, restart_backoff_s=0.05)) as bridge:
        bridge.wait_running(30)
        bridge.submit(np.full((16, 16, 3), 50, np.uint8))
        assert bridge.wait_for_output(bridge.last_seq, 10)
        assert bridge.latest()[1].state == EngineState.RUNNING
        os.kill(bridge._link.pid, signal.SIGKILL)
        assert wait_until(lambda: bridge.status().restarts == 1 and bridge.status().state == EngineState.RUNNING,
                          30)
        frame, status = bridge.latest()  # the new engine is ready and has restyled nothing yet
        assert status.fallback and status.state == EngineState.RESTARTING, status
        assert "first restyled frame" in status.message
        bridge.submit(np.full((16, 16, 3), 60, np.uint8))
        assert bridge.wait_for_output(bridge.last_seq, 10)
        frame, status = bridge.latest()
        assert not status.fallback and status.state == EngineState.RUNNING and (frame == 60).all()
