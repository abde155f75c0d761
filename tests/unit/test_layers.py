"""The layering of the packages, read from the source: host_bridge/wire <- host_bridge <- plugin, and
host_bridge/wire <- engine (imported as loom_live.host_bridge, loom_live.engine, loom_live.plugin). A host
(TouchDesigner, ComfyUI, the player) imports host_bridge without paying for torch, and the engine process never
depends on a host.

Every import statement counts, at module level or inside a function (a lazy import still ties the
two modules together), except those under `if TYPE_CHECKING:`, which never run.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("host_bridge", "engine", "plugin")  # folders of the checkout, each a subpackage of NAMESPACE
NAMESPACE = "loom_live"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([NAMESPACE, *parts])


@cache
def _modules() -> dict[str, Path]:
    """Every Python module of Loom's packages: dotted name -> file."""
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """All import statements, wherever they are, skipping the bodies of `if TYPE_CHECKING:`."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))
    return found


@cache
def _imports(module: str) -> frozenset[str]:
    """The dotted names `module` imports: a Loom module where the name is one (`from pkg import sub`
    gives pkg.sub when that is a module, else pkg), and third-party names as written."""
    path = _modules()[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
            continue
        if node.level:
            base_parts = package.split(".")
            base_parts = base_parts[:len(base_parts) - (node.level - 1)]
            base = ".".join(base_parts + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        names.add(base)
        for alias in node.names:
            if f"{base}.{alias.name}" in _modules():
                names.add(f"{base}.{alias.name}")
    names.discard(module)
    return frozenset(names)


def _top(name: str) -> str:
    return name.split(".")[0]


def _inside(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _violations(where: str, forbidden) -> list[str]:
    return sorted(f"{m} imports {name}" for m in _modules() if _inside(m, where)
                  for name in _imports(m) if forbidden(name))


def test_the_source_tree_is_found():
    mods = _modules()
    for expected in ("host_bridge.client", "host_bridge.wire.protocol", "engine.server.core", "plugin.cli.main"):
        assert f"{NAMESPACE}.{expected}" in mods
    assert "loom_live.host_bridge.wire.protocol" in _imports("loom_live.host_bridge.client")


def test_loom_is_imported_only_through_its_namespace():
    """The folders' own names are generic (other distributions install `engine` or `plugin`): an
    import of one would pick up whatever else a shared Python holds."""
    assert _violations(NAMESPACE, lambda n: _top(n) in PACKAGES) == []


def test_host_bridge_imports_neither_torch_nor_engine_nor_plugin():
    forbidden = lambda n: _top(n) == "torch" or _inside(n, "loom_live.engine") or _inside(n, "loom_live.plugin")  # noqa: E731
    assert _violations("loom_live.host_bridge", forbidden) == []


def test_the_wire_layer_imports_nothing_of_host_bridge_outside_wire():
    outside = lambda n: _inside(n, "loom_live.host_bridge") and not _inside(n, "loom_live.host_bridge.wire")  # noqa: E731
    assert _violations("loom_live.host_bridge.wire", outside) == []


def test_engine_imports_no_plugin():
    assert _violations("loom_live.engine", lambda n: _inside(n, "loom_live.plugin")) == []


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), over Loom's own modules."""
    graph = {m: sorted(n for n in _imports(m) if n in _modules()) for m in _modules()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph)))
    try:
        for v in graph:
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(components)


def test_no_import_cycles_between_modules():
    assert _cycles() == []


def test_importing_the_host_client_leaves_torch_out():
    code = "import sys, loom_live.host_bridge, loom_live.host_bridge.client; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_the_loom_command_builds_its_parsers_without_torch():
    """Every `loom` call builds all subcommands' parsers: a player or a pass-through engine that imported
    torch there would pay seconds of start-up for nothing."""
    code = ("import sys; from loom_live.plugin.cli.main import build_parser; build_parser(); "
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
