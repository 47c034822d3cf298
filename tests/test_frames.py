"""The teaching frames hold together: every chapter has its notebook and exercise, the
notebooks run top to bottom, and what the chapters and README name exists."""

import ast
import importlib
import importlib.util
import os
import re
import shlex

import pytest

from conftest import ROOT

DOCS = sorted((ROOT / "chapters").glob("*.md")) + [ROOT / "README.md"]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
MODULES = sorted((ROOT / "minidist").rglob("*.py"))  # subpackages too: zero/, bench/


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
                from exercises.grader import cli
                cli.parse_args(rest)
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


# Run before each notebook in a shared kernel: a clean slate as a fresh kernel would give
# (no names, no figures, no process group, the first environment, thread count and folder),
# keeping only what is slow to start and holds no state of a notebook's: imported modules
# and minidist.launch's fork server (torch imported once, not once per notebook).
_FRESH = """import sys as _sys
_sys.__dict__.setdefault("_notebook_dunders", {k: v for k, v in globals().items() if k[:2] == k[-2:] == "__"})
del _sys
%reset -f
import os as _os, sys as _sys, torch as _torch, matplotlib.pyplot as _plt
import torch.distributed as _dist
globals().update(_sys._notebook_dunders)  # (__spec__ and the rest, which reset removes)
_plt.close("all")
if _dist.is_initialized():
    _dist.destroy_process_group()
_first = _sys.__dict__.setdefault("_notebook_start", (dict(_os.environ), _torch.get_num_threads()))
_os.environ.clear()
_os.environ.update(_first[0])
_torch.set_num_threads(_first[1])
_os.chdir(PATH)
del _os, _sys, _torch, _plt, _dist, _first
"""


@pytest.fixture(scope="module")
def notebook_runs(request):
    """{notebook name: None, or the error of its run}: each notebook whose test was chosen
    run top to bottom at the quick size its parameters cell defines (a reader's run keeps
    the size it picks), in two kernels, each running its half of the notebooks one after
    another, every one from _FRESH's clean slate: a fresh kernel per notebook spent about 6 s
    starting, importing torch and starting the ranks' fork server, most of a quick run. A
    notebook that fails leaves its kernel to be replaced. Nothing in a notebook asserts a
    timing. Kernels are stopped at once when their last cell has run."""
    import concurrent.futures
    import nbformat
    from nbclient import NotebookClient
    env = {**os.environ, "MINIDIST_NB_SIZE": "quick", "MINIDIST_QUICK": "1"}

    def run(nbs):
        out, todo = {}, list(nbs)
        while todo:
            client = NotebookClient(nbformat.read(todo[0], as_version=4), timeout=600, kernel_name="python3",
                                    shutdown_kernel="immediate", resources={"metadata": {"path": str(todo[0].parent)}})
            with client.setup_kernel(env=env):
                while todo:
                    nb = todo.pop(0)
                    client.nb = book = nbformat.read(nb, as_version=4)
                    try:
                        client.execute_cell(nbformat.v4.new_code_cell(_FRESH.replace("PATH", repr(str(nb.parent)))), 0)
                        for i, cell in enumerate(book.cells):
                            client.execute_cell(cell, i)
                        out[nb.name] = None
                    except Exception as e:  # noqa: BLE001 - handed to the notebook's own test
                        out[nb.name] = e
                        break  # the rest in a fresh kernel: this one may be dead or odd
        return out
    chosen = [nb for nb in NOTEBOOKS if any(nb.name in item.name for item in request.session.items
                                            if item.originalname == "test_notebook_runs_top_to_bottom")]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        halves = pool.map(run, [chosen[0::2], chosen[1::2]])
        return {name: e for half in halves for name, e in half.items()}


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_top_to_bottom(nb, notebook_runs):
    import nbformat
    book = nbformat.read(nb, as_version=4)
    # One cell, tagged "parameters" as papermill has it, holds the sizes
    params = [c for c in book.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1 and "quick" in params[0].source.lower(), "one parameters cell with a quick size"
    if notebook_runs[nb.name] is not None:
        raise notebook_runs[nb.name]


# The house, bottom to top. The basics (chapters 01-05, the cost model, the training library)
# are the ground; on them stand the idea folders, one per later chapter, which never import
# each other; the combining room (compose/) joins ideas; the workshop (run/, bench/,
# train_gpt) runs and measures them, and nothing below imports it. A module imports
# minidist modules only from the floors below its own; on its own floor, only what
# SAME_FLOOR declares, or its own package's modules. Names are dotted paths under minidist/
# ("zero.stage3" is minidist/zero/stage3.py, "zero" its __init__.py).
IDEAS = ("zero", "muon", "checkpoint", "memory", "tensor_parallel", "pipeline", "context_parallel", "experts")
FLOORS = {
    # run.launch and run.pool live in the workshop's folder but need only dist: anything may
    # start processes. minidist/launch.py is the public door to run.launch.
    "basics": {"dist", "files", "run.launch", "run.pool", "launch", "model", "data", "metrics", "comm", "comm_pipelined", "sync", "ddp", "scaler",
               "cost_model", "train"},
    "ideas": {p for i in IDEAS for p in (i, i + ".*")},
    "compose": {"compose", "compose.*"},
    "top": {"run", "run.*", "train_gpt", "bench", "bench.*"},  # the workshop; nothing imports it but itself
}
SAME_FLOOR = {  # module: what it may import on its own floor (besides its own package)
    "run.launch": {"dist"},
    "run.pool": {"run.launch", "dist"},  # dist: MINIDIST_TIMEOUT read as every run reads it
    "launch": {"run.launch"},
    "comm": {"dist", "comm_pipelined", "metrics"},  # metrics: Tallies, the counters count_bytes keeps
    "data": {"files"},
    "ddp": {"sync"},
    "cost_model": {"model"},
    "train": {"scaler"},
    "train_gpt": {"run", "run.*"},
    "bench": {"run.flags", "run.flag_types"},  # cpu_default reads AUTO, train_gpt's defaults
    "bench.*": {"run.flags", "run.flag_types"},  # AUTO, train_gpt's defaults, the flags' types; never train_gpt itself
}
ORDER = list(FLOORS)


def _module_name(path):
    parts = list(path.relative_to(ROOT / "minidist").with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _match(name, patterns):
    return any(name == p or (p.endswith(".*") and name.startswith(p[:-1])) for p in patterns)


def _floor(name):
    return next((f for f, names in FLOORS.items() if _match(name, names)), None)


def _minidist_imports(path):
    """The minidist modules `path` imports (anywhere in it, lazy imports included), as
    dotted names under minidist/; `from minidist.x import y` counts minidist.x.y when y is
    a module, else minidist.x."""
    names = {_module_name(p) for p in MODULES}
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name[len("minidist."):] for a in node.names if a.name.startswith("minidist.")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from . import x, from .layout import y
                base = package.split(".")[:len(package.split(".")) - node.level + 1] if package else []
                module = ".".join(base + ([node.module] if node.module else []))
            elif node.module == "minidist" or (node.module or "").startswith("minidist."):
                module = node.module[len("minidist."):] if node.module != "minidist" else ""
            else:
                continue
            for a in node.names:
                sub = f"{module}.{a.name}" if module else a.name
                found.add(sub if sub in names else module)
    return found - {""}


@pytest.mark.parametrize("mod", MODULES, ids=lambda p: str(p.relative_to(ROOT / "minidist")))
def test_modules_are_readable_and_layered(mod):
    name = _module_name(mod)
    if not name:  # minidist/__init__.py
        return
    src = mod.read_text()
    assert len(src.splitlines()) <= 300, f"{mod.name} is over 300 lines: split it by concept"
    if mod.name != "__init__.py":
        doc = ast.get_docstring(ast.parse(src)) or ""
        m = re.search(r"Chapter (\d\d)", doc)
        assert m, f"{mod.name}'s docstring must name its chapter"
        assert 1 <= int(m.group(1)) <= 13, "the curriculum has chapters 01 to 13"
    floor = _floor(name)
    assert floor, (f"minidist/{mod.relative_to(ROOT / 'minidist')} is on no floor: add {name!r} to FLOORS in "
                   f"tests/test_frames.py ({', '.join(ORDER)}), and to SAME_FLOOR what it may import on its own floor")
    allowed = set().union(*(v for k, v in SAME_FLOOR.items() if _match(name, {k})))
    package = name.partition(".")[0] if _floor(name.partition(".")[0]) == floor else None
    for dep in sorted(_minidist_imports(mod)):
        dep_floor = _floor(dep)
        assert dep_floor, f"{name} imports minidist.{dep}, which is on no floor"
        same_package = package is not None and dep.partition(".")[0] == package
        ok = ORDER.index(dep_floor) < ORDER.index(floor) or (
            dep_floor == floor and (_match(dep, allowed) or same_package))
        assert ok, (f"minidist.{name} (floor {floor!r}) imports minidist.{dep} (floor {dep_floor!r}): "
                    f"imports go down the floors; move the shared piece lower, or declare the edge in "
                    f"SAME_FLOOR if both belong on one floor")
    imports = {n.module for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ImportFrom) and n.module}
    imports |= {a.name for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Import) for a in n.names}
    # torch's own parallel wrappers are oracles for tests and benchmarks (which compare with
    # them in the same run), never building blocks of a technique
    if not name.startswith("bench"):
        assert not any(i.startswith("torch") and re.search(r"parallel|fsdp|ZeroRedundancy|distributed\.tensor", i)
                       for i in imports), imports


def test_layered_imports_have_no_cycles():
    graph = {_module_name(p): _minidist_imports(p) for p in MODULES}
    state = {}  # name -> "open" while on the path, "done" after

    def visit(node, path):
        state[node] = "open"
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                cycle = path[path.index(dep):] + [dep]
                pytest.fail("import cycle: " + " -> ".join(f"minidist.{n}" for n in cycle))
            if dep not in state:
                visit(dep, path + [dep])
        state[node] = "done"
    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_the_book_is_the_plain_forms_in_chapter_order_and_small():
    """minidist.BOOK: one plain form per chapter, in reading order, 2,500 lines in all."""
    from pathlib import Path

    from minidist import BOOK
    chapters, total = [], 0
    for name in BOOK:
        module = importlib.import_module(name)
        m = re.search(r"Chapter (\d\d)", module.__doc__ or "")
        assert m, f"{name}'s docstring must name its chapter"
        chapters.append(int(m.group(1)))
        total += len(Path(module.__file__).read_text().splitlines())
    assert chapters == sorted(set(chapters)), f"BOOK is not in chapter order, one module each: {chapters}"
    assert total <= 2500, f"the book is {total} lines, over 2,500: move what is not the plain idea out"
