"""`loom_checkout`: whether Loom runs from a source checkout (whose root its commands may write into) or is
installed (whose package folder in site-packages they must not write into)."""

from __future__ import annotations

from pathlib import Path

from loom_live.host_bridge.wire.checkout import loom_checkout


def _package_folders(root: Path) -> Path:
    for name in ("engine", "host_bridge", "plugin"):
        (root / name).mkdir(parents=True)
    (root / "engine" / "__main__.py").write_text("")
    return root / "host_bridge"


def test_a_checkout_is_the_folder_with_the_projects_pyproject_beside_the_packages(tmp_path):
    checkout = tmp_path / "loom"
    package = _package_folders(checkout)
    (checkout / "pyproject.toml").write_text("[project]\nname = 'loom-live'\n")
    assert loom_checkout(package) == checkout


def test_an_installed_package_is_no_checkout(tmp_path):
    """Installed, the packages sit in site-packages/loom_live, with engine/__main__.py but no pyproject.toml."""
    assert loom_checkout(_package_folders(tmp_path / "site-packages" / "loom_live")) is None


def test_this_test_run_is_a_checkout():
    assert loom_checkout() == Path(__file__).resolve().parents[2]
