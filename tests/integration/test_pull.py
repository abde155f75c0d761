"""`loom pull` against a local HTTP server shaped like the Hugging Face hub (never the network):
downloads, resumes, verifies checksums, works offline from the cache, and the preset then finds the files."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

pytest.importorskip("huggingface_hub")

from loom_live.engine.config import load_config  # noqa: E402
from loom_live.plugin.cli.main import main  # noqa: E402
from tests.fakes.disk import fill_the_disk  # noqa: E402

COMMIT = "a" * 40
BIG = b"loom-weights-" * 40_000  # ~520 kB: large enough to cut a download in the middle


def _repos(bad_checksum: bool) -> dict[str, dict[str, bytes]]:
    return {
        "jerryfeng/StreamDiffusionV2": {"wan_causal_dmd_v2v/model.pt": BIG, "README.md": b"card"},
        "Wan-AI/Wan2.1-T2V-1.3B": {"Wan2.1_VAE.pth": b"vae" * 1000},
        "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": {"tokenizer/tokenizer_config.json": b"{}",
                                             "text_encoder/config.json": b'{"d_model": 4096}',
                                             "tokenizer/spiece.model": b"vocabulary",
                                             "vae/config.json": b"{}"},
        # the edit family: DreamLite-mobile's `diffusers` revision (any revision resolves here)
        "carlofkl/DreamLite-mobile": {"unet/config.json": b"{}", "unet/diffusion_pytorch_model.safetensors": b"u",
                                      "vae/config.json": b"{}", "scheduler/scheduler_config.json": b"{}",
                                      "dreamlite/original.pt": b"not the diffusers layout"},
        "Qwen/Qwen3-VL-2B-Instruct": {"config.json": b"{}", "tokenizer.json": b"{}"},
        "otnl/dreamlite-stream-temporal-lllite-v3": {"temporal_lllite_step001440.safetensors": b"adapter"},
    }, bad_checksum


class FakeHub:
    """Just the endpoints huggingface_hub uses here: HEAD/GET .../resolve/REV/PATH (with Range) and the tree API."""

    def __init__(self, bad_checksum: bool = False, cut_first_download: bool = False) -> None:
        self.repos, self.bad_checksum = _repos(bad_checksum)
        self.cut_first = cut_first_download
        self.ranges: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _file(self) -> tuple[str, str, bytes] | None:
                path = self.path.split("?")[0].lstrip("/")
                for repo, files in hub.repos.items():
                    prefix = f"{repo}/resolve/"
                    if path.startswith(prefix):
                        name = path[len(prefix):].split("/", 1)[1]
                        return (repo, name, files[name]) if name in files else None
                return None

            def _headers(self, name: str, data: bytes, length: int, status: int = 200) -> None:
                self.send_response(status)
                self.send_header("X-Repo-Commit", COMMIT)
                if name.endswith((".pt", ".pth")):
                    sha = hashlib.sha256(data).hexdigest()
                    if hub.bad_checksum:
                        sha = "0" * 64
                    self.send_header("X-Linked-Etag", f'"{sha}"')
                    self.send_header("X-Linked-Size", str(len(data)))
                else:
                    git_sha = hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()
                    self.send_header("ETag", f'"{git_sha}"')
                self.send_header("Content-Length", str(length))
                self.end_headers()

            def do_HEAD(self) -> None:  # noqa: N802
                found = self._file()
                if found is None:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.end_headers()
                    return
                self._headers(found[1], found[2], len(found[2]))

            def do_GET(self) -> None:  # noqa: N802
                path = self.path.split("?")[0]
                if path.startswith("/api/models/") and "/tree/" in path:
                    repo = path[len("/api/models/"):].split("/tree/")[0]
                    body = json.dumps([{"type": "file", "path": n, "size": len(d), "oid": "0" * 40}
                                       for n, d in hub.repos[repo].items()]).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                found = self._file()
                if found is None:
                    self.send_response(404)
                    self.end_headers()
                    return
                _, name, data = found
                start = 0
                if self.headers.get("Range"):
                    hub.ranges.append(self.headers["Range"])
                    start = int(self.headers["Range"].split("=")[1].split("-")[0])
                    self._headers(name, data, len(data) - start, 206)
                else:
                    self._headers(name, data, len(data))
                if hub.cut_first and name.endswith(".pt"):
                    hub.cut_first = False
                    self.wfile.write(data[: len(data) // 2])  # the connection drops mid-file
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(data[start:])

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hub_env(tmp_path, monkeypatch):
    def start(**kwargs: bool) -> FakeHub:
        hub = FakeHub(**kwargs)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        return hub
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    hubs: list[FakeHub] = []
    yield lambda **kw: hubs.append(start(**kw)) or hubs[-1]
    for hub in hubs:
        hub.close()


def test_pull_fetches_a_preset_which_then_finds_its_weights(hub_env, tmp_path, capsys):
    hub_env()
    assert load_config("wan2.1-1.3b").model.checkpoint is None
    assert main(["pull", "wan2.1-1.3b"]) == 0
    cfg = load_config("wan2.1-1.3b")
    assert Path(cfg.model.checkpoint).read_bytes() == BIG
    assert Path(cfg.vae.checkpoint).name == "Wan2.1_VAE.pth"
    assert (Path(cfg.prompt.path) / "text_encoder" / "config.json").is_file()
    assert not (Path(cfg.prompt.path) / "vae").exists()  # only what the preset needs
    # A path the user gives wins over the pulled copy.
    assert load_config("wan2.1-1.3b", ["model.checkpoint=/mine.pt"]).model.checkpoint == "/mine.pt"
    assert "checksum ok" in capsys.readouterr().err


def test_pull_resumes_a_cut_download(hub_env, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 1 << 16)  # what arrived before the cut is kept
    hub = hub_env(cut_first_download=True)
    code = main(["pull", "wan2.1-1.3b"])
    if code != 0:  # the library gave up on the cut connection: the next pull resumes the partial file
        code = main(["pull", "wan2.1-1.3b"])
    assert code == 0
    assert hub.ranges and not hub.ranges[0].startswith("bytes=0-"), "the retry should resume, not restart"
    assert Path(load_config("wan2.1-1.3b").model.checkpoint).read_bytes() == BIG


def test_pull_refuses_a_damaged_download(hub_env, capsys):
    hub_env(bad_checksum=True)
    assert main(["pull", "wan2.1-1.3b"]) == 2
    assert "checksum mismatch" in capsys.readouterr().err
    assert load_config("wan2.1-1.3b").model.checkpoint is None


def test_pull_offline_says_what_is_missing_and_then_uses_the_cache(hub_env, capsys):
    assert main(["pull", "wan2.1-1.3b", "--offline"]) == 2
    assert "offline" in capsys.readouterr().err
    hub_env()
    assert main(["pull", "wan2.1-1.3b"]) == 0
    assert main(["pull", "wan2.1-1.3b", "--offline"]) == 0


def test_pull_offline_names_every_missing_source_in_one_line_not_only_the_first(hub_env, monkeypatch, capsys):
    hub_env()
    assert main(["pull", "wan2.1-1.3b"]) == 0
    cached = load_config("wan2.1-1.3b")
    for blob in Path(cached.vae.checkpoint).resolve().parent.glob("*"):  # the VAE's snapshot: gone again
        blob.unlink()
    for snapshot in (Path(cached.prompt.path).resolve()).rglob("*"):
        if snapshot.is_file() or snapshot.is_symlink():
            snapshot.unlink()
    capsys.readouterr()
    assert main(["pull", "wan2.1-1.3b", "--offline"]) == 2
    out, err = capsys.readouterr()
    assert "model.checkpoint = " in out  # what is cached is said too
    line = err.strip().splitlines()[-1]
    assert "vae.checkpoint" in line and "prompt.path" in line and "model.checkpoint" not in line
    assert "Wan-AI/Wan2.1-T2V-1.3B-Diffusers" in line and "loom pull wan2.1-1.3b" in line


def test_pull_says_in_one_line_when_the_hub_cannot_be_reached_to_list_a_folder(hub_env, monkeypatch, capsys):
    """A source named by a folder pattern is listed first; the hub client's own connection errors there (not
    OSError, not the hub's HTTP errors) end in the same one line as a file download that cannot connect."""
    import huggingface_hub

    class ConnectError(Exception):  # what the hub client raises when nothing answers
        pass

    def unreachable(self, *args, **kwargs):
        raise ConnectError("[Errno 111] Connection refused")

    hub_env()
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", unreachable)
    assert main(["pull", "wan2.1-1.3b"]) == 2
    err = capsys.readouterr().err
    assert "Wan-AI/Wan2.1-T2V-1.3B-Diffusers: cannot reach the Hugging Face hub" in err and "Traceback" not in err


def test_pull_with_no_hub_to_reach_says_so_before_any_download_and_how_to_run_without(hub_env, monkeypatch, capsys,
                                                                                       caplog):
    """Nothing listening at the endpoint: the first download retried five times, about 24 s, before its line;
    now one request finds that out, and the line also says how to give the run local files instead."""
    from loom_live.plugin.cli import pull

    with socket.socket() as closed:  # a port nothing listens on once closed
        closed.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{closed.getsockname()[1]}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    downloads = []
    fetch = pull._download
    monkeypatch.setattr(pull, "_download", lambda *args: downloads.append(args) or fetch(*args))
    assert main(["pull", "wan2.1-1.3b"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"cannot reach the Hugging Face hub ({endpoint})" in line and "Traceback" not in line
    assert "jerryfeng/StreamDiffusionV2" in line and "Wan-AI/Wan2.1-T2V-1.3B-Diffusers" in line
    assert "--set model.checkpoint=PATH" in line and "--set prompt.path=PATH" in line
    assert downloads == [] and "Retrying" not in caplog.text


def test_a_pull_stopped_inside_a_folder_is_not_taken_for_it_until_pulled_again(hub_env, monkeypatch):
    """Ctrl-C after the tokenizer's config but before its vocabulary: the folder is there, the files in it
    fetched so far are whole, yet the run must say the encoder is missing rather than fail at load."""
    from loom_live.plugin.cli import pull

    fetch = pull._download

    def stopped(source, name, *args):
        if name == "tokenizer/spiece.model":
            raise KeyboardInterrupt
        return fetch(source, name, *args)

    hub_env()
    monkeypatch.setattr(pull, "_download", stopped)
    assert main(["pull", "wan2.1-1.3b"]) == 130
    assert load_config("wan2.1-1.3b").prompt.path is None
    assert main(["pull", "wan2.1-1.3b", "--offline"]) == 2
    monkeypatch.setattr(pull, "_download", fetch)
    assert main(["pull", "wan2.1-1.3b"]) == 0
    assert (Path(load_config("wan2.1-1.3b").prompt.path) / "tokenizer" / "spiece.model").read_bytes() == b"vocabulary"


def test_pull_of_an_embedded_preset_says_there_is_nothing_to_fetch(capsys):
    assert main(["pull", "default"]) == 2
    assert "embedded" in capsys.readouterr().err


def test_a_name_pull_does_not_know_lists_only_presets_with_weights_and_a_repository_id_is_answered(capsys):
    """`loom pull nosuch` listed every preset, `default` and `tiny-random` among them, which then "need no
    download"; `loom pull org/name` did the same, with no word that pull takes a preset name, not a repository."""
    from loom_live.engine.models.weights import PULLABLE_PRESETS

    listed = ", ".join(PULLABLE_PRESETS)
    assert main(["pull", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert f"loom pull: error: unknown preset 'nosuch'; presets with weights to pull: {listed} (or a YAML" in err
    assert "tiny-random" not in err and "default" not in err
    assert main(["pull", "wan2.1-13b"]) == 2
    assert "(did you mean 'wan2.1-1.3b'?)" in capsys.readouterr().err
    for repo in ("org/not-a-repo", "Wan-AI/Wan2.1-T2V-1.3B"):
        assert main(["pull", repo]) == 2
        err = capsys.readouterr().err
        assert (f"loom pull: error: {repo!r}: loom pull takes a preset name, not a repository id; presets with "
                f"weights to pull: {listed}") in err, err
        assert "download them yourself and give each with --set KEY=PATH (keys: model.checkpoint, " in err
        assert "tiny-random" not in err and "\n" not in err.strip()


def test_pull_of_the_dreamlite_edit_preset_says_non_commercial_and_the_preset_finds_it(hub_env, capsys):
    hub_env()
    assert load_config("dreamlite-edit").edit.checkpoint is None
    assert main(["pull", "dreamlite-edit"]) == 0
    assert "NON-COMMERCIAL" in capsys.readouterr().err
    cfg = load_config("dreamlite-edit")
    assert (Path(cfg.edit.checkpoint) / "unet" / "config.json").is_file()
    assert (Path(cfg.edit.checkpoint) / "scheduler" / "scheduler_config.json").is_file()
    assert not (Path(cfg.edit.checkpoint) / "dreamlite").exists()  # only the diffusers layout's folders
    assert (Path(cfg.edit.encoder_path) / "tokenizer.json").is_file()
    assert Path(cfg.edit.lllite).read_bytes() == b"adapter"


def test_pull_list_alone_lists_every_preset_and_a_pull_without_one_says_which_there_are(capsys):
    from loom_live.engine.models.weights import PULLABLE_PRESETS

    assert main(["pull", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(f"{preset}:\n" in out for preset in PULLABLE_PRESETS) and "Wan-AI/Wan2.1-VACE-14B" in out
    assert main(["pull"]) == 2
    err = capsys.readouterr().err
    assert "which preset?" in err and "dreamlite-edit" in err and "\n" not in err.strip()


def test_a_listing_whose_reader_went_away_ends_quietly_as_a_shell_expects(tmp_path, monkeypatch, capsys):
    """`loom pull --list | head -1`: the rest of the listing meets a closed pipe; exit 141, no traceback."""
    import io
    import sys

    class ClosedPipe(io.TextIOBase):
        def __init__(self) -> None:
            self.file = open(tmp_path / "stdout", "w")

        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

        def fileno(self) -> int:
            return self.file.fileno()

    pipe = ClosedPipe()
    monkeypatch.setattr(sys, "stdout", pipe)
    try:
        assert main(["pull", "--list"]) == 141
    finally:
        pipe.file.close()
    assert "Traceback" not in capsys.readouterr().err


def test_offline_a_cache_that_cannot_be_read_is_said_as_it_is_not_as_missing(hub_env, monkeypatch, capsys):
    """Only sources the cache lacks are gathered into the offline line; another failure (a cache folder this
    user cannot read) is said in its own words."""
    from loom_live.plugin.cli import pull

    hub_env()
    assert main(["pull", "wan2.1-1.3b"]) == 0

    def unreadable(*args):
        raise PermissionError(13, "Permission denied", "/cache/blob")

    monkeypatch.setattr(pull, "_download", unreadable)
    capsys.readouterr()
    assert main(["pull", "wan2.1-1.3b", "--offline"]) == 2
    err = capsys.readouterr().err
    assert "Permission denied" in err and "lacks" not in err


def test_a_pull_list_the_disk_cannot_hold_leaves_the_earlier_list_whole(hub_env, tmp_path, monkeypatch, capsys):
    """The names a pull sets out to fetch are written over the last pull's list before the folder is fetched:
    a full disk there says so in one line and leaves that list as it was, with nothing half-written beside it."""
    hub_env()
    assert main(["pull", "wan2.1-1.3b"]) == 0
    lists = list((tmp_path / "cache").glob("models--*/loom-pulls/*.json"))
    assert len(lists) == 1
    listed = lists[0]
    listed.write_text('["tokenizer/tokenizer_config.json"]')  # an earlier pull's list, shorter than this one's
    fill_the_disk(monkeypatch)
    assert main(["pull", "wan2.1-1.3b"]) == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and str(listed) in err and "Traceback" not in err
    assert listed.read_text() == '["tokenizer/tokenizer_config.json"]' and os.listdir(listed.parent) == [listed.name]
