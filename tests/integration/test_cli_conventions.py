"""One CLI: the same options, defaults, help and exit codes on every `loom` subcommand, and failures that
need no engine reported before one starts."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loom_live.host_bridge.wire.errors import UserError
from loom_live.plugin.cli import preflight
from loom_live.plugin.cli.main import build_parser, main
from loom_live.plugin.cli.preflight import check_transport

ROOT = Path(__file__).resolve().parents[2]
MODEL_COMMANDS = ("play", "serve", "bench", "eval", "prepare")


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    return dict(parser._subparsers._group_actions[0].choices)


def test_commands_that_run_a_model_take_the_same_config_options_and_default():
    subs = _subparsers()
    for name in MODEL_COMMANDS:
        actions = {a.dest: a for a in subs[name]._actions}
        assert {"-c", "--config"} <= set(actions["config"].option_strings), name
        assert actions["config"].default == "default", name
        assert actions["overrides"].option_strings == ["--set"] and actions["overrides"].default == [], name


def test_every_option_has_help_and_test_hooks_are_hidden():
    for name, sub in _subparsers().items():
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"loom {name} {'/'.join(action.option_strings) or action.dest}: no help text"
    serve_help = _subparsers()["serve"].format_help()
    assert "--stall-after" not in serve_help


def test_play_help_names_every_key_and_osc_address_the_player_takes():
    """The help's keys and OSC addresses come from the player's own tables (the LoRA key and address were
    missing from a hand-written list)."""
    from loom_live.plugin.player.controls import KEY_HELP
    from loom_live.plugin.player.osc import OSC_ADDRESSES

    text = _subparsers()["play"].format_help()
    assert all(f"{key}  " in text and what in text for key, what in KEY_HELP)
    assert all(address in text for address in OSC_ADDRESSES)
    assert "/loom/lora/scale name f" in text


def test_version_and_a_bad_option_named_by_its_own_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("loom ")
    with pytest.raises(SystemExit) as exit_info:
        main(["play", "--bogus"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == ("loom play: error: unrecognized arguments: --bogus "
                                       "(loom play --help lists the options)\n")


@pytest.mark.parametrize(("argv", "said"), [
    (["play", "--size", "0x0"], "loom play: error: argument --size: '0x0': width and height must be even and at "
                                "least 16 (loom play --help lists the options)"),
    (["play", "--osc-port", "abc"], "loom play: error: argument --osc-port: invalid int value: 'abc' "
                                    "(loom play --help lists the options)"),
    (["play", "--transport", "bogus"], "loom play: error: argument --transport: invalid choice: 'bogus' (choose from "
                                       "'shm', 'tcp', 'cuda-ipc') (loom play --help lists the options)"),
    (["bench", "--frames"], "loom bench: error: argument --frames: expected one argument "
                            "(loom bench --help lists the options)"),
    (["serve"], "loom serve: error: one of the arguments --connect --bind is required "
                "(loom serve --help lists the options)"),
    (["train", "fit", "--bogus"], "loom train: error: unrecognized arguments: --bogus "
                                  "(loom train --help lists the commands)"),
    (["nosuch"], "loom: error: argument COMMAND: invalid choice: 'nosuch' (choose from 'info', 'play', 'web', 'serve', "
                 "'pull', 'prepare', 'encode-prompts', 'bench', 'eval', 'train') (loom --help lists the commands)"),
])
def test_a_mistaken_option_of_any_command_is_one_line_and_exit_2(capsys, argv, said):
    """The README's promise, one line saying what and what is allowed: argparse printed its usage block (14 lines
    for `loom play`) before the error, which the line then ended up below."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == said + "\n"


def test_help_is_still_the_usage_and_every_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["play", "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and out.startswith("usage: loom play [-h]") and "--startup-timeout S" in out


def test_a_step_list_refused_says_what_a_step_list_is_from_set_and_from_a_config_file(tmp_path, capsys):
    """`--set stream.steps=9` said "expected a list of int": not the order, the count or the range a step list
    takes. Said by the config's own check, so a YAML file is told the same."""
    allowed = "expected a descending list of 1 to 4 whole timesteps in [1, 999], such as [700, 500]"
    config = tmp_path / "mine.yaml"
    config.write_text("stream:\n  steps: 9\n")
    for options in (["--set", "stream.steps=9"], ["-c", str(config)]):
        assert main(["play", *options, "-o", str(tmp_path / "x.mp4")]) == 2
        err = capsys.readouterr().err
        assert f"stream.steps: 9 is not allowed; {allowed}\n" in err and err.count("\n") == 1, err
    assert main(["play", "--set", "stream.steps=[500, 700]", "-o", str(tmp_path / "x.mp4")]) == 2
    assert allowed in capsys.readouterr().err  # the order, which the field's type cannot say
    assert not (tmp_path / "x.mp4").exists()


def test_failures_that_need_no_engine_exit_2_once_before_any_engine(tmp_path, capsys):
    assert main(["play", "-c", "wan2.1-1.3b", "-o", str(tmp_path / "x.mp4")]) == 2
    err = capsys.readouterr().err
    assert err.count("loom pull wan2.1-1.3b") == 1 and not (tmp_path / "x.mp4").exists()
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    secret.chmod(0o600)
    started = time.monotonic()
    assert main(["play", "--endpoint", f"tcp://127.0.0.1:{port}", "--secret-file", str(secret),
                 "-o", str(tmp_path / "y.mp4")]) == 2
    assert "no engine answers there" in capsys.readouterr().err
    assert time.monotonic() - started < 30  # refused at once, not after a start-up timeout
    assert main(["play", "--set", "prompt.text= ", "-o", str(tmp_path / "z.mp4")]) == 2


def test_an_empty_prompt_is_refused_before_any_engine_in_its_family_s_words(tmp_path, capsys, monkeypatch):
    """`loom play -c edit-tiny --prompt " "` started the engine, then asked for "a few words describing the
    style": the edit family takes an instruction. Refused before the player runs, in the family's words; so is
    `--set prompt.text=" "`, which was said as "None is not allowed; expected a string"."""
    import loom_live.plugin.player as player

    monkeypatch.setattr(player, "run_player", lambda *a, **k: pytest.fail("the player ran"))
    for config, takes in (("edit-tiny", "an instruction, such as 'make it a watercolor painting'"),
                          ("tiny-random", "a few words describing the style")):
        assert main(["play", "-c", config, "--prompt", " ", "-o", str(tmp_path / "x.mp4")]) == 2
        assert f"loom play: error: the prompt is empty; give {takes}" in capsys.readouterr().err
        for blank in (" ", ""):
            assert main(["play", "-c", config, "--set", f"prompt.text={blank}", "-o", str(tmp_path / "x.mp4")]) == 2
            assert (f"loom play: error: preset {config} (with --set overrides): prompt.text: the prompt is empty; "
                    f"give {takes}\n") in capsys.readouterr().err


def test_an_empty_prompt_for_a_served_engine_is_refused_in_each_family_s_words(tmp_path, capsys, monkeypatch):
    """With --endpoint the engine runs its own config: -c edit-tiny does not say what its prompt is, and the words
    of the family it names would be a guess. Refused before the player runs, in what each family takes."""
    import loom_live.plugin.player as player
    from loom_live.engine.server.passthrough import PassthroughSession
    from tests.fakes.engines import InProcessEngine

    monkeypatch.setattr(player, "run_player", lambda *a, **k: pytest.fail("the player ran"))
    with InProcessEngine(PassthroughSession) as engine:
        assert main(["play", "-c", "edit-tiny", "--endpoint", engine.endpoint, "--secret-file", engine.secret_file,
                     "--prompt", " ", "-o", str(tmp_path / "x.mp4")]) == 2
    assert ("loom play: error: the prompt is empty; give a few words describing the style (the wan family) or an "
            "instruction, such as 'make it a watercolor painting' (the edit family)\n") in capsys.readouterr().err


def test_a_bad_page_address_is_named_as_the_user_gave_it(capsys):
    """`loom web` takes its address as an argument, `loom play` as --web: each error names the one typed."""
    assert main(["web", "abc"]) == 2
    err = capsys.readouterr().err
    assert "loom web 'abc': expected PORT or HOST:PORT" in err and "--web" not in err
    assert main(["play", "--web", "abc", "-o", "window"]) == 2
    assert "--web 'abc': expected PORT or HOST:PORT" in capsys.readouterr().err


def test_encode_prompts_never_destroys_a_users_file(tmp_path, capsys):
    """Its --out is refused when it is the prompt list itself, a folder, not .safetensors, or an existing file
    without -y; the prompt list may come from Notepad (a byte-order mark) with # comments."""
    from safetensors import safe_open

    prompts = tmp_path / "show.txt"
    prompts.write_bytes("\ufeff# tonight's looks\nink wash\n\nneon city\n".encode())
    run = ["encode-prompts", "--encoder", "hash", "--dim", "8", "--from-file", str(prompts)]
    for out, words in ((prompts, "ends in .safetensors"), (tmp_path, "ends in .safetensors")):
        assert main([*run, "--out", str(out)]) == 2 and words in capsys.readouterr().err
    folder = tmp_path / "looks.safetensors"
    folder.mkdir()
    assert main([*run, "--out", str(folder)]) == 2 and "is a folder" in capsys.readouterr().err
    out = tmp_path / "show.safetensors"
    assert main([*run, "--out", str(out)]) == 0
    with safe_open(str(out), "pt") as f:
        assert sorted(json.loads(f.metadata()["prompts"]).values()) == ["ink wash", "neon city"]
    before = out.read_bytes()
    assert main(["encode-prompts", "--encoder", "hash", "--dim", "8", "other", "--out", str(out)]) == 2
    assert "exists; give --overwrite (-y)" in capsys.readouterr().err and out.read_bytes() == before
    assert main(["encode-prompts", "--encoder", "hash", "--dim", "8", "other", "--out", str(out), "-y"]) == 0
    assert out.read_bytes() != before and prompts.read_bytes().startswith(b"\xef\xbb\xbf# tonight")
    assert [p.name for p in tmp_path.iterdir() if "partial" in p.name] == []


def test_encode_prompts_refuses_an_embedding_width_below_one(tmp_path, capsys):
    """`--dim -5` ended in a torch traceback (exit 1), and `--dim 0` wrote a file of empty embeddings that every
    model refuses later; both are refused as an option, naming it and what is allowed."""
    out = tmp_path / "show.safetensors"
    for dim in ("0", "-5"):
        with pytest.raises(SystemExit) as exit_info:
            main(["encode-prompts", "--encoder", "hash", "--dim", dim, "ink wash", "--out", str(out)])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and f"argument --dim: expected a positive integer, got {dim}" in err, err
    assert list(tmp_path.iterdir()) == []


def test_encode_prompts_refuses_a_device_before_any_encoder_loads(tmp_path, monkeypatch, capsys):
    """A bad --device, or a GPU this machine lacks, ended in torch's traceback (exit 1) after umT5 had loaded;
    a folder given as --from-file was "not found"."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    run = ["encode-prompts", "--encoder", "hash", "--dim", "8", "ink wash", "--out", str(tmp_path / "p.safetensors")]
    for device, words in (("bogus", "--device 'bogus' is not allowed; expected auto, cpu, cuda or cuda:N"),
                          ("cuda:1", "--device: 'cuda:1' asked for CUDA but no CUDA GPU is available")):
        assert main([*run, "--device", device]) == 2
        assert words in capsys.readouterr().err
    assert main([*run, "--from-file", str(tmp_path)]) == 2
    assert f"--from-file: {tmp_path} is a folder" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    assert main([*run, "--device", "auto"]) == 0  # the CPU here


@pytest.mark.parametrize("option", ["--input-fps", "--memory-cap-gib"])
def test_bench_refuses_a_negative_rate_or_cap_instead_of_ignoring_it(option, capsys):
    for value in ("-5", "nan"):
        with pytest.raises(SystemExit) as exit_info:
            main(["bench", option, value])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and f"argument {option}: expected a number of 0 or more, got" in err, err


def test_an_endpoint_that_never_answers_is_given_up_within_the_connect_timeout(monkeypatch, tmp_path, capsys):
    """A host that drops packets (no refusal comes back) is waited for CONNECT_TIMEOUT_S, not a start-up
    timeout; the message says so and the run ends with exit code 2. So do an endpoint the player could
    never be let in by: no session secret for a local engine, no Curve keys for a remote one."""
    asked: list[float] = []

    def blackhole(address, timeout):
        asked.append(timeout)
        raise TimeoutError("timed out")

    from loom_live.host_bridge import reach

    monkeypatch.setattr(reach.socket, "create_connection", blackhole)
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    secret.chmod(0o600)
    with pytest.raises(UserError, match=r"tcp://127\.0\.0\.1:5555: no engine answers there \(timed out after at "
                                        r"most 3 s\)"):
        preflight.check_endpoint("tcp://127.0.0.1:5555", str(secret))
    assert asked == [preflight.CONNECT_TIMEOUT_S] and preflight.CONNECT_TIMEOUT_S <= 5
    local = ["play", "--passthrough", "--endpoint", "tcp://127.0.0.1:5555"]
    assert main([*local, "--secret-file", str(secret)]) == 2
    assert main(local) == 2 and "give --secret-file FILE" in capsys.readouterr().err
    secret.chmod(0o644)
    assert main([*local, "--secret-file", str(secret)]) == 2 and "chmod 600" in capsys.readouterr().err
    assert main(["play", "--passthrough", "--endpoint", "tcp://192.0.2.1:5555"]) == 2
    assert "not an address on this machine" in capsys.readouterr().err
    assert main(["play", "--passthrough", "--secret-file", str(secret)]) == 2
    assert "--secret-file is for --endpoint" in capsys.readouterr().err
    assert len(asked) == 2  # only the two runs that got as far as connecting


def test_cuda_ipc_is_refused_with_a_hint_where_it_cannot_work():
    try:
        check_transport("cuda-ipc")
    except Exception as exc:
        assert "shm" in str(exc)
    else:
        pytest.skip("CUDA IPC works on this machine")


@pytest.mark.parametrize("signame, code", [("SIGINT", 130), ("SIGHUP", 129)])
def test_serve_stops_on_ctrl_c_or_a_closed_terminal_like_play_and_leaves_no_socket_file(tmp_path, signame, code):
    sock = tmp_path / "loom.sock"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "loom_live.plugin.cli", "serve", "--bind", f"ipc://{sock}",
                             "--passthrough", "--secret-file", str(tmp_path / "secret")],
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if "listening" in line or not line:
                break
        assert sock.exists()
        proc.send_signal(getattr(signal, signame))
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code and not sock.exists()


def test_a_secret_file_that_cannot_be_made_is_named_in_one_line(tmp_path, capsys):
    """`--secret-file` (and `loom web --web-token-file`, which reads its file the same way) in a folder that is
    not there said only "[Errno 2] No such file or directory", and in one that is not writable ended in a
    PermissionError traceback: the file it could not make is named, and the run ends with exit code 2."""
    from loom_live.host_bridge.wire.channel import EndpointError, read_secret_file

    secret = tmp_path / "no-such-folder" / "secret"
    with pytest.raises(EndpointError, match=f"secret file {secret}: No such file or directory"):
        read_secret_file(str(secret), create=True)
    assert main(["serve", "--bind", f"ipc://{tmp_path / 'loom.sock'}", "--passthrough",
                 "--secret-file", str(secret)]) == 2
    err = capsys.readouterr().err
    assert f"loom serve: error: secret file {secret}: No such file or directory" in err, err


def test_serve_on_an_address_in_use_says_so_in_one_line(tmp_path, capsys):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert main(["serve", "--bind", f"tcp://127.0.0.1:{port}", "--passthrough",
                     "--secret-file", str(tmp_path / "secret")]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on tcp://127.0.0.1:{port}: Address already in use" in err and "Traceback" not in err
