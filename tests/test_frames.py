"""The teaching frames hold together: every chapter has its notebook and exercise, the
notebooks run top to bottom, and what the chapters and README name exists."""

import ast
import importlib
import importlib.util
import re
import shlex

import pytest

from conftest import ROOT

DOCS = sorted((ROOT / "chapters").glob("*.md")) + [ROOT / "README.md"]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
MODULES = sorted((ROOT / "minidist").glob("*.py"))


def _names(folder, suffix):
    return {p.stem for p in (ROOT / folder).glob(f"*{suffix}") if re.fullmatch(r"\d\d_[a-z0-9_]+", p.stem)}


def test_chapters_notebooks_exercises_match():
    chapters = _names("chapters", ".md")
    assert chapters, "no chapters"
    assert chapters == _names("notebooks", ".ipynb") == _names("exercises", ".py")


def test_readme_maps_every_chapter():
    readme = (ROOT / "README.md").read_text()
    for name in _names("chapters", ".md"):
        for place in (f"chapters/{name}.md", f"notebooks/{name}.ipynb", f"exercises/{name}.py"):
            assert place in readme, f"README's chapter map lacks {place}"


def _code_spans(text):
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # inline code only
    return re.findall(r"`([^`\n]+)`", text)


def _resolve(dotted):
    """Import the longest module prefix of a dotted name, then getattr the rest."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_named_symbols_and_files_exist(doc):
    for span in _code_spans(doc.read_text()):
        span = span.strip().rstrip("()")
        if re.fullmatch(r"minidist(\.\w+)+", span):
            _resolve(span)  # raises if a chapter names something that does not exist
        elif re.fullmatch(r"(minidist|chapters|notebooks|exercises|tests|scripts|\.ci)/[\w./-]+", span) \
                and "NN" not in span:  # exercises/NN_name.py is a pattern, not a file
            assert (ROOT / span).exists(), f"{doc.name} names {span}, which does not exist"


def _commands(text):
    for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                yield from (c.strip() for c in re.split(r"&&|;", line) if c.strip())


def _check_command(cmd):
    words = [w for w in shlex.split(cmd) if "=" not in w or w.startswith("-")]
    prog, args = words[0], words[1:]
    if prog in ("python", "python3"):
        if args[0] == "-m":
            module, rest = args[1], args[2:]
            assert importlib.util.find_spec(module), f"no module {module}"
            if module == "minidist.train_gpt":
                _check_train_flags(rest)
            if module == "exercises.grade":
                from exercises import grade
                grade.parse_args(rest)
            return
        script, rest = args[0], args[1:]
    elif prog == "torchrun":
        i = next(i for i, a in enumerate(args) if a.endswith(".py"))
        script, rest = args[i], args[i + 1:]
    else:
        assert prog in ("pip", "pytest", "git", "cd", "bash", "jupyter", "export"), f"unknown program {prog}"
        return
    assert (ROOT / script).exists(), f"no script {script}"
    if script.endswith("train_gpt.py"):
        _check_train_flags(rest)


def _check_train_flags(rest):
    from minidist.train_gpt import build_parser
    build_parser().parse_args(rest)  # exits (fails the test) on an unknown flag or value


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_named_commands_exist(doc):
    cmds = list(_commands(doc.read_text()))
    for cmd in cmds:
        try:
            _check_command(cmd)
        except SystemExit as e:
            pytest.fail(f"{doc.name}: `{cmd}` has flags its program rejects ({e})")


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_top_to_bottom(nb):
    import nbformat
    from nbclient import NotebookClient
    book = nbformat.read(nb, as_version=4)
    NotebookClient(book, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(nb.parent)}}).execute()


@pytest.mark.parametrize("mod", MODULES, ids=lambda p: p.name)
def test_modules_are_readable_and_layered(mod):
    if mod.name == "__init__.py":
        return
    src = mod.read_text()
    assert len(src.splitlines()) <= 330, f"{mod.name} is over ~300 lines: split it by concept"
    doc = ast.get_docstring(ast.parse(src)) or ""
    m = re.search(r"Chapter (\d\d)", doc)
    assert m, f"{mod.name}'s docstring must name its chapter"
    assert 1 <= int(m.group(1)) <= 8, "the curriculum has chapters 01 to 08"
    imports = {n.module for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ImportFrom) and n.module}
    imports |= {a.name for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Import) for a in n.names}
    if mod.stem in ("model", "data"):  # the ground floor: imports nothing of minidist
        assert not any(i.startswith("minidist") for i in imports), imports
    if mod.stem == "dist":
        assert not any(i.startswith("minidist") for i in imports), imports
    # torch's own parallel wrappers are oracles for tests, never building blocks
    assert not any(re.search(r"parallel|fsdp|ZeroRedundancy", i) for i in imports), imports
