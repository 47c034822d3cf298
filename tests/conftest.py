"""Shared test setup: a private data cache, so tests never touch ~/.cache/minidist,
helpers to run commands the way a user would, and `pool`: process groups that many tests
share (tests/helpers.py holds the tiny model, batches and oracles)."""

import multiprocessing.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Set at import time, so processes the tests start (launch, torchrun, notebook kernels)
# inherit them. Whatever this session's processes put in the temp folder (pytest's
# tmp_path, the data cache, multiprocessing's and torchrun's scratch folders, a killed
# kernel's) goes in one folder of its own, removed at the end.
_OWN_TMP = tempfile.mkdtemp(prefix="minidist-test-")
os.environ["TMPDIR"] = tempfile.tempdir = _OWN_TMP
os.environ.setdefault("MINIDIST_DATA", os.path.join(_OWN_TMP, "data"))
os.environ.setdefault("MINIDIST_TIMEOUT", "120")
# Removed as this process exits, after multiprocessing has removed its own scratch folder
# in it (that finalizer runs at exit priority -100; lower runs later).
multiprocessing.util.Finalize(None, shutil.rmtree, args=(_OWN_TMP,), kwargs={"ignore_errors": True},
                              exitpriority=-101)


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
