"""Check Loom's release files before they go to PyPI: build, `twine check`, install into a fresh
environment, smoke test there.

The sdist is built from the checkout and the wheel from the unpacked sdist (as `python -m build` does),
so a file missing from the sdist fails here rather than on a user's machine. Both go through
`twine check --strict` (the metadata and README that PyPI renders). The wheel is then installed into a
new virtual environment and checked from there: the `loom` command runs, Loom's packages import from
that environment (not from this checkout), and a launched pass-through engine returns frames through
the bridge. With `--system-site-packages` the environment borrows this Python's packages (torch and the
other dependencies: no download; what the tests use); without it pip installs the dependencies from the
index, as on a user's clean machine.

    python tools/check_release.py [--out DIR] [--system-site-packages]

Exit code 0 when every step passed, 1 (naming the step) when one failed. Then: `twine upload DIR/*`.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD = "from setuptools import build_meta as b; import sys; print(getattr(b, sys.argv[1])(sys.argv[2]))"
# run in the new environment: where Loom comes from, and one round trip through a launched engine
SMOKE = """
import sys, numpy as np
from loom_live import engine, host_bridge, plugin
from loom_live.host_bridge import Bridge, BridgeConfig
for module in (engine, host_bridge, plugin):
    assert module.__file__.startswith(sys.prefix), f"{module.__name__} from {module.__file__}, not {sys.prefix}"
frames = [np.full((16, 24, 3), i * 40, np.uint8) for i in range(3)]
with Bridge(BridgeConfig(passthrough=True)).start() as bridge:
    outs = bridge.process(frames, timeout_s=120)
assert all(np.array_equal(a, b) for a, b in zip(outs, frames)) and len(outs) == 3, "frames changed"
print("smoke test passed:", host_bridge.__file__)
"""
log = logging.getLogger("check_release")


class ReleaseError(Exception):
    """A step failed; the message names it and what it printed."""


def _run(step: str, argv: list[str], **kwargs) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, **kwargs)
    except OSError as exc:  # a program the step needs is not there (the environment's `loom`)
        raise ReleaseError(f"{step} failed: {exc}") from None
    if done.returncode != 0:
        raise ReleaseError(f"{step} failed (exit code {done.returncode}):\n{done.stdout}{done.stderr}".rstrip())
    return done.stdout


def build(out: Path, root: Path = ROOT) -> tuple[Path, Path]:
    """The sdist from the checkout, then the wheel from the unpacked sdist; returns (sdist, wheel)."""
    out.mkdir(parents=True, exist_ok=True)
    sdist = out / _run("sdist", [sys.executable, "-c", BUILD, "build_sdist", str(out)], cwd=root).split()[-1]
    with tempfile.TemporaryDirectory() as unpacked:
        with tarfile.open(sdist) as tar:
            tar.extractall(unpacked, filter="data")
        (source,) = Path(unpacked).iterdir()
        wheel = out / _run("wheel from the sdist", [sys.executable, "-c", BUILD, "build_wheel", str(out)],
                           cwd=source).split()[-1]
    return sdist, wheel


def twine_check(files: list[Path]) -> str:
    out = _run("twine check", [sys.executable, "-m", "twine", "check", "--strict", *map(str, files)])
    return re.sub(r"\x1b\[[0-9;]*m", "", out)  # its colours


def fresh_environment(where: Path, system_site_packages: bool) -> Path:
    """A new virtual environment without pip of its own (this Python's pip installs into it); its python."""
    venv.EnvBuilder(system_site_packages=system_site_packages, with_pip=False, clear=True).create(where)
    return where / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def install(python: Path, wheel: Path, offline: bool) -> None:
    """The wheel into the environment of `python`; `offline`: dependencies must already be there."""
    _run("install", [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
                     "--no-warn-script-location", *(["--no-index"] if offline else []), str(wheel)],
         env=_outside_checkout())


def _outside_checkout() -> dict[str, str]:
    """This environment without PYTHONPATH: one naming the checkout (whose build leaves loom_live.egg-info
    there) made pip take the checkout for an installed loom-live and skip the wheel, and the smoke test
    import Loom from the checkout."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def smoke_test(python: Path, cwd: Path) -> str:
    """The `loom` command and a round trip through a launched engine, in the environment of `python`."""
    loom = python.parent / ("loom.exe" if os.name == "nt" else "loom")
    env = _outside_checkout()
    version = _run("loom --version", [str(loom), "--version"], cwd=cwd, env=env)
    return version + _run("smoke test", [str(python), "-c", SMOKE], cwd=cwd, env=env, timeout=300)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "dist", help="where the sdist and wheel go (dist)")
    parser.add_argument("--system-site-packages", action="store_true",
                        help="the test environment borrows this Python's packages (no download)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="check_release: %(message)s")
    try:
        sdist, wheel = build(args.out)
        log.info("built %s and %s", sdist.name, wheel.name)
        log.info(twine_check([sdist, wheel]).strip().replace("\n", "; "))
        with tempfile.TemporaryDirectory() as tmp:
            python = fresh_environment(Path(tmp) / "venv", args.system_site_packages)
            install(python, wheel, offline=args.system_site_packages)
            log.info(smoke_test(python, Path(tmp)).strip().replace("\n", "; "))
    except (ReleaseError, subprocess.TimeoutExpired) as exc:
        log.error("%s", exc)
        return 1
    log.info("ready to upload: twine upload %s %s", sdist, wheel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
