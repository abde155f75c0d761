"""`write_replacing`: a file written whole or not at all, the one helper every writer of a kept file uses;
`replacing_together`: a run's set of files, the same way."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from loom_live.host_bridge.wire.files import _host, replacing_together, write_replacing
from tests.fakes.disk import fill_the_disk


def test_a_whole_write_replaces_the_file_and_leaves_nothing_beside_it(tmp_path):
    out = tmp_path / "result.json"
    out.write_bytes(b"earlier")
    write_replacing(out, lambda f: f.write(b"new"))
    assert out.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["result.json"]


def test_a_full_disk_leaves_the_earlier_file_and_says_which_file(tmp_path, monkeypatch):
    out = tmp_path / "result.json"
    out.write_bytes(b"earlier")
    fill_the_disk(monkeypatch)
    with pytest.raises(OSError) as err:
        write_replacing(out, lambda f: f.write(b"a longer new text"))
    assert err.value.filename == str(out) and "No space left" in str(err.value)
    assert out.read_bytes() == b"earlier" and [p.name for p in tmp_path.iterdir()] == ["result.json"]


def test_a_write_stopped_midway_leaves_no_file_where_there_was_none(tmp_path):
    def half_then_stop(f):
        f.write(b"half")
        raise KeyboardInterrupt  # Ctrl-C

    with pytest.raises(KeyboardInterrupt):
        write_replacing(tmp_path / "new.bin", half_then_stop)
    assert list(tmp_path.iterdir()) == []


def test_an_error_that_names_its_own_file_keeps_that_name(tmp_path):
    def read_elsewhere(f):
        raise PermissionError(13, "Permission denied", "/srv/source.bin")

    with pytest.raises(PermissionError) as err:
        write_replacing(tmp_path / "new.bin", read_elsewhere)
    assert err.value.filename == "/srv/source.bin" and list(tmp_path.iterdir()) == []


def test_files_written_together_replace_their_namesakes_only_when_the_run_ends_whole(tmp_path):
    (tmp_path / "plot.png").write_bytes(b"earlier plot")
    (tmp_path / "report.json").write_bytes(b"earlier report")
    with pytest.raises(KeyboardInterrupt), replacing_together(tmp_path, last="report.json") as staging:
        (staging / "plot.png").write_bytes(b"new plot")
        raise KeyboardInterrupt  # Ctrl-C before the report
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == {"plot.png": b"earlier plot",
                                                                     "report.json": b"earlier report"}
    with replacing_together(tmp_path / "new", last="report.json") as staging:
        (staging / "plot.png").write_bytes(b"new plot")
    assert {p.name: p.read_bytes() for p in (tmp_path / "new").iterdir()} == {"plot.png": b"new plot"}


def test_a_killed_runs_hidden_folder_is_removed_by_the_next_run_and_others_are_kept(tmp_path, caplog):
    """A run killed outright leaves its hidden folder; the next run on the same machine removes it by its dead pid,
    and keeps a live run's (it may be writing now), another machine's (a shared folder: its pids mean nothing
    here) and a name it did not make."""
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    host = _host()
    dead = tmp_path / f".loom-{host}-{ended.pid}-abc123_x.partial"
    live = tmp_path / f".loom-{host}-{os.getpid()}-def456_y.partial"
    elsewhere = tmp_path / f".loom-other-{host}-{ended.pid}-jkl012.partial"
    foreign = tmp_path / ".loom-notapid-ghi789.partial"
    for leftover in (dead, live, elsewhere, foreign):
        leftover.mkdir()
        (leftover / "plot.png").write_bytes(b"half a plot")
    with caplog.at_level(logging.INFO, logger="loom_live.host_bridge.wire.files"), \
            replacing_together(tmp_path, last="report.json") as staging:
        assert staging.name.startswith(f".loom-{host}-{os.getpid()}-") and staging.name.endswith(".partial")
        (staging / "report.json").write_bytes(b"new report")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, elsewhere.name, foreign.name,
                                                                "report.json"])
    assert (live / "plot.png").read_bytes() == b"half a plot"
    assert str(dead) in caplog.text and live.name not in caplog.text


@pytest.mark.parametrize("pid", ["0", "99999999999999999999"])
def test_a_hidden_folder_named_with_no_possible_pid_is_left_and_the_run_goes_on(tmp_path, pid):
    """A hand-made `.loom-0-x.partial` made `os.kill` signal the process group, and a huge number overflowed it:
    the pid check says no process has it. The 20-digit name does not parse as a pid at all (kept, as any name
    that is not a run's); the 0 one is taken as a dead run's and removed."""
    odd = tmp_path / f".loom-{_host()}-{pid}-abc.partial"
    odd.mkdir()
    with replacing_together(tmp_path, last="report.json") as staging:
        (staging / "report.json").write_text("{}")
    assert (tmp_path / "report.json").read_text() == "{}"
    assert odd.exists() == (len(pid) > 9)
