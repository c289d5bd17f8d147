"""The layering rules of ARCHITECTURE.md, read from the source: imports run one way, no cycle,
no module past ~500 lines."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OURS = ("core", "measure", "report", "ncu", "flash", "hf", "samplers", "parallel", "stepping",
        "trainers", "models", "profiling_script", "bench_flash")  # fmt: skip
# What each layer may import of ours (by the first dotted part, or a full module name).
ALLOWED = {
    "core": {"core", "hf.configs"},
    "hf.configs": set(),
    "report": {"core", "report"},
    "ncu": {"core", "ncu", "report.figures"},
    "flash": {"flash"},
    "hf": {"hf"},
    "models": {"core"},
    "samplers": {"samplers", "core"},
    "parallel": {"parallel"},
    "stepping": {"stepping", "parallel"},
    "trainers": {"core", "flash", "samplers", "parallel", "stepping"},
    "measure": {"core", "measure", "trainers", "models", "flash", "hf", "parallel", "stepping"},
}


def modules() -> dict[str, str]:
    """Dotted module name -> path, for every Python file of ours outside tests."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "tests"]
        for filename in filenames:
            if filename.endswith(".py"):
                path = os.path.join(dirpath, filename)
                dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


def imports_of(path: str, name: str) -> set[str]:
    """Our modules that ``path`` imports (anywhere in the file)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    type_only = {  # `if TYPE_CHECKING:` imports are for annotations, never executed
        id(child)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
        for child in ast.walk(node)
    }
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))  # fmt: skip
            out.update([base] + [f"{base}.{alias.name}" for alias in node.names])
    return {m for m in out if m.split(".")[0] in OURS}


def layer_of(name: str) -> str | None:
    for layer in sorted(ALLOWED, key=len, reverse=True):
        if name == layer or name.startswith(layer + "."):
            return layer
    return None


MODULES = modules()


def test_the_layers_are_all_there():
    assert {"core.schema", "core.settings", "measure.plan", "report.summary", "ncu.summary",
            "flash.engine", "hf.models", "trainers"} <= set(MODULES)  # fmt: skip


@pytest.mark.parametrize("name", sorted(n for n in MODULES if layer_of(n)))
def test_imports_run_one_way(name):
    allowed = ALLOWED[layer_of(name)]
    for imported in imports_of(MODULES[name], name):
        ok = any(imported == a or imported.startswith(a + ".") for a in allowed)
        assert ok, f"{name} imports {imported}"


def test_no_import_cycle():
    graph = {
        name: {m for m in imports_of(path, name) if m in MODULES and m != name}
        for name, path in MODULES.items()
    }
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                raise AssertionError(" -> ".join([*stack, node, nxt]))
            if nxt not in state:
                visit(nxt, [*stack, node])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [])


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_past_500_lines(name):
    with open(MODULES[name], encoding="utf-8") as f:
        assert sum(1 for _ in f) <= 500, name
