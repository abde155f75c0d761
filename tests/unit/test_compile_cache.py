"""The persistent compile cache: a restarted engine finds what the last one compiled in one Loom folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_inductor_and_triton_caches_go_under_the_loom_cache_folder(tmp_path):
    code = ("import os\n"
            "from loom_live.engine.graphs.compile_cache import enable_persistent_compile_cache\n"
            "folder = enable_persistent_compile_cache()\n"
            "import torch._inductor.config as c\n"
            "from torch._inductor.runtime.cache_dir_utils import cache_dir\n"
            "assert c.fx_graph_cache and cache_dir() == str(folder), (cache_dir(), folder)\n"
            "print(folder, os.environ['TRITON_CACHE_DIR'])\n")
    out = _in_fresh_cache(code, tmp_path / "loom")
    assert out.split() == [str(tmp_path / "loom" / "inductor"), str(tmp_path / "loom" / "triton")]
    assert (tmp_path / "loom" / "inductor").is_dir()


def test_a_session_opened_in_process_compiles_into_the_same_folder_as_a_served_engine(tmp_path):
    """`loom bench` and `loom prepare` open their session in their own process: what they compile must land
    where the player's and the plugins' engine processes read (`loom prepare` is run to warm those)."""
    code = ("import os\n"
            "from loom_live.engine.config import load_config\n"
            "from loom_live.engine.session_api import open_session\n"
            "open_session(load_config('tiny-random'), warmup=False).close()\n"
            "print(os.environ['TORCHINDUCTOR_CACHE_DIR'])\n")
    assert _in_fresh_cache(code, tmp_path / "loom").split()[-1] == str(tmp_path / "loom" / "inductor")


def _in_fresh_cache(code: str, cache: Path) -> str:
    """`code`'s output, run in a process whose Loom cache folder is `cache` (no compile cache chosen)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**env, "PYTHONPATH": str(ROOT), "LOOM_CACHE_DIR": str(cache)})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


BYTECODE_SCRIPT = (
    "import json, sys\n"
    "from loom_live.engine.graphs.compile_cache import enable_bytecode_cache\n"
    "folder = enable_bytecode_cache()\n"
    "import torch.heavy\n"
    "print(json.dumps({'folder': folder and str(folder), 'prefix': sys.pycache_prefix,\n"
    "                  'writes': not sys.dont_write_bytecode, 'value': torch.heavy.VALUE}))\n")


def _fake_torch(root: Path) -> Path:
    """A `torch` package shadowing the real one, as installed without bytecode (and `loom_live` beside it)."""
    package = root / "site" / "torch"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "heavy.py").write_text("VALUE = sum(range(10))\n")
    return root / "site"


def _compile_beside(package: Path) -> None:
    """Bytecode beside the sources, as an installer writes it (in a clean process: this one may keep its own)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPYCACHEPREFIX", "PYTHONDONTWRITEBYTECODE")}
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(package)], check=True, timeout=60, env=env)
    assert (package / "__pycache__").is_dir()


def _bytecode_run(site: Path, cache: Path, **env: str) -> dict:
    import json

    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPYCACHEPREFIX", "LOOM_BYTECODE_CACHE")}
    env = {**base, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}", "LOOM_CACHE_DIR": str(cache),
           "PYTHONDONTWRITEBYTECODE": "1", **env}
    out = subprocess.run([sys.executable, "-c", BYTECODE_SCRIPT], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_torch_installed_without_bytecode_gets_it_kept_under_the_loom_cache_and_read_back(tmp_path):
    site, cache = _fake_torch(tmp_path), tmp_path / "loom"
    first = _bytecode_run(site, cache)
    folder = cache / "pycache"
    assert first == {"folder": str(folder), "prefix": str(folder), "writes": True, "value": 45}
    cached = list(folder.rglob("heavy*.pyc"))
    assert len(cached) == 1 and not (site / "torch" / "__pycache__").exists()  # never beside the sources
    written = cached[0].stat().st_mtime_ns
    assert _bytecode_run(site, cache)["value"] == 45 and cached[0].stat().st_mtime_ns == written  # read back


def test_bytecode_settings_are_left_alone_where_torch_has_its_own_or_the_user_chose(tmp_path):
    site, cache = _fake_torch(tmp_path), tmp_path / "loom"
    untouched = {"folder": None, "prefix": None, "writes": False, "value": 45}
    assert _bytecode_run(site, cache, LOOM_BYTECODE_CACHE="0") == untouched
    chosen = _bytecode_run(site, cache, PYTHONPYCACHEPREFIX=str(tmp_path / "mine"))
    assert chosen["folder"] is None and chosen["prefix"] == str(tmp_path / "mine")
    _compile_beside(site / "torch")  # bytecode installed with the package
    assert _bytecode_run(site, cache) == untouched and not (cache / "pycache").exists()


def test_bytecode_that_no_longer_matches_its_source_counts_as_none(tmp_path):
    """A package copied without its files' times carries bytecode Python recompiles in every process."""
    site, cache = _fake_torch(tmp_path), tmp_path / "loom"
    _compile_beside(site / "torch")
    init = site / "torch" / "__init__.py"
    os.utime(init, (init.stat().st_atime, init.stat().st_mtime + 100))
    assert _bytecode_run(site, cache)["folder"] == str(cache / "pycache")


def test_compiling_ahead_fills_the_bytecode_cache_in_use_and_skips_test_suites(tmp_path):
    """The background compile of a first start writes where this process's imports then read: the bytecode
    cache folder, never beside the sources; a package's test suite (never imported by an engine) is left out."""
    site = _fake_torch(tmp_path)
    (site / "torch" / "testing").mkdir()
    (site / "torch" / "testing" / "slow.py").write_text("X = 1\n")
    folder = tmp_path / "pycache"
    code = ("import sys\n"
            "from pathlib import Path\n"
            "from loom_live.engine.graphs.compile_cache import compile_ahead\n"
            f"compile_ahead([Path({str(site / 'torch')!r})], workers=1).join(120)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=150,
                         env={**env, "PYTHONPATH": str(ROOT), "PYTHONPYCACHEPREFIX": str(folder)})
    assert out.returncode == 0, out.stderr
    mirror = folder / str(site / "torch").lstrip(os.sep)  # the prefix mirrors the sources' absolute paths
    names = sorted(p.name.split(".")[0] for p in mirror.rglob("*.pyc"))
    assert names == ["__init__", "heavy"], names
    assert not (site / "torch" / "__pycache__").exists()


def test_a_first_start_compiles_ahead_on_the_spare_cores_and_a_later_one_does_not(tmp_path):
    import json

    site, cache = _fake_torch(tmp_path), tmp_path / "loom"
    (site / "torch" / "_inductor").mkdir()
    (site / "torch" / "_inductor" / "compile_fx.py").write_text("")  # what the check looks for
    code = ("import json, os\n"
            "os.cpu_count = lambda: 8\n"
            "from loom_live.engine.graphs import compile_cache as c\n"
            "started = []\n"
            "c.compile_ahead = lambda folders, workers: started.append((list(map(str, folders)), workers))\n"
            "c.enable_bytecode_cache()\n"
            "print(json.dumps(started))\n")
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPYCACHEPREFIX", "LOOM_BYTECODE_CACHE")}
    env = {**base, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}", "LOOM_CACHE_DIR": str(cache),
           "PYTHONDONTWRITEBYTECODE": "1"}

    def started() -> list:
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                             env=env)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    ((folders, workers),) = started()
    assert folders[0] == str(site / "torch") and workers == 7
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(site / "torch")], check=True, timeout=60,
                   env={**env, "PYTHONPYCACHEPREFIX": str(cache / "pycache")})  # what that compile wrote
    assert started() == []


def test_the_kernel_autotuning_choice_reaches_inductor_both_ways(monkeypatch):
    """`model.autotune_kernels` (off by default) keys the compile caches: whatever sets it must set both of
    Inductor's switches, the elementwise kernels' timing and the reductions' own pick."""
    import torch._inductor.config as inductor

    from loom_live.engine.config import load_config
    from loom_live.engine.graphs.compile_cache import set_kernel_autotuning

    monkeypatch.setattr(inductor.triton, "autotune_pointwise", inductor.triton.autotune_pointwise)
    monkeypatch.setattr(inductor.test_configs, "force_filter_reduction_configs",
                        inductor.test_configs.force_filter_reduction_configs)
    assert load_config("wan2.1-1.3b", []).model.autotune_kernels is False
    set_kernel_autotuning(False)
    assert (inductor.triton.autotune_pointwise, inductor.test_configs.force_filter_reduction_configs) == (False, True)
    set_kernel_autotuning(True)
    assert (inductor.triton.autotune_pointwise, inductor.test_configs.force_filter_reduction_configs) == (True, False)
