"""What minidist reads from the environment, checked like a flag: every variable's check in
ENVIRONMENT, run by train_gpt before any work (MINIDIST_TIMEOUT=abc would fail inside init,
a MINIDIST_FAULT for a rank or step the run lacks would never fire). Chapter 08
(chapters/08_at_scale.md). Exercised by `pytest tests/test_reliability.py tests/test_no_hang.py`.
"""

from __future__ import annotations

import os

from minidist.checkpoint import faults
from minidist.dist import default_timeout_s, env_device, env_world_size


def _env_folder(name: str) -> None:
    value = os.environ.get(name, "")
    if value and os.path.exists(value) and not os.path.isdir(value):
        raise ValueError(f"{name}={value!r} is a file, not a folder: set it to a folder, or unset it")


def _env_switch(name: str) -> None:
    if os.environ.get(name, "0") not in ("0", "1"):
        raise ValueError(f"{name}={os.environ[name]!r}: use 1 (on) or 0 (off), or unset it")


# name -> a check that returns the value or raises ValueError naming the variable
ENVIRONMENT = {
    "MINIDIST_TIMEOUT": default_timeout_s,
    "MINIDIST_FAULT": lambda: faults.parse_fault(os.environ.get("MINIDIST_FAULT")),
    "MINIDIST_DATA": lambda: _env_folder("MINIDIST_DATA"),  # the token cache
    "MINIDIST_DEVICE": env_device,
    "MINIDIST_FIGURES": lambda: _env_switch("MINIDIST_FIGURES"),  # bench ep: also the chapter's figure
    "WORLD_SIZE": env_world_size,
}


def check_environment(p, args, world_size: int) -> None:
    """Every environment variable minidist reads (ENVIRONMENT), checked before any work, and
    MINIDIST_FAULT against this run: one for a rank or step it lacks never fires."""
    try:
        for check in ENVIRONMENT.values():
            check()
        faults.check_fault(os.environ.get("MINIDIST_FAULT"), world_size, args.steps, args.checkpoint_every)
    except ValueError as e:
        p.error(str(e))
