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
    finite unless `inf_ok`; `what` says in words what is expected. Its `low` and `high`
    stay on it, for the tests that hold every flag to a range."""
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
    parse.low, parse.high = low, high
    return parse


# unbounded counts and sizes, for the planners' command lines (minidist/run/plan.py) and the benchmarks
positive_int = number(int, 1, what="an integer >= 1")
positive_float = number(float, 0, low_open=True, what="a finite number > 0")
below_one = number(float, 0, 1, high_open=True, what="a number in [0, 1)")
up_to_one = number(float, 0, 1, what="a number in [0, 1]")
seed_int = number(int, 0, 2**63 - 1, what="an integer in [0, 2**63)")  # torch and numpy take it
mib = number(float, 0, math.inf, inf_ok=True, what="a number of MiB >= 0 (inf: one bucket)")
# the first loss scale: at least 1, and a float32 (the scale's dtype, as GradScaler's) that is finite
loss_scale = number(float, 1.0, 3.4028234663852886e38, what="a number from 1 to fp32's largest, 3.4e38 (65536 is usual)")


# ---- train_gpt's counts and sizes: each with the largest value a run can use ------------
# An unbounded count starts and then fails: --batch-size 10**11 is a list of 10**11 window
# ids at the first step (MemoryError), --steps 10**12 never ends. Each bound is far above
# the largest run there is, so it refuses only what no run can use.

def count(low: int, high: int, of: str):
    return number(int, low, high, what=f"an integer >= {low}, at most {high} ({of})")


def amount(high: float, of: str, low_open: bool = False):
    top = int(high) if high == int(high) and high < 1e15 else high  # 1000000, not 1e+06
    return number(float, 0, high, low_open=low_open,
                  what=f"a finite number {'>' if low_open else '>='} 0, at most {top} ({of})")


STEPS = 10**9                # a billion optimizer steps: years of any run
SEQUENCES = 2**20            # a million sequences a batch: GPT-3's was about 1,600 of 2,048 tokens
layers = count(1, 1024, "blocks")        # the deepest models have about 100
heads = count(1, 1024, "heads")          # also --tp, which splits the heads
width = count(1, 65536, "model width")   # the widest have about 25,000
tokens = count(1, SEQUENCES, "tokens")   # --seq-len: the preset's context bounds it further
sequences = count(1, SEQUENCES, "sequences")
steps = count(1, STEPS, "steps")
steps_or_none = count(0, STEPS, "steps; 0: none")
windows = count(1, STEPS, "sequences")   # an evaluation takes at most all the split holds
checkpoints = count(1, 10**6, "checkpoints")
experts = count(1, 4096, "experts")      # DeepSeek-V3 has 256 routed experts a layer
experts_or_dense = count(0, 4096, "experts; 0: a dense GPT")
sample = count(0, 10**5, "tokens; 0: none")  # one forward per token, after the run
# (the top is far out on purpose: a learning rate that makes the loss non-finite is how the
# divergence handling is shown and tested; the bound refuses only what is not a number of use)
learning_rate = amount(1e30, "a learning rate; the usual are 1e-4 to 0.05", low_open=True)
decay = amount(100, "weight decay; the usual are 0 to 0.1")
clip = amount(1e6, "a gradient norm; 0: off")
budget_gb = amount(1e6, "GB per rank", low_open=True)
capacity = amount(1e3, "times an expert's even share; 1 to 2 is usual; 0: dropless")


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
    parse.low, parse.high = kind.low, kind.high
    return parse


def int_or_auto(s: str):
    if s == "auto":
        return s
    try:
        return int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be 0, 1, 2, 3 or auto, got {s!r}") from None
