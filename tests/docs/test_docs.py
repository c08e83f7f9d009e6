"""The README and the pages of docs/ say what runs: every fenced Python block of a page runs, in order,
in one namespace, in a fresh folder (smoke sizes), unless the line before it is a visible
`<!-- not run: REASON -->`; every command of a fenced bash block names a `make` target, a script or
module, or a `pip` extra that exists, and each `--option` it passes is one its `--help` lists. The
README stays a front door: its two set-up commands first, at most about 250 lines, no dated counts."""

import importlib
import re
import shlex
from pathlib import Path

import pytest

from recipe_scripts import load_recipe

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(?P<language>\w*)\n(?P<code>.*?)^```$", re.M | re.S)
NOT_RUN = re.compile(r"<!-- not run: (?P<reason>[^>]*\S[^>]*) -->\n$")


def blocks(page: Path, language: str) -> list[tuple[str, str | None]]:
    """`(code, reason it is not run or None)` of each fenced block of `language` in `page`."""
    text = page.read_text(encoding="utf-8")
    found = []
    for match in FENCE.finditer(text):
        if match.group("language") == language:
            skipped = NOT_RUN.search(text[:match.start()][-200:])
            found.append((match.group("code"), skipped.group("reason") if skipped else None))
    return found


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", [p for p in PAGES if any(reason is None for _, reason in blocks(p, "python"))],
                         ids=_page_id)
def test_the_python_blocks_of_a_page_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    ran = 0
    for index, (code, reason) in enumerate(blocks(page, "python")):
        if reason is None:
            exec(compile(code, f"{_page_id(page)}, python block {index + 1}", "exec"), namespace)
            ran += 1
    assert ran


def test_blocks_not_run_are_few_and_say_why():
    skipped = [(page, reason) for page in PAGES for language in ("python", "bash")
               for _, reason in blocks(page, language) if reason is not None]
    run = [code for page in PAGES for code, reason in blocks(page, "python") if reason is None]
    assert all(reason.strip() for _, reason in skipped) and len(skipped) < len(run) / 3


def commands(code: str) -> list[list[str]]:
    """The commands of a bash block: continuation lines joined, comments and leading `VAR=...` dropped."""
    found = []
    for line in code.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words and re.match(r"^[A-Z_]+=", words[0]):
            words = words[1:]
        if words:
            found.append(words)
    return found


def _help(entry, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as stopped:
        entry([*argv, "--help"])
    assert stopped.value.code == 0
    return capsys.readouterr().out


def _target(words: list[str]) -> tuple[str, list[str]]:
    """`(what the command runs, its arguments)`: `script:PATH`, `module:NAME`, `make:TARGET`, `pip:EXTRA`."""
    head, rest = words[0], words[1:]
    if head == "make":
        return f"make:{rest[0]}", []
    if head == "pip":
        extra = re.search(r"\[(\w+)\]", " ".join(rest))
        return f"pip:{extra.group(1)}", []
    if head == "hf-powernorm":
        return f"module:hf_powernorm.{rest[0]}", rest[1:]
    if head == "accelerate" and rest[:1] == ["launch"]:
        rest = rest[1:]
        while rest and rest[0].startswith("--"):  # accelerate's own options and their values
            rest = rest[2:]
    elif not head.endswith("python"):
        raise AssertionError(f"a command the docs test does not know: {' '.join(words)}")
    if rest[0] == "-m":
        return f"module:{rest[1]}", rest[2:]
    return f"script:{rest[0]}", rest[1:]


def _help_of(target: str, args: list[str], capsys) -> tuple[str, list[str]]:
    kind, _, name = target.partition(":")
    if kind == "script" and name.startswith("recipes/studies/"):
        kind, name = "module", f"hf_powernorm.studies.{Path(name).stem}"
    if kind == "script":
        assert (ROOT / name).is_file(), name
        return _help(load_recipe(name[len("recipes/"):-len(".py")]).parse_args, [], capsys), args
    if name == "hf_powernorm.studies":
        from hf_powernorm.studies.__main__ import main

        study = [args[0]] if args and not args[0].startswith("-") else []
        return _help(main, study, capsys), args[len(study):]
    return _help(importlib.import_module(name).main, [], capsys), args


def _check_command(words: list[str], capsys) -> None:
    target, args = _target(words)
    kind, _, name = target.partition(":")
    if kind == "make":
        assert re.search(rf"^{re.escape(name)}:", (ROOT / "Makefile").read_text(encoding="utf-8"), re.M), name
    elif kind == "pip":
        assert re.search(rf"^{name} =", (ROOT / "setup.cfg").read_text(encoding="utf-8"), re.M), name
    elif name == "pytest":
        assert all((ROOT / arg).is_file() for arg in args if arg.endswith(".py")), args
    else:
        shown, options = _help_of(target, args, capsys)
        unknown = [option for option in (a.split("=")[0] for a in options if a.startswith("--"))
                   if option not in shown]
        assert unknown == [], f"{' '.join(words)}: options its --help does not list: {unknown}"


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p, "bash")], ids=_page_id)
def test_the_commands_of_a_page_name_what_exists(page, capsys):
    checked = 0
    for code, reason in blocks(page, "bash"):
        for words in commands(code) if reason is None else []:
            _check_command(words, capsys)
            checked += 1
    assert checked


@pytest.mark.parametrize("command", ["python recipes/train_wmt.py --no_such_option 1",
                                     "hf-powernorm compare --nothing", "python -m hf_powernorm.studies pn_ablation --nope",
                                     "make no_such_target"])
def test_a_command_with_a_stale_name_or_option_is_caught(command, capsys):
    with pytest.raises(AssertionError):
        _check_command(shlex.split(command), capsys)


def test_the_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    first = commands(blocks(ROOT / "README.md", "bash")[0][0])
    assert first == [["make", "train"], ["make", "test"]]
    assert len(text.splitlines()) <= 260
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b|\b\d[\d,]* passed\b", text)
    assert re.search(r"^Tested range: .+$", text, re.M)
    for page in ("norms", "models", "recipes", "conversion", "compare", "studies", "benchmarks"):
        assert f"(docs/{page}.md)" in text, page


def test_the_ci_entry_point_runs_the_readmes_test_command():
    assert "make test" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
