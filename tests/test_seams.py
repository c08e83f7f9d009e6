"""The package's seams run one way, read from the source by AST: the norm modules call the dispatch
through its public names and the dispatch leaves modules' private state alone; the converter uses
its sibling's public seam; each option is declared once; module docstrings say what, briefly; the C
sources live apart from their loader."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "hf_powernorm"
MODULES = sorted(PACKAGE.rglob("*.py"))


def _tree(name: str) -> ast.Module:
    return ast.parse((PACKAGE / name).read_text(encoding="utf-8"))


def _private_imports(importer: str, imported: str) -> list[str]:
    """The names with a leading underscore that `importer` imports from the sibling module `imported`."""
    return sorted(alias.name for node in ast.walk(_tree(importer))
                  if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module == imported
                  for alias in node.names if alias.name.startswith("_"))


def test_the_norm_modules_import_no_private_name_of_the_dispatch():
    assert _private_imports("normalization.py", "norm_dispatch") == []


def test_the_dispatch_touches_no_modules_private_state_but_where_it_says_why():
    lines = (PACKAGE / "norm_dispatch.py").read_text(encoding="utf-8").splitlines()
    touches = [(number, line) for number, line in enumerate(lines, 1)
               if re.search(r"\._buffers\b|\._parameters\b|\.__dict__\b", line)]
    assert len(touches) <= 2, touches
    for number, line in touches:  # each with a comment saying why, on its line or the one above
        assert "#" in line or lines[number - 2].lstrip().startswith("#"), (number, line)


def test_the_converter_uses_its_siblings_public_seam():
    assert _private_imports("converter.py", "converted_norms") == []


def test_each_option_parser_is_defined_once():
    definitions = [f"{path.relative_to(PACKAGE)}:{node.name}" for path in MODULES
                   for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                   if isinstance(node, ast.FunctionDef) and node.name.lstrip("_") == "group_num"]
    assert len(definitions) <= 1, definitions


def test_options_are_read_typed_not_fished_out_of_a_namespace():
    count = sum(path.read_text(encoding="utf-8").count("getattr(args") for path in MODULES)
    assert count <= 20, count


@pytest.mark.parametrize("path", MODULES, ids=lambda path: str(path.relative_to(PACKAGE)))
def test_a_module_docstring_says_what_in_at_most_30_lines(path):
    docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False) or ""
    assert len(docstring.splitlines()) <= 30


def test_the_c_sources_live_apart_from_their_loader():
    loader = (PACKAGE / "kernels_cpu.py").read_text(encoding="utf-8")
    assert len(loader.splitlines()) <= 700
    assert "#include" not in loader
