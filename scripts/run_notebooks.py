"""Run the notebooks at a reader's size and store them with their outputs.

    python scripts/run_notebooks.py                      # every notebooks/*.ipynb
    python scripts/run_notebooks.py notebooks/06_zero.ipynb
    python scripts/run_notebooks.py --changed            # only those whose code changed

Each notebook runs top to bottom (kernel python3, working directory notebooks/) with
MINIDIST_FIGURES=1, so notebooks/nbfigures.save_figure writes the chapters' figures, and
without MINIDIST_NB_SIZE / MINIDIST_QUICK, so the "parameters" cell picks the reader's
size, not the tests' quick one. The outputs are then cleaned (this machine's folders
replaced by <repo>, ~, <tmp>, <python>, any other absolute path by <path>/its file name,
warnings dropped from stderr, execution timestamps removed, execution counts
1, 2, 3...) and the notebook is written back with, in notebook.metadata["minidist"], the
hash of its code cells (code_hash), the run's wall time, the machine and the UTC day.
Its text outputs go to chapters/measurements/NN_notebook.txt, with the command, the day,
the machine and the load average before and after the run: the source of every number a
chapter quotes from its notebook.

A cell that raises stops the notebook, which is then not written; the script names the
notebook and the cell and exits with status 1. So does a stored notebook or figure over
the size limits, or an absolute path left in an output.

tests/test_stored_notebooks.py imports this file for code_hash and check_stored, so that
what the test checks and what this script writes are defined once, here.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import hashlib
import json
import os
import pathlib
import re
import sys
import sysconfig
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
FIGURES = ROOT / "chapters" / "figures"
MAX_IMAGE_BYTES = 200_000  # one image output or one chapters/figures/*.png, decoded
MAX_NOTEBOOK_BYTES = 1_500_000  # one stored .ipynb file
UNSET = ("MINIDIST_NB_SIZE", "MINIDIST_QUICK")  # the tests' quick size; a reader's run has neither
TEXT_MIMES = ("text/plain", "text/html", "text/markdown", "text/latex", "image/svg+xml")


# ---- the code hash: what "the code that produced these outputs" means, defined once ----

def _code_sources(nb) -> list[str]:
    """The canonical form of a notebook's code: the source of every code cell, in order,
    with line endings as "\\n" and trailing whitespace at the cell's end removed; empty
    code cells (only whitespace) are left out. Markdown cells and outputs are not code."""
    sources = []
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        src = cell["source"]
        src = "".join(src) if isinstance(src, list) else src
        src = src.replace("\r\n", "\n").replace("\r", "\n").rstrip()
        if src:
            sources.append(src)
    return sources


def code_hash(nb) -> str:
    """sha256 (hex) of the UTF-8 JSON list of the canonical code-cell sources
    (_code_sources): json.dumps(sources, ensure_ascii=False, separators=(",", ":"))."""
    text = json.dumps(_code_sources(nb), ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# ---- machine paths ----

def _machine_roots() -> list[tuple[str, str]]:
    """(absolute path on this machine, neutral text), longest path first."""
    roots = {str(ROOT): "<repo>", str(pathlib.Path.home()): "~",
             tempfile.gettempdir(): "<tmp>", "/tmp": "<tmp>",
             **{sysconfig.get_path(k): "<python>" for k in ("purelib", "platlib", "stdlib")}}
    roots = {p.rstrip("/"): t for p, t in roots.items() if p and p.rstrip("/") not in ("", "/")}
    return sorted(roots.items(), key=lambda kv: -len(kv[0]))


# Any absolute path, on any machine: this one's folders (above) and others', such as the
# folder a library was built in that its error messages quote ("[/__w/pytorch/.../x.cc:78]").
# Two components at least ("/a/b"), starting where no word, dot, slash, colon or
# placeholder runs into it: "tokens/s", "1/beta", "(p-1)/(m+p-1)", "https://host/x" and
# "<repo>/chapters" are not paths on a machine. Windows: a drive letter and a backslash.
_ANY_PATH = re.compile(r"(?<![\w.<>~:/\\-])/[\w.@+-]+/[^\s'\"\]\[(){}<>,;]*"
                       r"|(?<![\w])[A-Za-z]:\\[^\s'\"]+")


def find_paths(text: str) -> list[str]:
    """Absolute paths in `text`: this machine's repository, home, temp and python folders,
    and any other absolute path (_ANY_PATH)."""
    found = [p for p, _ in _machine_roots() if re.search(re.escape(p) + r"(?![\w-])", text)]
    found += _ANY_PATH.findall(text)
    return sorted(set(found))


def _neutral(text: str) -> str:
    for path, token in _machine_roots():
        text = re.sub(re.escape(path) + r"(?![\w-])", token, text)
    # a temp folder's random name carries no information: /tmp/tmpab12cd/x -> <tmp>/x
    text = re.sub(r"<tmp>/(tmp|pymp-|minidist-)[\w.-]*", "<tmp>/...", text)
    # another machine's folder (where torch was built, say): only the file's name says anything
    return _ANY_PATH.sub(lambda m: "<path>/" + re.split(r"[/\\]", m.group(0).rstrip("/\\"))[-1], text)


# ---- the checks on a stored notebook (this script runs them before writing; the test after) ----

def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else str(value)


def _output_texts(out):
    if out.get("output_type") == "stream":
        yield _text(out.get("text", ""))
    elif out.get("output_type") == "error":
        yield "\n".join(out.get("traceback", [])) + out.get("evalue", "")
    for mime, value in out.get("data", {}).items():
        if mime in TEXT_MIMES or mime.startswith("text/"):
            yield _text(value)


def check_notebook(nb, name: str) -> list[str]:
    """What is wrong with `nb` as a stored notebook (its name in messages): no stored run,
    code changed since it, a code cell not executed, no output, an error output, a machine
    path in an output, an image over MAX_IMAGE_BYTES. Empty when it is fine."""
    problems = []
    stored = nb.get("metadata", {}).get("minidist")
    rerun = f"run python scripts/run_notebooks.py {name}"
    if not stored:
        problems.append(f"{name}: not stored with outputs (no metadata 'minidist'): {rerun}")
    elif stored.get("code_sha256") != code_hash(nb):
        problems.append(f"{name}: code changed since its stored run: {rerun}")
    n_outputs, not_run = 0, []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        if _text(cell["source"]).strip() and cell.get("execution_count") is None:
            not_run.append(str(i))
        for out in cell.get("outputs", []):
            n_outputs += 1
            if out.get("output_type") == "error" and "raises-exception" not in cell.get("metadata", {}).get("tags", []):
                problems.append(f"{name}: cell {i} stores an error ({out.get('ename')}: {out.get('evalue')})")
            for text in _output_texts(out):
                for path in find_paths(text):
                    problems.append(f"{name}: cell {i} shows a machine path in its output: {path}")
            for mime, value in out.get("data", {}).items():
                if mime.startswith("image/") and mime != "image/svg+xml":
                    size = len(base64.b64decode(_text(value)))
                    if size > MAX_IMAGE_BYTES:
                        problems.append(f"{name}: cell {i} has a {mime} of {size / 1e3:.0f} kB "
                                        f"(limit {MAX_IMAGE_BYTES / 1e3:.0f} kB): lower its figsize or dpi")
    if not_run:
        problems.append(f"{name}: cell{'s' * (len(not_run) > 1)} {', '.join(not_run)} not executed: {rerun}")
    if n_outputs == 0:
        problems.append(f"{name}: no outputs at all: {rerun}")
    return problems


def _name(path) -> str:
    """notebooks/NN_name.ipynb for a notebook in the repository, else the file's name."""
    path = pathlib.Path(path).resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name


def check_stored(path) -> list[str]:
    """check_notebook on the file at `path`, plus its size against MAX_NOTEBOOK_BYTES."""
    path = pathlib.Path(path)
    name = _name(path)
    problems = check_notebook(json.loads(path.read_text(encoding="utf-8")), name)
    size = path.stat().st_size
    if size > MAX_NOTEBOOK_BYTES:
        problems.append(f"{name}: {size / 1e6:.2f} MB on disk (limit {MAX_NOTEBOOK_BYTES / 1e6:.1f} MB): "
                        "fewer or smaller images, shorter prints")
    return problems


def check_figures(folder=FIGURES) -> list[str]:
    """chapters/figures/*.png over MAX_IMAGE_BYTES."""
    return [f"chapters/figures/{p.name}: {p.stat().st_size / 1e3:.0f} kB (limit {MAX_IMAGE_BYTES / 1e3:.0f} kB)"
            for p in sorted(pathlib.Path(folder).glob("*.png")) if p.stat().st_size > MAX_IMAGE_BYTES]


def needs_run(path) -> bool:
    """--changed: no stored run, code changed since it, or outputs missing."""
    nb = json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
    stored = nb.get("metadata", {}).get("minidist") or {}
    if stored.get("code_sha256") != code_hash(nb):
        return True
    return any(p for p in check_notebook(nb, "") if "not executed" in p or "no outputs" in p)


# ---- cleaning the outputs of a fresh run ----

# "file.py:12: UserWarning: ..." and its indented source line; torch's C++ log lines
# ("[W1201 00:12:33.123 file.cpp:45] Warning: ..."); gloo's connection chatter.
_WARNING = re.compile(r"^\S.*:\d+: \w*Warning: ")
_NOISE = re.compile(r"^(\[[WI]\d{4} [\d:.]+ .*\]|\[Gloo\] |.*\bWarning: )")


def _strip_warnings(text: str) -> str:
    kept, in_warning = [], False
    for line in text.splitlines(keepends=True):
        if _WARNING.match(line) or _NOISE.match(line):
            in_warning = True
            continue
        if in_warning and line[:1] in (" ", "\t"):
            continue  # the warning's source line
        in_warning = False
        kept.append(line)
    return "".join(kept)


def clean(nb) -> None:
    """In place: drop warnings from stderr, replace machine paths, drop execution
    timestamps, number the executed cells 1, 2, 3... in order."""
    count = 0
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type != "code":
            continue
        outputs = []
        for out in cell.outputs:
            if out.output_type == "stream":
                text = _text(out.text)
                if out.name == "stderr":
                    text = _strip_warnings(text)
                out.text = _neutral(text)
                if not out.text:
                    continue
            for mime in list(out.get("data", {})):
                if mime in TEXT_MIMES or mime.startswith("text/"):
                    out.data[mime] = _neutral(_text(out.data[mime]))
            if out.output_type == "error":
                out.traceback = [_neutral(t) for t in out.traceback]
            outputs.append(out)
        cell.outputs = outputs
        if cell.get("execution_count") is not None:
            count += 1
            cell.execution_count = count
            for out in cell.outputs:
                if out.output_type == "execute_result":
                    out.execution_count = count
    nb.metadata.pop("papermill", None)
    nb.metadata.get("widgets", {}).clear()


def machine() -> str:
    """A short description of this machine: 'CPU, 2 cores, torch 2.13.0', with the GPU's
    name when CUDA is available."""
    import torch
    parts = ["CPU", f"{os.cpu_count()} cores", f"torch {torch.__version__.split('+')[0]}"]
    if torch.cuda.is_available():
        parts[0] = torch.cuda.get_device_name(0)
        parts[1] = f"{os.cpu_count()} CPU cores"
    return ", ".join(parts)


# ---- running ----

class NotebookFailed(Exception):
    pass


MEASUREMENTS = ROOT / "chapters" / "measurements"


def _load() -> str:
    try:
        return "{:.1f}".format(os.getloadavg()[0])
    except (AttributeError, OSError):  # no load average on this system
        return "unknown"


def provenance(nb, name: str, load_before: str, load_after: str) -> str:
    """The text of chapters/measurements/NN_notebook.txt for a stored notebook: how it was
    run (command, day, machine, torch, seconds, load) and every text output, by code cell,
    so that a number a chapter quotes from the notebook's run has its source beside it."""
    meta = nb.metadata["minidist"]
    nn = pathlib.Path(name).stem.split("_")[0]
    lines = [f"# python scripts/run_notebooks.py {name}   (the stored notebook, at the size it picks by itself)",
             f"# stored run: executed {meta['executed']} (UTC), machine \"{meta['machine']}\", "
             f"run_seconds {meta['run_seconds']}, code_sha256 {meta['code_sha256'][:16]}...",
             f"# conditions: load average (1 minute) {load_before} before the run, {load_after} after it; "
             f"chapter {nn} quotes these outputs as \"(notebook {nn}, stored run)\"",
             "# below: every text output of the stored notebook, by code cell (figures left out); "
             "written by scripts/run_notebooks.py", ""]
    for index, cell in enumerate(nb.cells):  # numbered as in the notebook, markdown included
        if cell.cell_type != "code":
            continue
        texts = []
        for out in cell.outputs:
            if out.output_type == "stream":
                texts.append(_text(out.text))
            elif out.output_type in ("execute_result", "display_data") and not any(
                    m.startswith("image/") for m in out.get("data", {})):
                texts.append(_text(out.get("data", {}).get("text/plain", "")) + "\n")
            elif out.output_type == "error":
                texts.append(f"{out.ename}: {out.evalue}\n")
        if texts:
            lines.append(f"--- cell {index}")
            lines.append("".join(texts).rstrip("\n"))
    return "\n".join(lines) + "\n"


def run_one(path: pathlib.Path, timeout: int, host: str) -> tuple[float, int]:
    """Execute, clean, check and write back one notebook, and its outputs to
    chapters/measurements/NN_notebook.txt; return (seconds, bytes)."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError

    name = _name(path)
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    start, load_before = time.perf_counter(), _load()
    try:
        client.execute()
    except (CellExecutionError, CellTimeoutError) as e:
        failed = next((i for i, c in enumerate(nb.cells) if c.cell_type == "code"
                       and any(o.output_type == "error" for o in c.get("outputs", []))), None)
        where = f"cell {failed}" if failed is not None else "a cell"
        first = str(e).strip().splitlines()
        raise NotebookFailed(f"{name}: {where} failed ({type(e).__name__}); not written.\n"
                             + "\n".join(first[-25:])) from None
    seconds = time.perf_counter() - start
    clean(nb)
    nb.metadata["minidist"] = {
        "code_sha256": code_hash(nb),
        "run_seconds": round(seconds),
        "machine": host,
        "executed": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
    }
    text = nbformat.writes(nb)
    if not text.endswith("\n"):
        text += "\n"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    problems = check_stored(tmp)
    problems = [p.replace(_name(tmp), name) for p in problems]
    if problems:
        tmp.unlink()
        raise NotebookFailed("\n".join(problems) + f"\n{name}: not written")
    os.replace(tmp, path)
    if path.resolve().parent == NOTEBOOKS:
        MEASUREMENTS.mkdir(parents=True, exist_ok=True)
        (MEASUREMENTS / f"{path.stem.split('_')[0]}_notebook.txt").write_text(
            provenance(nb, name, load_before, _load()), encoding="utf-8")
    return seconds, len(text.encode("utf-8"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=pathlib.Path,
                        help="notebooks to run (default: every notebooks/*.ipynb)")
    parser.add_argument("--changed", action="store_true",
                        help="only those with no stored run, no outputs, or code changed since")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per cell (default 1800)")
    args = parser.parse_args(argv)
    paths = args.notebooks or sorted(NOTEBOOKS.glob("*.ipynb"))
    for p in paths:
        if not p.is_file() or p.suffix != ".ipynb":
            parser.error(f"no notebook {p}")
    if args.changed:
        paths = [p for p in paths if needs_run(p)]
        if not paths:
            print("every notebook is stored with outputs of its current code")
            return 0
    # The kernel inherits this environment: the reader's size, figures written.
    os.environ["MINIDIST_FIGURES"] = "1"
    for var in UNSET:
        os.environ.pop(var, None)
    host = machine()
    failures = []
    for p in paths:
        try:
            seconds, size = run_one(p, args.timeout, host)
        except NotebookFailed as e:
            failures.append(str(e))
            print(f"FAILED {p.name}\n{e}", file=sys.stderr, flush=True)
            continue
        print(f"{p.name:28s} {seconds:7.0f} s {size / 1e3:8.1f} kB  ({host})", flush=True)
    figures = check_figures()
    for problem in figures:
        print(f"FAILED {problem}", file=sys.stderr)
    return 1 if failures or figures else 0


if __name__ == "__main__":
    sys.exit(main())
