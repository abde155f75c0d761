"""tools/check_release.py's steps, without building: what each one runs and in what environment."""

from __future__ import annotations

import pytest

from tools import check_release


def test_install_and_smoke_test_leave_out_a_pythonpath_naming_the_checkout(monkeypatch, tmp_path):
    """With PYTHONPATH at the checkout (whose build leaves loom_live.egg-info there), pip took the checkout for an
    installed loom-live and skipped the wheel; the smoke test then ended in a FileNotFoundError traceback for the
    environment's `loom`. Both steps now run without it, and a program that is not there fails its step."""
    monkeypatch.setenv("PYTHONPATH", str(check_release.ROOT))
    calls: list[tuple[str, dict[str, str] | None]] = []
    monkeypatch.setattr(check_release, "_run", lambda step, argv, **kw: calls.append((step, kw.get("env"))) or "")
    check_release.install(tmp_path / "bin" / "python", tmp_path / "loom_live.whl", offline=True)
    check_release.smoke_test(tmp_path / "bin" / "python", tmp_path)
    assert [step for step, _ in calls] == ["install", "loom --version", "smoke test"]
    assert all(env is not None and "PYTHONPATH" not in env for _, env in calls), calls
    monkeypatch.undo()
    with pytest.raises(check_release.ReleaseError, match=r"^loom --version failed: \[Errno 2\] No such file"):
        check_release._run("loom --version", [str(tmp_path / "bin" / "loom"), "--version"])
