"""Shared test setup: a private data cache, so tests never touch ~/.cache/minidist,
helpers to run commands the way a user would, `pool`: process groups that many tests
share (tests/helpers.py holds the tiny model, batches and oracles), and the notebooks'
runs, which go on in the background while the other tests run."""

import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Set at import time, so processes the tests start (launch, torchrun) inherit it too.
_OWN_DATA = None if "MINIDIST_DATA" in os.environ else tempfile.mkdtemp(prefix="minidist-test-data-")
os.environ.setdefault("MINIDIST_DATA", _OWN_DATA or "")
os.environ.setdefault("MINIDIST_TIMEOUT", "120")


def pytest_unconfigure(config):
    """The data cache this session made goes with it: a learner's temp folder does not fill."""
    if _OWN_DATA is not None:
        shutil.rmtree(_OWN_DATA, ignore_errors=True)


def run(cmd, timeout=300, env=None, **kw):
    """Run a shell command from the repository root; return the CompletedProcess."""
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, shell=isinstance(cmd, str), **kw)


@pytest.fixture
def python():
    return sys.executable


@pytest.fixture(scope="session")
def pool():
    """pool(n): the minidist.run.pool.Pool of n ranks this test session shares (the exercise
    grader takes its processes from the same place). `pool(2).run(fn, *args)` is
    `launch(fn, 2, *args)` without the process start: each call gets a new process group
    and a fresh process's RNG, environment and threads; a failed call restarts the pool.
    Functions that patch modules in the ranks, or kill them on purpose, keep launch."""
    from minidist.run.pool import shared_pool
    return shared_pool


class Notebooks:
    """Every notebook run top to bottom, each in its own kernel, at the quick size its
    parameters cell defines: one at a time from the end of collection, while the other
    tests run (most of them keep one core busy, a notebook the other), and two at a time
    once the notebook tests, put last, are reached. `outcomes()` waits: {name: None, or
    the error of its run}. The kernels get the environment as collection left it, not
    as a test running meanwhile may have changed it (e.g. RANK and WORLD_SIZE)."""

    def __init__(self, paths):
        self.env = {**os.environ, "MINIDIST_NB_SIZE": "quick", "MINIDIST_QUICK": "1"}
        self.todo, self.done, self.workers = queue.SimpleQueue(), {}, []
        for p in paths:
            self.todo.put(p)
        self._add_worker()

    def _add_worker(self):
        t = threading.Thread(target=self._work, daemon=True)  # daemon: an interrupted session does not wait
        t.start()
        self.workers.append(t)

    def _work(self):
        import nbformat
        from nbclient import NotebookClient
        while True:
            try:
                nb = self.todo.get_nowait()
            except queue.Empty:
                return
            try:  # stopped at once after the last cell: a graceful shutdown waits for nothing read here
                NotebookClient(nbformat.read(nb, as_version=4), timeout=600, kernel_name="python3",
                               shutdown_kernel="immediate",
                               resources={"metadata": {"path": str(nb.parent)}}).execute(env=self.env)
                self.done[nb.name] = None
            except Exception as e:  # noqa: BLE001 - handed to the notebook's own test
                self.done[nb.name] = e

    def outcomes(self):
        self._add_worker()
        for t in self.workers:
            t.join()
        return self.done


NOTEBOOK_RUNS = None  # the Notebooks of this session, when a notebook test was collected


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected what they will
def pytest_collection_modifyitems(session, config, items):
    global NOTEBOOK_RUNS
    runs = [i for i in items if "notebook_runs" in getattr(i, "fixturenames", ())]
    if runs and not config.option.collectonly:
        items[:] = [i for i in items if i not in runs] + runs  # last: their runs go on meanwhile
        chosen = {i.callspec.params["nb"] for i in runs if "nb" in getattr(getattr(i, "callspec", None), "params", {})}
        NOTEBOOK_RUNS = Notebooks(sorted(chosen))  # only the notebooks whose tests were chosen (-k)
