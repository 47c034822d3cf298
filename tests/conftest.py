"""Shared test setup: a private data cache, so tests never touch ~/.cache/minidist, and
helpers to run commands the way a user would."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Set at import time, so processes the tests start (launch, torchrun) inherit it too.
os.environ.setdefault("MINIDIST_DATA", tempfile.mkdtemp(prefix="minidist-test-data-"))
os.environ.setdefault("MINIDIST_TIMEOUT", "120")


def run(cmd, timeout=300, env=None, **kw):
    """Run a shell command from the repository root; return the CompletedProcess."""
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, shell=isinstance(cmd, str), **kw)


@pytest.fixture
def python():
    return sys.executable
