"""The ComfyUI node package as the Comfy registry ships it: the archive `comfy node pack` builds (the node
folder's git-tracked files minus .comfyignore, plus [tool.comfy] includes), unpacked into a clean
custom_nodes folder and loaded in a fresh Python that sees Loom only as its declared dependency."""

from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NODE_DIR = ROOT / "plugin" / "comfyui"
tomllib = pytest.importorskip("tomllib")

# A fresh interpreter has no Loom but what PYTHONPATH gives it: paths to a checkout or an editable
# install of one (this machine's development set-up) are dropped, and so are editable-install finders.
LOAD = textwrap.dedent("""
    import importlib.util, os, sys
    allowed = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    sys.meta_path = [f for f in sys.meta_path
                     if "editable" not in (f if isinstance(f, type) else type(f)).__module__.lower()]
    sys.path = [p for p in sys.path if p in allowed or not os.path.isdir(os.path.join(p or ".", "host_bridge"))]
    folder = {folder!r}
    spec = importlib.util.spec_from_file_location(folder.replace(".", "_x_"), folder + "/__init__.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    import host_bridge
    print("LOADED", sorted(module.NODE_CLASS_MAPPINGS), host_bridge.__file__)
""")


def pack(node_dir: Path, archive: Path) -> list[str]:
    """The registry archive, by comfy-cli's rules: `git ls-files` in the node folder, minus .comfyignore
    patterns (gitwildmatch; simple globs here), plus the [tool.comfy] includes."""
    tracked = subprocess.run(["git", "-C", str(node_dir), "ls-files"], capture_output=True, text=True,
                             check=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout: the registry archive is built from tracked files")
    ignore_file = node_dir / ".comfyignore"
    patterns = [ln.strip() for ln in ignore_file.read_text().splitlines()
                if ln.strip() and not ln.startswith("#")] if ignore_file.exists() else []
    includes = tomllib.loads((node_dir / "pyproject.toml").read_text())["tool"]["comfy"].get("includes", [])

    def ignored(name: str) -> bool:
        return any(fnmatch.fnmatch(name, p.rstrip("/")) or fnmatch.fnmatch(name, p.rstrip("/") + "/*")
                   or fnmatch.fnmatch(Path(name).name, p) for p in patterns)

    names = [n for n in tracked if not ignored(n) or any(n.startswith(i.strip("/")) for i in includes)]
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in names:
            zf.write(node_dir / name, name)
    return names


def _installed_loom(site: Path) -> None:
    """What `pip install loom-live` (the declared dependency) puts on the path: Loom's packages."""
    for package in ("engine", "host_bridge", "plugin"):
        shutil.copytree(ROOT / package, site / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def _load(tmp_path: Path, folder: Path, pythonpath: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    script = LOAD.format(folder=str(folder))
    return subprocess.run([sys.executable, "-s", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture
def unpacked(tmp_path: Path) -> Path:
    archive = tmp_path / "node.zip"
    names = pack(NODE_DIR, archive)
    assert {"__init__.py", "nodes.py", "pixels.py", "pyproject.toml", "requirements.txt"} <= set(names)
    assert "check_publish.py" not in names  # the publisher's tool, not part of the nodes
    folder = tmp_path / "ComfyUI" / "custom_nodes" / "loom-live-nodes"
    with zipfile.ZipFile(archive) as zf:
        zf.extractall(folder)
    return folder


def test_the_registry_archive_loads_with_loom_as_its_declared_dependency(tmp_path, unpacked):
    meta = tomllib.loads((unpacked / "pyproject.toml").read_text())
    assert any(d.startswith("loom-live") for d in meta["project"]["dependencies"])
    assert (unpacked / "requirements.txt").read_text().startswith("loom-live")
    site = tmp_path / "site"
    _installed_loom(site)
    out = _load(tmp_path, unpacked, str(site))
    assert out.returncode == 0, out.stderr
    assert "LOADED ['LoomEngine', 'LoomLora', 'LoomPrompt', 'LoomStream']" in out.stdout
    assert str(site) in out.stdout, "Loom must come from the installed dependency, not this checkout"


def test_without_loom_the_archive_says_what_to_install(tmp_path, unpacked):
    out = _load(tmp_path, unpacked, "")
    assert out.returncode != 0
    assert "pip install loom-live" in out.stderr
    assert "No module named 'plugin'" not in out.stderr.splitlines()[-1]


def test_registry_metadata_is_complete():
    meta = tomllib.loads((NODE_DIR / "pyproject.toml").read_text())
    comfy = meta["tool"]["comfy"]
    assert {"PublisherId", "DisplayName", "Icon", "includes"} <= set(comfy) and comfy["PublisherId"]
    assert {"name", "description", "version", "license", "dependencies"} <= set(meta["project"])
    assert meta["project"]["urls"]["Repository"].startswith("https://")


def _check_publish(pyproject: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(NODE_DIR / "check_publish.py"), str(pyproject)], capture_output=True,
                          text=True, timeout=60)


def test_the_shipped_placeholders_cannot_be_published_until_filled_in(tmp_path):
    """The repository URL is unknown to a checkout: the publish steps run check_publish.py first, which
    refuses the shipped file, naming each field to fill in, and passes once they are filled in."""
    shipped = (NODE_DIR / "pyproject.toml").read_text()
    out = _check_publish(NODE_DIR / "pyproject.toml")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    for field in ("[project.urls] Repository", "[project.urls] Documentation", "[project.urls] Bug Tracker",
                  "[tool.comfy] Icon"):
        assert field in out.stderr, field
    assert "is a placeholder; replace OWNER" in out.stderr
    filled = tmp_path / "pyproject.toml"
    filled.write_text(shipped.replace("OWNER", "someone").replace('Icon = ""',
                                                                   'Icon = "https://example.org/loom.png"'))
    out = _check_publish(filled)
    assert out.returncode == 0, out.stderr
    filled.write_text(shipped.replace("OWNER", "someone"))  # the URLs alone are not enough
    out = _check_publish(filled)
    assert out.returncode == 1 and "[tool.comfy] Icon: empty" in out.stderr and "Repository" not in out.stderr
