"""The notebooks are stored with the outputs of a run of their current code.

Cheap: nothing is executed here (tests/test_frames.py executes every notebook from scratch
at its quick size and trusts no stored output). This checks what a reader browsing the
repository sees: every code cell executed, outputs present, the hash of the code cells
stored by scripts/run_notebooks.py equal to the hash of the code as it is now, no machine
paths, images and files within their size limits. The script defines the hash and the
checks (code_hash, check_notebook, check_stored); this test imports them from it.
"""

import base64
import importlib.util

import nbformat
import pytest

from conftest import ROOT

_spec = importlib.util.spec_from_file_location("run_notebooks", ROOT / "scripts" / "run_notebooks.py")
run_notebooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_notebooks)

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_stored_with_outputs_of_its_code(nb):
    problems = run_notebooks.check_stored(nb)
    assert not problems, "\n".join(problems)


def test_chapter_figures_are_small():
    problems = run_notebooks.check_figures()
    assert not problems, "\n".join(problems)


# ---- the checker itself, on a notebook built here ----

def _stored_notebook():
    """A two-cell notebook as run_notebooks stores it: executed, with outputs and its hash."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# A notebook"),
                nbformat.v4.new_code_cell("x = 6 * 7\nprint(x)", execution_count=1,
                                          outputs=[nbformat.v4.new_output("stream", name="stdout", text="42\n")]),
                nbformat.v4.new_code_cell("   \n"),  # empty: never executed, and fine
                nbformat.v4.new_code_cell("x", execution_count=2,
                                          outputs=[nbformat.v4.new_output("execute_result", {"text/plain": "42"},
                                                                          execution_count=2)])]
    nb.metadata["minidist"] = {"code_sha256": run_notebooks.code_hash(nb), "run_seconds": 1,
                               "machine": "CPU, 2 cores, torch 2", "executed": "2026-12-01"}
    return nb


def test_checker_passes_a_stored_notebook_and_catches_each_fault():
    name = "notebooks/00_demo.ipynb"
    assert run_notebooks.check_notebook(_stored_notebook(), name) == []

    nb = _stored_notebook()  # a cell stored without having run
    nb.cells[3].execution_count, nb.cells[3].outputs = None, []
    assert any("cell 3 not executed" in p for p in run_notebooks.check_notebook(nb, name))

    nb = _stored_notebook()  # no output anywhere
    for cell in nb.cells[1:]:
        cell.outputs = []
    assert any("no outputs" in p for p in run_notebooks.check_notebook(nb, name))

    nb = _stored_notebook()  # code edited after the stored run
    nb.cells[1].source = "x = 6 * 9\nprint(x)"
    problems = run_notebooks.check_notebook(nb, name)
    assert f"{name}: code changed since its stored run: run python scripts/run_notebooks.py {name}" in problems

    nb = _stored_notebook()  # markdown and trailing whitespace are not code: same hash
    nb.cells[0].source = "# Another title"
    nb.cells[1].source += "\n\n"
    assert run_notebooks.check_notebook(nb, name) == []

    nb = _stored_notebook()  # never stored by the script
    del nb.metadata["minidist"]
    assert any("not stored" in p for p in run_notebooks.check_notebook(nb, name))

    for path in (f"{ROOT}/minidist/model.py", "/home/someone/minidist", "/tmp/tmpx1y2z3/data.bin",
                 "[/__w/pytorch/pytorch/third_party/gloo/unbound_buffer.cc:78]", "/opt/x/y.py",
                 "/srv/builds/7/lib.so", "C:\\Users\\me\\nb.py", "D:\\a\\b"):
        nb = _stored_notebook()
        nb.cells[1].outputs[0].text = f"wrote {path}\n"
        problems = run_notebooks.check_notebook(nb, name)
        assert any("machine path" in p and "cell 1" in p for p in problems), (path, problems)
    # slashes that are not paths on a machine
    nb = _stored_notebook()
    nb.cells[1].outputs[0].text = ("12,000 tokens/s, ours/torch 0.9, 1/beta, (p-1)/(m+p-1), 2/3/4, "
                                   "https://github.com/a/b, <repo>/chapters/x.md, <tmp>/...\n")
    nb.metadata["minidist"]["code_sha256"] = run_notebooks.code_hash(nb)
    assert run_notebooks.check_notebook(nb, name) == []

    nb = _stored_notebook()  # an image over the limit
    big = base64.b64encode(b"\x89PNG" + bytes(run_notebooks.MAX_IMAGE_BYTES)).decode()
    nb.cells[3].outputs = [nbformat.v4.new_output("display_data", {"image/png": big, "text/plain": "<Figure>"})]
    assert any("image/png" in p and "cell 3" in p for p in run_notebooks.check_notebook(nb, name))


def test_cleaning_removes_paths_timestamps_and_warnings():
    nb = _stored_notebook()
    cell = nb.cells[1]
    cell.metadata["execution"] = {"iopub.status.busy": "2026-12-01T00:00:00Z"}
    cell.execution_count = 5
    cell.outputs.append(nbformat.v4.new_output(
        "stream", name="stderr",
        text=f"{ROOT}/minidist/x.py:3: UserWarning: noisy\n  warnings.warn('noisy')\nkept line\n"))
    cell.outputs[0].text = (f"saved to {ROOT}/chapters/figures/a.png\n"
                            "[/__w/pytorch/third_party/gloo/unbound_buffer.cc:78] Timed out\n")
    run_notebooks.clean(nb)
    assert "execution" not in cell.metadata
    assert [c.execution_count for c in nb.cells if c.cell_type == "code"] == [1, None, 2]
    assert cell.outputs[0].text == ("saved to <repo>/chapters/figures/a.png\n"
                                    "[<path>/unbound_buffer.cc:78] Timed out\n")
    assert cell.outputs[1].text == "kept line\n"
    nb.metadata["minidist"]["code_sha256"] = run_notebooks.code_hash(nb)
    assert run_notebooks.check_notebook(nb, "notebooks/00_demo.ipynb") == []


def test_oversized_notebook_file_is_reported(tmp_path):
    nb = _stored_notebook()
    nb.cells[1].outputs[0].text = "x" * (run_notebooks.MAX_NOTEBOOK_BYTES + 1)
    path = tmp_path / "00_demo.ipynb"
    nbformat.write(nb, path)
    assert any("MB on disk" in p for p in run_notebooks.check_stored(path))


def test_provenance_names_the_run_and_keeps_every_text_output():
    nb = _stored_notebook()
    text = run_notebooks.provenance(nb, "notebooks/00_demo.ipynb", "1.5", "2.0")
    assert text.startswith("# python scripts/run_notebooks.py notebooks/00_demo.ipynb")
    assert 'machine "CPU, 2 cores, torch 2"' in text and "executed 2026-12-01" in text
    assert "load average (1 minute) 1.5 before the run, 2.0 after it" in text
    assert "--- cell 1\n42\n--- cell 3\n42\n" in text  # numbered as in the notebook
