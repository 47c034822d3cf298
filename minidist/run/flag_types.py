"""The types of train_gpt's flags: each number's range checked where argparse reads it.
Chapter 01 (chapters/01_gpt.md) introduces the run and its flags (minidist/run/flags.py).
Exercised by `pytest tests/test_reliability.py`.
"""

from __future__ import annotations

import argparse
import math


# ---- every number a flag takes, checked where argparse reads it ---------------------------
# A type is a function from the command line's string to a value; one that raises
# ArgumentTypeError makes argparse exit 2 with "argument --FLAG: <its message>". So each
# flag's range lives beside the flag, and nan, inf, a negative count or a seed beyond 64
# bits never reaches the run.

def number(kind, low=None, high=None, *, low_open=False, high_open=False, inf_ok=False,
           what: str):
    """An argparse type: `kind` (int or float) in [low, high] (open ends where asked),
    finite unless `inf_ok`; `what` says in words what is expected."""
    def parse(text: str):
        try:
            value = kind(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if (kind is float and (math.isnan(value) or (math.isinf(value) and not inf_ok))) \
                or (low is not None and (value < low or (low_open and value == low))) \
                or (high is not None and (value > high or (high_open and value == high))):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value
    parse.__name__ = what  # what argparse's own messages call it
    return parse


positive_int = number(int, 1, what="an integer >= 1")
nonneg_int = number(int, 0, what="an integer >= 0")
positive_float = number(float, 0, low_open=True, what="a finite number > 0")
nonneg_float = number(float, 0, what="a finite number >= 0")
below_one = number(float, 0, 1, high_open=True, what="a number in [0, 1)")
up_to_one = number(float, 0, 1, what="a number in [0, 1]")
seed_int = number(int, 0, 2**63 - 1, what="an integer in [0, 2**63)")  # torch and numpy take it
mib = number(float, 0, inf_ok=True, what="a number of MiB >= 0 (inf: one bucket)")
# the first loss scale: at least 1, and a float32 (the scale's dtype, as GradScaler's) that is finite
loss_scale = number(float, 1.0, 3.4028234663852886e38, what="a number from 1 to fp32's largest, 3.4e38 (65536 is usual)")


def folder_name(text: str) -> str:
    """A folder's name: not empty (an empty one would write into the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: name a folder, e.g. --out-dir out")
    return text


def or_auto(kind):
    """`kind`, or the word auto (the planner decides)."""
    def parse(text: str):
        if text == "auto":
            return text
        try:
            return kind(text)
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{e} (or auto)") from None
    parse.__name__ = f"{kind.__name__} or auto"
    return parse


def int_or_auto(s: str):
    if s == "auto":
        return s
    try:
        return int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be 0, 1, 2, 3 or auto, got {s!r}") from None
