"""Which NVIDIA MPS daemon a CUDA process started here would join (`loom info` says it)."""

from __future__ import annotations

import os

from loom_live.host_bridge import mps


def test_a_pipe_folder_counts_only_while_its_control_pipe_is_there(tmp_path):
    env = {mps.PIPE_ENV: str(tmp_path)}
    assert mps.daemon_pipe(env) is None  # the folder alone: the daemon quit (or never ran)
    os.mkfifo(tmp_path / mps.CONTROL_PIPE)
    assert mps.daemon_pipe(env) == tmp_path


def test_without_the_variable_the_system_default_folder_is_asked(tmp_path, monkeypatch):
    monkeypatch.setattr(mps, "DEFAULT_PIPE", tmp_path)
    assert mps.daemon_pipe({}) is None
    (tmp_path / mps.CONTROL_PIPE).touch()
    assert mps.daemon_pipe({}) == tmp_path
    assert mps.daemon_pipe({mps.PIPE_ENV: ""}) == tmp_path  # an empty setting is no setting
