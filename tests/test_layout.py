"""The package's layout holds: who imports Megatron, which rooms stay pure, no import cycles, the public surface.

Read from the source with ``ast`` (nothing is imported for the scan). An import counts wherever it stands:
at module level or inside a function (Megatron is imported lazily, inside functions, all over ``glue/`` and
``pretrain_gpt``, so a module-level-only scan would miss most of it). ``from megatron_dilocox.x import y``
is an edge to ``x.y`` when ``y`` is a submodule, else to ``x``; importing a submodule is not counted as an
edge to its parent packages (Python initialises those first, whatever the submodule imports).

Cycles are checked on two graphs: module-level imports (what runs when a module is imported: a cycle here
can fail at import time, depending on which module comes first) and all imports (function-level ones too:
a cycle there cannot fail at import time, but it still ties two rooms together). Both are empty today.
"""
import ast
import pathlib
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "megatron_dilocox"

# Every module that imports ``megatron`` (directly, at any level). Megatron is a dependency of the Megatron
# entry and its glue only; data/prepare.py uses megatron-core's IndexedDatasetBuilder to write the corpus'
# .bin/.idx files exactly as Megatron reads them.
IMPORTS_MEGATRON = {
    "megatron_dilocox.pretrain_gpt",
    "megatron_dilocox.data.prepare",
    "megatron_dilocox.glue.canonical", "megatron_dilocox.glue.run_clock",
    "megatron_dilocox.glue.checkpoint_fixes",
    "megatron_dilocox.glue.checkpoints",
    "megatron_dilocox.glue.cpu_backend",
    "megatron_dilocox.glue.explicit",
    "megatron_dilocox.glue.moe_fixes",
    "megatron_dilocox.glue.seam",
}
PURE_ROOMS = ("megatron_dilocox.outer", "megatron_dilocox.compression", "megatron_dilocox.net")
ENTRIES = ("coordinator", "launch", "main_job", "sim", "pretrain_gpt")


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


class _Imports(ast.NodeVisitor):
    """Every import statement of one source: ``(base, [imported names], at module level?)``, a relative
    ``from`` resolved against ``package``; ``base`` is the module named after ``import`` / ``from``."""

    def __init__(self, package: str):
        self.package = package
        self.found: list[tuple[str, list[str], bool]] = []
        self._depth = 0

    def _function(self, node):
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Import(self, node):
        self.found += [(alias.name, [], self._depth == 0) for alias in node.names]

    def visit_ImportFrom(self, node):
        base = node.module or ""
        if node.level:  # relative: resolve against this module's package
            anchor = self.package.split(".")
            anchor = anchor[:len(anchor) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        self.found.append((base, [alias.name for alias in node.names], self._depth == 0))


def import_statements(source: str, package: str) -> list[tuple[str, list[str], bool]]:
    visitor = _Imports(package)
    visitor.visit(ast.parse(source))
    return visitor.found


def imports_of(module: str) -> list[tuple[str, bool]]:
    """(imported module, at module level?): ``from x import y`` is ``x.y`` where that is a submodule, else ``x``."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for base, names, top in import_statements(path.read_text(), package):
        out += [(base, top)] if not names else [(f"{base}.{n}" if f"{base}.{n}" in MODULES else base, top)
                                                for n in names]
    return out


IMPORTS = {m: imports_of(m) for m in MODULES}


def graph(module_level_only: bool) -> dict[str, set[str]]:
    """Edges between megatron_dilocox modules."""
    return {m: {name for name, top in found if name in MODULES and name != m and (top or not module_level_only)}
            for m, found in IMPORTS.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
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
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def reachable(start: str, edges: dict[str, set[str]]) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in edges[todo.pop()] - seen:
            seen.add(w)
            todo.append(w)
    return seen


def in_room(module: str, room: str) -> bool:
    return module == room or module.startswith(room + ".")


def test_the_scan_sees_the_package():
    assert len(MODULES) > 40 and "megatron_dilocox.net.topology" in MODULES
    assert ("megatron_dilocox.net.membership", True) in IMPORTS["megatron_dilocox.net.topology"]
    assert ("megatron.core", False) in IMPORTS["megatron_dilocox.pretrain_gpt"]  # import mpu, in a def


def test_every_folder_is_a_package():
    """setup.py's ``find_packages`` ships only folders with an ``__init__.py``: a namespace folder would work
    from a checkout and be missing from a non-editable install (the Docker image)."""
    from setuptools import find_packages
    shipped = set(find_packages(str(ROOT), include=["megatron_dilocox", "megatron_dilocox.*"]))
    assert shipped == {module_name(p.parent / "__init__.py") for p in PKG.rglob("*.py")}


def test_exactly_these_modules_import_megatron():
    found = {m for m, imported in IMPORTS.items() if any(name.split(".")[0] == "megatron" for name, _ in imported)}
    assert found == IMPORTS_MEGATRON


def test_megatron_is_imported_inside_functions_only():
    """Importing any module stays cheap: torch_dist checkpoint saving re-imports the ``-m`` module
    (``pretrain_gpt``) in a helper process, and the CPU backend must patch torch before Megatron loads."""
    assert [(m, name) for m, imported in IMPORTS.items() for name, top in imported
            if top and name.split(".")[0] == "megatron"] == []


def test_outer_compression_net_reach_neither_megatron_nor_glue():
    """Not directly, and not through any module they import (at any level)."""
    edges = graph(module_level_only=False)
    for m in MODULES:
        if any(in_room(m, room) for room in PURE_ROOMS):
            reached = reachable(m, edges) | {m}
            assert not reached & IMPORTS_MEGATRON, (m, sorted(reached & IMPORTS_MEGATRON))
            assert not any(in_room(r, "megatron_dilocox.glue") for r in reached), m


def test_sim_is_pure_python():
    """The cost model runs where torch does not (its docstring says so): no torch, no megatron."""
    edges = graph(module_level_only=False)
    for m in MODULES:
        if in_room(m, "megatron_dilocox.sim"):
            for r in reachable(m, edges) | {m}:
                tops = {name.split(".")[0] for name, _ in IMPORTS[r]}
                assert not tops & {"torch", "megatron"}, (m, r)


@pytest.mark.parametrize("module_level_only", [True, False], ids=["module-level", "all-imports"])
def test_no_import_cycles(module_level_only):
    assert cycles(graph(module_level_only)) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def imported_test_modules(source: str, module: str) -> set[str]:
    """The other ``tests.test_*`` modules that test module ``module``'s source imports, in any form and at any level."""
    found = set()
    for base, names, _ in import_statements(source, "tests"):
        found |= {name for name in [base] + [f"{base}.{n}" for n in names]
                  if name.startswith("tests.test_") and name.count(".") == 1}
    return found - {module}


def test_no_test_module_imports_another():
    """Shared fixtures live in tests/conftest.py and shared helpers in the tests' helper modules (workers.py,
    megatron_flags.py, moe_shapes.py, wan_helpers.py, coord_util.py, slurm_cluster.py, secret_watch.py):
    importing a test module from another collects its tests' set-up twice and ties one file's edits to another's."""
    found = {path.name: imported_test_modules(path.read_text(), f"tests.{path.stem}")
             for path in sorted((ROOT / "tests").glob("test_*.py"))}
    assert len(found) > 30
    assert {name: sorted(imported) for name, imported in found.items() if imported} == {}


def test_the_test_import_scan_sees_every_form():
    forms = ["from tests.test_a import x", "from tests import test_a", "import tests.test_a",
             "from .test_a import x", "from . import test_a", "def f():\n    from tests.test_a import x"]
    assert all(imported_test_modules(form, "tests.test_b") == {"tests.test_a"} for form in forms)
    assert imported_test_modules("from tests.workers import x\nfrom tests.test_b import y", "tests.test_b") == set()


def test_public_surface():
    from megatron_dilocox import DiLoCoX, DiLoCoXConfig
    from megatron_dilocox.api import DiLoCoX as api_DiLoCoX
    from megatron_dilocox.config import DiLoCoXConfig as config_DiLoCoXConfig
    assert DiLoCoX is api_DiLoCoX and DiLoCoXConfig is config_DiLoCoXConfig


@pytest.mark.parametrize("entry", ENTRIES)
def test_public_entry_prints_its_help(entry):
    """Every ``python -m megatron_dilocox.<entry>`` the README, scripts, Dockerfile and tests use. pretrain_gpt
    imports Megatron for its flags (about 6 s here; megatron-core 0.19.2's own --help needs the fix in
    ``pretrain_gpt._printable_help``)."""
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", f"megatron_dilocox.{entry}", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "usage:" in res.stdout
    if entry == "pretrain_gpt":
        assert "--dilocox-h " in res.stdout, "the --dilocox-* flags are part of the entry's help"
    print(f"{entry} --help: {time.monotonic() - t0:.1f} s")
