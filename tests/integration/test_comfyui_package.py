"""The ComfyUI node package as users install it, each in a fresh Python: the archive `comfy node pack` builds
(the node folder's git-tracked files minus .comfyignore, plus [tool.comfy] includes) with Loom's wheel
installed into a new environment as its declared dependency, and the node folder linked from a checkout
into custom_nodes, run by an engine Python that has torch but not Loom. Both run the example workflow's
node calls in ComfyUI's order."""

from __future__ import annotations

import fnmatch
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from tests.fakes.engines import lacking, python_without_loom
from tools import check_release

ROOT = Path(__file__).resolve().parents[2]
NODE_DIR = ROOT / "plugin" / "comfyui"
tomllib = pytest.importorskip("tomllib")

# A fresh interpreter has no Loom but what PYTHONPATH or its own environment (a venv's site-packages) gives
# it: paths to a checkout or an editable install of one (this machine's development set-up) are dropped,
# and so are editable-install finders.
LOAD = textwrap.dedent("""
    import importlib.util, os, sys
    allowed = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    sys.meta_path = [f for f in sys.meta_path
                     if "editable" not in (f if isinstance(f, type) else type(f)).__module__.lower()]
    sys.path = [p for p in sys.path if p in allowed or p.startswith(sys.prefix + os.sep)
                or not os.path.isdir(os.path.join(p or ".", "host_bridge"))]
    folder = {folder!r}
    spec = importlib.util.spec_from_file_location(folder.replace(".", "_x_"), folder + "/__init__.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    from loom_live import host_bridge
    print("LOADED", sorted(module.NODE_CLASS_MAPPINGS), host_bridge.__file__)
""")
# then: the example workflow's node calls in ComfyUI's order (tests/fakes/comfyui.py, loaded by its path),
# the core nodes standing in, the Loom nodes real, with a pass-through engine
RUN = textwrap.dedent("""
    import json, torch
    spec = importlib.util.spec_from_file_location("comfy_fake", {fake!r})
    fake = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake)
    prompt = fake.api_prompt(json.loads(open({workflow!r}).read()))
    engine = next(node for node in prompt.values() if node["class_type"] == "LoomEngine")
    engine["inputs"].update(passthrough=True, engine_python={engine_python!r})
    frames, saved = fake.image_batch(5, 16, 24), []
    runner = fake.WorkflowRunner(module, {{
        "LoadVideo": lambda file: (file,),
        "GetVideoComponents": lambda video: (frames, None, 24.0),
        "CreateVideo": lambda images, fps, audio=None: (images,),
        "SaveVideo": lambda video, **_: saved.append(video) or (),
    }})
    try:
        runner.queue(prompt)
    finally:
        module.nodes.ENGINES.close_all()
    assert torch.equal(saved[0], frames), "the frames changed"
    print("RAN", " ".join(prompt[i]["class_type"] for i in runner.ran))
""")
WORKFLOW = NODE_DIR / "example_workflows" / "loom_video_restyle.json"
RAN = "RAN LoadVideo GetVideoComponents LoomEngine LoomPrompt LoomStream CreateVideo SaveVideo"


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


def _load(tmp_path: Path, folder: Path, pythonpath: str = "", *, python: str = sys.executable,
          engine_python: str | None = None, before: str = "") -> subprocess.CompletedProcess:
    """Load the node folder as ComfyUI does in a fresh `python`; with `engine_python`, run the example workflow."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    script = LOAD.format(folder=str(folder)).replace("folder = ", f"{before}\nfolder = ", 1)
    if engine_python is not None:
        fake = str(ROOT / "tests" / "fakes" / "comfyui.py")
        script += RUN.format(fake=fake, workflow=str(WORKFLOW), engine_python=engine_python)
    return subprocess.run([python, "-s", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture
def unpacked(tmp_path: Path) -> Path:
    archive = tmp_path / "node.zip"
    names = pack(NODE_DIR, archive)
    assert {"__init__.py", "nodes.py", "pixels.py", "pyproject.toml", "requirements.txt", "README.md", "LICENSE",
            "example_workflows/loom_video_restyle.json", "example_workflows/loom_lora_restyle.json"} <= set(names)
    assert "check_publish.py" not in names  # the publisher's tool, not part of the nodes
    folder = tmp_path / "ComfyUI" / "custom_nodes" / "loom-live-nodes"
    with zipfile.ZipFile(archive) as zf:
        zf.extractall(folder)
    return folder


def test_the_registry_archive_runs_its_example_workflow_with_loom_s_wheel_in_a_fresh_environment(tmp_path, unpacked):
    """The release as a registry install gets it: Loom's sdist and wheel built (the wheel from the sdist) and
    `twine check`ed, the wheel installed into a new environment (borrowing this Python's torch and other
    dependencies: no download), the archive's nodes loaded there and the example workflow run, its engine
    launched from the wheel."""
    pytest.importorskip("twine", reason="twine checks the release files (the test extra has it)")
    meta = tomllib.loads((unpacked / "pyproject.toml").read_text())
    assert any(d.startswith("loom-live") for d in meta["project"]["dependencies"])
    assert (unpacked / "requirements.txt").read_text().startswith("loom-live")
    assert (unpacked / "LICENSE").read_text() == (ROOT / "LICENSE").read_text()
    assert {p.name for p in (unpacked / "example_workflows").iterdir()} >= {"loom_video_restyle.json",
                                                                            "loom_lora_restyle.json"}
    sdist, wheel = check_release.build(tmp_path / "dist")
    assert "PASSED" in check_release.twine_check([sdist, wheel])
    _assert_one_namespace(wheel)
    python = check_release.fresh_environment(tmp_path / "venv", system_site_packages=True)
    check_release.install(python, wheel, offline=True)
    out = _load(tmp_path, unpacked, python=str(python), engine_python="")
    assert out.returncode == 0, out.stderr
    nodes = "LOADED ['LoomControl', 'LoomEngine', 'LoomLora', 'LoomPrompt', 'LoomStream']"
    assert nodes in out.stdout and RAN in out.stdout
    assert f"{tmp_path / 'venv'}" in out.stdout, "Loom must come from the installed wheel, not this checkout"


def _assert_one_namespace(wheel: Path) -> None:
    """A shared Python gets one import name from Loom (no top-level `engine` or `plugin` to clash with
    another distribution's), holding every module of the checkout's folders."""
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"loom_live"}, sorted(tops)
    assert len(tops) == 2, sorted(tops)
    modules = {f"loom_live/{p.relative_to(ROOT).as_posix()}" for folder in ("engine", "host_bridge", "plugin")
               for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts}
    assert modules - set(names) == set(), "modules missing from the wheel (pyproject.toml's package list)"
    assert "loom_live/engine/presets/default.yaml" in names and "loom_live/plugin/web/static/index.html" in names
    assert any(n.startswith("loom_live/engine/models/weights/") for n in names)


def test_a_folder_linked_from_the_checkout_runs_its_example_workflow_in_a_fresh_python(tmp_path):
    """The README's first install path: the node folder linked into custom_nodes, in a Python that has no
    Loom, with an engine Python that has torch but no Loom either: the nodes find the checkout through the
    link, and the engine they launch finds it on its PYTHONPATH."""
    folder = tmp_path / "ComfyUI" / "custom_nodes" / "loom"
    folder.parent.mkdir(parents=True)
    folder.symlink_to(NODE_DIR, target_is_directory=True)
    engine_python = python_without_loom(tmp_path, honour_pythonpath=True)
    out = _load(tmp_path, folder, engine_python=str(engine_python))
    assert out.returncode == 0, out.stderr
    assert f"{ROOT / 'host_bridge'}" in out.stdout and RAN in out.stdout


def test_a_linked_folder_in_a_python_without_pyzmq_names_the_missing_dependency(tmp_path):
    folder = tmp_path / "ComfyUI" / "custom_nodes" / "loom"
    folder.parent.mkdir(parents=True)
    folder.symlink_to(NODE_DIR, target_is_directory=True)
    out = _load(tmp_path, folder, before=lacking("zmq"))  # ComfyUI's Python without pyzmq
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert f"found Loom's checkout at {ROOT}, but ComfyUI's Python lacks 'pyzmq'" in last, last
    assert "-m pip install pyzmq" in last and "link this folder" not in last


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
