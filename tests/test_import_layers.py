"""The package's imports, read from the source by AST (function-level imports included): no circle
among its modules, and no module importing a layer above its own.

Layers, bottom up: the flat files copied next to a checkpoint as remote code (the modules that
`modeling_powernorm.py`, `configuration_powernorm.py` and `modeling_converted.py` import, followed as
Transformers follows them), the rest of the flat library (`converter.py`, `hub.py`, ...), the training
library (`training/`), and the commands over it (`compare.py`, `cli.py`, `studies/`, `benchmarks/`).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "hf_powernorm"
REMOTE_CODE_ROOTS = ("modeling_powernorm", "configuration_powernorm", "modeling_converted")
COMMANDS = ("compare", "cli", "studies", "benchmarks")
LAYERS = ("remote code", "library", "training", "commands")


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)  # "" is the package itself


def _is_module(name: str) -> bool:
    path = PACKAGE.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(path: pathlib.Path) -> dict[str, set[str]]:
    """The package modules that `path` imports (at any depth of its code) -> the kind of each import
    (`relative`, `absolute`)."""
    name = _module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    package = [part for part in package if part]
    found: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets, kind = [], "relative"
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
            targets = [".".join(base + [alias.name]) for alias in node.names]
            targets = [t if _is_module(t) else ".".join(base) for t in targets]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "hf_powernorm":
            kind, targets = "absolute", [node.module.removeprefix("hf_powernorm").lstrip(".")]
        elif isinstance(node, ast.Import):
            kind = "absolute"
            targets = [a.name.removeprefix("hf_powernorm").lstrip(".") for a in node.names
                       if a.name.split(".")[0] == "hf_powernorm"]
        for target in targets:
            if target != name:
                found.setdefault(target, set()).add(kind)
    return found


GRAPH = {_module_name(path): _imports(path) for path in sorted(PACKAGE.rglob("*.py"))}


def _remote_code() -> set[str]:
    """The flat files Transformers copies next to a checkpoint: the roots and what they import."""
    seen, todo = set(), list(REMOTE_CODE_ROOTS)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(GRAPH[name])
    return seen


def _layer(name: str) -> int:
    if name in _remote_code():
        return 0
    top = name.split(".")[0]
    return 3 if top in COMMANDS else 2 if top == "training" else 1


def _cycle() -> list[str] | None:
    """One import circle among the package's modules, or None."""
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> list[str] | None:
        state[name] = "open"
        for target in sorted(GRAPH.get(name, ())):
            if state.get(target) == "open":
                return path[path.index(target):] + [target] if target in path else path + [target]
            if target not in state:
                found = visit(target, path + [target])
                if found:
                    return found
        state[name] = "done"
        return None

    for name in sorted(GRAPH):
        if name not in state:
            found = visit(name, [name])
            if found:
                return found
    return None


def test_the_graph_is_read_from_every_module():
    assert {"converter", "modeling_converted", "converted_norms", "training.loop", "compare"} <= set(GRAPH)
    assert "converted_norms" in GRAPH["modeling_converted"] and "modeling_converted" in GRAPH["converter"]
    assert "converter" in GRAPH["training.models"]  # a function-level import counts


def test_no_import_circle():
    cycle = _cycle()
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_circle(monkeypatch):
    monkeypatch.setitem(GRAPH, "normalization", {**GRAPH["normalization"], "converter": {"relative"}})
    assert _cycle() is not None


@pytest.mark.parametrize("name", sorted(GRAPH))
def test_no_module_imports_a_layer_above_its_own(name):
    above = {target: LAYERS[_layer(target)] for target in GRAPH[name] if _layer(target) > _layer(name)}
    assert not above, f"{name or 'hf_powernorm'} ({LAYERS[_layer(name)]}) imports {above}"


def test_remote_code_is_flat_and_imports_itself_relatively():
    """Transformers copies a remote-code file and what it imports as `from .module import Name`, flat;
    an absolute `hf_powernorm` import would fail where the package is not installed."""
    remote = _remote_code()
    assert {"normalization", "converted_norms"} <= remote and "converter" not in remote
    for name in remote:
        assert "." not in name and name, f"remote-code module {name!r} is not a flat file of the package"
        absolute = [target for target, kinds in GRAPH[name].items() if "absolute" in kinds]
        assert not absolute, f"{name} imports {absolute} absolutely"


def test_no_function_is_over_50_lines_without_a_comment_saying_why():
    """The style notes' limit: a function of more than 50 lines has a comment on the line above it
    (above its decorators) that says why."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text(encoding="utf-8").splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 50:
                first = min([node.lineno, *(decorator.lineno for decorator in node.decorator_list)])
                if not lines[first - 2].strip().startswith("# Over 50 lines:"):
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}")
    assert long == []


def _test_file_imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
    return names


def test_a_test_file_imports_no_test_file_of_another_folder():
    """Each test folder runs alone (`pytest tests/norms`): pytest puts a test file's own folder on the
    path, so a `test_*` module of another folder would import only when that folder was collected first."""
    tests = pathlib.Path(__file__).resolve().parent
    own = {path.stem: path.parent for path in tests.rglob("test_*.py")}
    crossing = sorted(f"{path.relative_to(tests)} imports {name}" for path in tests.rglob("*.py")
                      for name in _test_file_imports(path)
                      if name in own and own[name] != path.parent)
    assert not crossing, crossing
