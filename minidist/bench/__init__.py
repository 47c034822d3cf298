"""Benchmarks as programs: `python -m minidist.bench NAME|all` (minidist/bench/__main__.py).
Chapter 08 (chapters/08_at_scale.md) gathers them; each file is one benchmark and names
its own chapter: collectives.py (02), ddp.py (03), zero.py (06), muon.py and muon_zero.py
(07), tp.py (10), pp.py (11), cp.py and cp_model.py (12), checksums.py and scale.py (08);
report.py writes the report of `all`. Importing this package imports none of them; it holds what several share.
"""

import contextlib
from collections import Counter

import torch
import torch.distributed as dist

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


def rank_device() -> torch.device:
    """The device this rank's backend expects: its GPU under NCCL (launch sets it), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _all_to_all_sent(a, k) -> int:
    """What all_to_all_single(output, input, output_splits, input_splits) sends to the other ranks."""
    g, t = k.get("group"), a[1]
    own = a[3][dist.get_rank(g)] if len(a) > 3 else t.numel() // dist.get_world_size(g)
    return (t.numel() - own) * t.element_size()


HANDED = {"all_reduce": lambda a, k: a[0].numel() * a[0].element_size(),  # name -> bytes it is handed
          "all_gather_single": lambda a, k: a[0].numel() * a[0].element_size(),  # (the output)
          "reduce_scatter_single": lambda a, k: a[1].numel() * a[1].element_size(),  # (the input)
          "all_to_all_single": _all_to_all_sent}


@contextlib.contextmanager
def collective_bytes():
    """Bytes handed to torch.distributed's collectives while inside, per kind ("all_reduce",
    "all_gather", "reduce_scatter", "all_to_all"); torch's functions are put back on exit
    (the processes may live on)."""
    counts, real = Counter(), {name: getattr(dist, name) for name in HANDED}

    def wrap(name):
        def counted(*a, **k):
            counts[name.replace("_single", "")] += HANDED[name](a, k)
            return real[name](*a, **k)
        return counted
    for name in HANDED:
        setattr(dist, name, wrap(name))
    try:
        yield counts
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
