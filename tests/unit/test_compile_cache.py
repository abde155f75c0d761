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
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**env, "PYTHONPATH": str(ROOT), "LOOM_CACHE_DIR": str(tmp_path / "loom")})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(tmp_path / "loom" / "inductor"), str(tmp_path / "loom" / "triton")]
    assert (tmp_path / "loom" / "inductor").is_dir()
