"""The layering rules of ARCHITECTURE.md, read from the source: imports run one way, no cycle
(type-checking imports included), no import of another module's private name, modules sized by
concept, few long functions, each mode's name read in one place, and ARCHITECTURE.md's map
equal to the tree."""

import ast
import os
import re
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OURS = ("dp_cost", "trainers", "models", "profiling_script", "bench_flash")
# What each layer may import of ours (by a module name or a package prefix).
ALLOWED = {
    "dp_cost.core": {"dp_cost.core"},
    "dp_cost.hf.configs": {"dp_cost.core.hf_architectures"},
    "dp_cost.report": {"dp_cost.core", "dp_cost.report", "dp_cost.parallel.mode"},
    "dp_cost.ncu": {"dp_cost.core", "dp_cost.ncu", "dp_cost.report.figures"},
    "dp_cost.noise": {"dp_cost.noise"},
    # core.repeated: the name of a range the planner counts N times (torch-free)
    "dp_cost.flash": {"dp_cost.flash", "dp_cost.noise", "dp_cost.core.repeated"},
    "dp_cost.hf": {"dp_cost.hf", "dp_cost.core", "dp_cost.noise"},
    "models": {"dp_cost.lm"},
    "dp_cost.lm": {"dp_cost.lm", "dp_cost.core"},
    "dp_cost.samplers": {"dp_cost.samplers", "dp_cost.core"},
    "dp_cost.parallel": {"dp_cost.parallel", "dp_cost.core"},
    "dp_cost.stepping": {"dp_cost.stepping", "dp_cost.parallel", "dp_cost.core"},
    "dp_cost.training": {
        "dp_cost.training",
        "dp_cost.core",
        "dp_cost.flash",
        "dp_cost.samplers",
        "dp_cost.parallel",
        "dp_cost.stepping",
    },  # fmt: skip
    "trainers": {"dp_cost.training"},
    "dp_cost.capacity": {
        "dp_cost.core",
        "dp_cost.capacity",
        "dp_cost.measure.breakdown",
        "dp_cost.measure.workload",
        "dp_cost.measure.plan_checks",
        "dp_cost.lm",
        "dp_cost.hf",
        "dp_cost.parallel",
    },  # fmt: skip
    "dp_cost.measure": {
        "dp_cost.core",
        "dp_cost.measure",
        "dp_cost.capacity",
        "dp_cost.lm",
        "dp_cost.flash",
        "dp_cost.hf",
        "dp_cost.noise",
        "dp_cost.parallel",
        "dp_cost.report",
        "dp_cost.stepping",
        "dp_cost.training",
    },  # fmt: skip
}
MODULE_WARN_LINES, MODULE_MAX_LINES = 400, 450  # past the first: look for the seam
FUNCTION_MAX_LINES, LONG_FUNCTIONS_ALLOWED = 60, 3


def modules() -> dict[str, str]:
    """Dotted module name -> path, for every Python file of ours outside tests."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in ("tests", "docs")]
        for filename in filenames:
            if filename.endswith(".py"):
                path = os.path.join(dirpath, filename)
                dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


def import_nodes(path: str, name: str):
    """(module imported, names taken from it) for every import in the file, type-checking
    imports included."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            yield base, tuple(alias.name for alias in node.names)


def imports_of(path: str, name: str) -> set[str]:
    """Our modules that ``path`` imports (anywhere in the file, type-checking imports too)."""
    out = set()
    for base, names in import_nodes(path, name):
        out.add(base)
        out.update(f"{base}.{n}" for n in names if f"{base}.{n}" in MODULES)
    return {m for m in out if m.split(".")[0] in OURS and m != "dp_cost"}


def layer_of(name: str) -> str | None:
    for layer in sorted(ALLOWED, key=len, reverse=True):
        if name == layer or name.startswith(layer + "."):
            return layer
    return None


MODULES = modules()


def test_the_layers_are_all_there():
    ours = ("core.schema", "core.settings", "measure.plan", "report.summary", "ncu.summary",
            "flash.engine", "hf.models", "parallel.mode", "training.base",
            "stepping.protocol")  # fmt: skip
    assert {f"dp_cost.{name}" for name in ours} | {"trainers", "models"} <= set(MODULES)
    assert all(layer_of(name) for name in MODULES if name.startswith("dp_cost."))


@pytest.mark.parametrize("name", sorted(n for n in MODULES if layer_of(n)))
def test_imports_run_one_way(name):
    allowed = ALLOWED[layer_of(name)]
    for imported in imports_of(MODULES[name], name):
        ok = any(imported == a or imported.startswith(a + ".") for a in allowed)
        assert ok, f"{name} imports {imported}"


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack, node, nxt]
            if nxt not in state and (found := visit(nxt, [*stack, node])):
                return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node, [])):
            return found
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    """Type-checking imports count: a cycle through them is a cycle of concepts all the same.
    A package's ``__init__`` importing its own modules is not a cycle."""
    graph = {
        name: {
            m
            for m in imports_of(path, name)
            if m in MODULES and m != name and not name.startswith(m + ".")
        }
        for name, path in MODULES.items()
    }
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def private_imports(path: str, name: str) -> list[str]:
    """Names starting with one underscore that ``name`` imports from another module of ours."""
    found = []
    for base, names in import_nodes(path, name):
        if base.split(".")[0] not in OURS or base == name:
            continue
        private_module = any(part.startswith("_") and not part.startswith("__")
                             for part in base.split("."))  # fmt: skip
        found += [f"{base}.{n}" for n in names if n.startswith("_") and not n.startswith("__")]
        found += [base] if private_module else []
    return found


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_import_of_another_modules_private_name(name):
    assert private_imports(MODULES[name], name) == []


def test_private_imports_are_found(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from dp_cost.flash.clip import _hidden, public\nfrom dp_cost.a._b import c\n")
    assert private_imports(str(path), "x") == ["dp_cost.flash.clip._hidden", "dp_cost.a._b"]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_size_budget(name):
    """Modules are sized by concept: past MODULE_WARN_LINES a warning (look for the seam), past
    MODULE_MAX_LINES (tests aside) a failure. Nobody deletes a useful line to stay under a
    cap."""
    with open(MODULES[name], encoding="utf-8") as f:
        lines = sum(1 for _ in f)
    assert lines <= MODULE_MAX_LINES, f"{name}: {lines} lines"
    if lines > MODULE_WARN_LINES:
        warnings.warn(f"{name}: {lines} lines, past {MODULE_WARN_LINES}", stacklevel=1)


def test_parallel_knows_no_fake_tensors():
    """What a step on fake tensors needs in parallel/ (DDP's stand-in, no seeded generator) the
    capacity planner puts into parallel/'s hook points: no module there tells fake tensors."""
    for name, path in MODULES.items():
        if name.startswith("dp_cost.parallel"):
            bases = {base for base, _ in import_nodes(path, name)}
            assert "torch._subclasses.fake_tensor" not in bases, name


def long_functions(path: str, name: str) -> list[str]:
    """Functions of the file (methods and nested ones too) past FUNCTION_MAX_LINES, counted from
    the def line to the end of the body; Triton kernels (``@triton.jit``) aside: a kernel is one
    launch's code, read as one."""
    found = []
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if any(ast.unparse(d).startswith("triton.jit") for d in node.decorator_list):
            continue
        lines = node.end_lineno - node.lineno + 1
        if lines > FUNCTION_MAX_LINES:
            found.append(f"{name}.{node.name}: {lines} lines")
    return found


def test_few_functions_are_long():
    """A function past FUNCTION_MAX_LINES usually does several things: at most
    LONG_FUNCTIONS_ALLOWED such outside the benchmarks (tests are not counted)."""
    found = [
        long
        for name, path in sorted(MODULES.items())
        if not name.startswith("benchmarks.")
        for long in long_functions(path, name)
    ]
    assert len(found) <= LONG_FUNCTIONS_ALLOWED, "\n".join(found)


def test_long_functions_are_found(tmp_path):
    path = tmp_path / "m.py"
    body = "".join(f"    x{i} = {i}\n" for i in range(FUNCTION_MAX_LINES))
    path.write_text(f"def long():\n{body}\n\n@triton.jit\ndef kernel():\n{body}")
    assert long_functions(str(path), "m") == [f"m.long: {FUNCTION_MAX_LINES + 1} lines"]


# A comparison of a value with one of the distributed modes' names.
MODE_COMPARISON = re.compile(
    r"""(==|!=|\bin)\s*\(?\s*["'](none|ddp|fsdp)["']|["'](ddp|fsdp)["']\s*(==|!=)"""
)


def test_the_distributed_mode_is_read_in_one_place():
    """What differs between one process, DDP and FSDP2 is the mode object's
    (dp_cost/parallel/mode.py); nothing else compares the mode's name."""
    offenders = []
    for name, path in MODULES.items():
        if name == "dp_cost.parallel.mode":
            continue
        for number, line in enumerate(open(path, encoding="utf-8"), 1):
            if MODE_COMPARISON.search(line):
                offenders.append(f"{name}:{number}: {line.strip()}")
    assert offenders == []
    assert MODE_COMPARISON.search('if distributed == "ddp":')
    assert MODE_COMPARISON.search("x != 'none'")


# Each mode name (--distributed, --fsdp_sync, --clipping) -> the one module that reads it.
MODE_NAME_HOMES = {
    **dict.fromkeys(("none", "ddp", "fsdp", "chunk", "logical"), "dp_cost.parallel.mode"),
    **dict.fromkeys(("flat", "per_layer"), "dp_cost.training.clipping"),
}


def mode_name_uses(source: str, module: str) -> list[str]:
    """Lines of ``source`` that use a mode name as a dict key or in a membership test (``in`` or
    ``not in`` a tuple, list or set of names) outside the name's home module."""

    def names(node) -> list[str]:
        elements = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
        return [
            e.value
            for e in elements
            if isinstance(e, ast.Constant) and MODE_NAME_HOMES.get(e.value, module) != module
        ]

    found = []
    for node in ast.walk(ast.parse(source)):
        used = []
        if isinstance(node, ast.Dict):
            used = [name for key in node.keys if key is not None for name in names(key)]
        elif isinstance(node, ast.Compare):
            pairs = zip(node.ops, node.comparators, strict=True)
            used = [n for op, right in pairs if isinstance(op, (ast.In, ast.NotIn))
                    for n in names(right)]  # fmt: skip
        if used:
            found.append(f"{node.lineno}: {', '.join(sorted(set(used)))}")
    return found


def test_mode_name_uses_are_found():
    assert mode_name_uses('x = {"ddp": 1, "other": 2}', "m") == ["1: ddp"]
    assert mode_name_uses('if a not in ("chunk", "b"):\n    pass', "m") == ["1: chunk"]
    assert mode_name_uses('ok = a in ["flat", "per_layer"]', "m") == ["1: flat, per_layer"]
    assert mode_name_uses('ok = a in ["flat"]', "dp_cost.training.clipping") == []
    assert mode_name_uses('ok = a in ("ddp", "fsdp")', "dp_cost.parallel.mode") == []
    assert mode_name_uses('names = ("none", "ddp")', "m") == []  # declared, not tested


def test_mode_names_are_keys_and_members_only_where_they_are_read():
    """A mode name used as a dict key or tested for membership is the mode read a second time:
    outside its home (MODE_NAME_HOMES) a mode asks its object instead."""
    offenders = []
    for name, path in MODULES.items():
        source = open(path, encoding="utf-8").read()
        offenders += [f"{name}:{use}" for use in mode_name_uses(source, name)]
    assert offenders == []


def architecture_folders() -> set[str]:
    """The folders ARCHITECTURE.md's map names (``dp_cost/<name>/`` at a line's start)."""
    text = open(os.path.join(ROOT, "ARCHITECTURE.md"), encoding="utf-8").read()
    return set(re.findall(r"^dp_cost/([a-z_]+)/ ", text, flags=re.MULTILINE))


def test_architecture_names_every_folder_of_the_tree():
    tree = {
        entry
        for entry in os.listdir(os.path.join(ROOT, "dp_cost"))
        if os.path.isfile(os.path.join(ROOT, "dp_cost", entry, "__init__.py"))
    }
    assert architecture_folders() >= tree
    named = architecture_folders()
    assert named <= tree, f"ARCHITECTURE.md names folders that are not there: {named - tree}"


def test_tests_are_laid_out_like_the_code():
    folders = {
        entry
        for entry in os.listdir(os.path.join(ROOT, "tests"))
        if os.path.isdir(os.path.join(ROOT, "tests", entry)) and entry not in ("fixtures",)
        and not entry.startswith((".", "__"))
    }  # fmt: skip
    code = set(os.listdir(os.path.join(ROOT, "dp_cost")))
    assert folders <= code, f"test folders without a code folder: {folders - code}"
