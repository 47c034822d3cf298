"""Benchmarks as programs: `python -m minidist.bench NAME|all` (minidist/bench/__main__.py).
Chapter 08 (chapters/08_at_scale.md) gathers them; each file is one benchmark and names
its own chapter: collectives.py (02), ddp.py (03), zero.py (06), muon.py and muon_zero.py
(07), checksums.py and scale.py (08); report.py writes the report of `all`. Importing this package imports
none of them.
"""

from minidist.run.flags import AUTO
from minidist.model import PRESETS


def cpu_default(quick: bool) -> tuple[dict, int, int, int]:
    """(model config, global batch, timing rounds, steps per round) of the benchmarks that
    time training steps: train_gpt's default CPU model (tiny preset, vocabulary 2048) and
    batch, 8 rounds of 2 steps; --quick (a smoke test): 2 layers 64 wide, 8 sequences, 1
    round of 1 step (after Timer's two warm-up steps: minidist/bench/timing.py)."""
    cfg = dict(PRESETS["tiny"], vocab_size=2048)
    if quick:
        return {**cfg, "n_layer": 2, "n_embd": 64, "n_head": 2}, 8, 1, 1
    return cfg, AUTO["cpu"]["batch_size"], 8, 2
