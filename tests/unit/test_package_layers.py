"""The package's layers: core, engine, drills, each importing only those below; the core imports no vLLM; no import circles.

The package stands in three layers, one folder each: core/ (the
definition, the views and kernels, rows, the host copy, the payload, the
comparison, the block rule, records), which runs on a GPU host without
vLLM; engine/, the hooks the patches call; drills/, the faults and the
fault-injecting connector. A layer imports only the ones below it. The check
reads every import statement, at module level, in functions and under
TYPE_CHECKING, so a lazy import counts too; the demo and the soak
(scripts/) are held to the same rule about circles.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Each layer may import the ones before it, never one after it.
LAYERS = ("core", "engine", "drills")


def module_imports(top: Path) -> dict[str, set[str]]:
    """Every module under `top` (a package) and the modules it imports.

    `from pkg import name` names pkg.name where that is a module, else pkg.
    A submodule's import of its own package is implicit in Python and
    leaves it out.
    """
    files = {}
    for f in sorted(top.rglob("*.py")):
        parts = f.relative_to(top.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    imports = {}
    for name, f in files.items():
        found = set()
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                subs = {f"{node.module}.{a.name}" for a in node.names} & files.keys()
                found |= subs or {node.module}
        imports[name] = found - {name} - {p for p in files if name.startswith(p + ".")}
    return imports


def circles(imports: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    edges = {m: sorted(d for d in deps if d in imports) for m, deps in imports.items()}
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(m):
        index[m] = low[m] = len(index)
        stack.append(m)
        on.add(m)
        for d in edges[m]:
            if d not in index:
                visit(d)
                low[m] = min(low[m], low[d])
            elif d in on:
                low[m] = min(low[m], index[d])
        if low[m] == index[m]:
            group = []
            while True:
                d = stack.pop()
                on.discard(d)
                group.append(d)
                if d == m:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for m in sorted(edges):
        if m not in index:
            visit(m)
    return found


@pytest.mark.parametrize("top", ["vllm_kvchecksum", "scripts/kvcs_demo", "scripts/kvcs_soak", "scripts/workbench"])
def test_no_modules_import_each_other_in_a_circle(top):
    assert circles(module_imports(ROOT / top)) == []


def test_the_circle_finder_finds_a_circle_through_a_lazy_import(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import thing\n")
    (pkg / "b.py").write_text("def thing():\n    from pkg import a\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    assert circles(module_imports(pkg)) == [["pkg.a", "pkg.b"]]


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[0] == "vllm_kvchecksum" and parts[1] in LAYERS else None


# Beside the layers: install/ (`vllm-kvchecksum apply|undo|status`, `make wheels`) runs where vLLM is
# not importable or is about to be patched, so it imports nothing but the standard library and itself.
STANDALONE = ("install",)


def test_every_module_sits_in_a_layer():
    assert [m for m in module_imports(ROOT / "vllm_kvchecksum")
            if m != "vllm_kvchecksum" and m.split(".")[1] not in LAYERS + STANDALONE] == []


def test_install_imports_only_the_standard_library_and_itself():
    imports = module_imports(ROOT / "vllm_kvchecksum")
    own = "vllm_kvchecksum.install"
    outside = {m: sorted(d for d in deps if not (d == own or d.startswith(own + "."))
                         and d.split(".")[0] not in sys.stdlib_module_names)
               for m, deps in imports.items() if m == own or m.startswith(own + ".")}
    assert {m: deps for m, deps in outside.items() if deps} == {}
    assert any(m.startswith(own + ".") for m in imports), "no install modules found: the check checks nothing"


def test_no_layer_imports_a_layer_above_it():
    imports = module_imports(ROOT / "vllm_kvchecksum")
    upward = {m: sorted(d for d in deps if layer_of(d) and LAYERS.index(layer_of(d)) > LAYERS.index(layer_of(m)))
              for m, deps in imports.items() if layer_of(m)}
    assert {m: deps for m, deps in upward.items() if deps} == {}


def core_modules() -> list[str]:
    return sorted(m for m in module_imports(ROOT / "vllm_kvchecksum") if layer_of(m) == "core" or
                  m == "vllm_kvchecksum.core")


def test_the_core_names_no_vllm():
    imports = module_imports(ROOT / "vllm_kvchecksum")
    assert {m: sorted(d for d in imports[m] if d == "vllm" or d.startswith("vllm."))
            for m in core_modules() if any(d == "vllm" or d.startswith("vllm.") for d in imports[m])} == {}


def test_the_core_imports_where_vllm_cannot_be_imported():
    """At run time too: in a process where `import vllm` fails (the Numba and
    Triton paths need those packages, not vLLM; they are left to their tests)."""
    optional = {"vllm_kvchecksum.core.kernels.numba_path", "vllm_kvchecksum.core.kernels.triton_kernel"}
    code = ("import sys; sys.modules['vllm'] = None\n"
            "import importlib\n"
            f"for m in {sorted(set(core_modules()) - optional)!r}:\n"
            "    importlib.import_module(m)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
