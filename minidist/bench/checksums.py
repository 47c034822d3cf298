"""`python -m minidist.bench checksums`: what checkpoint checksums cost. Chapter 08
(chapters/08_at_scale.md) quotes the figures. Exercised by `python -m minidist.bench
checksums --quick` (tests/test_bench.py).

Save, load and verify with and without the CRC-32s ("without" swaps
minidist.checkpoint.io.checksum for one that returns 0: the same path minus the CRCs), in CPU
seconds of this process, best of 9: the CPU cost the checksums add, not the disk's speed.
"""

import tempfile
import time

import torch

from minidist import checkpoint
from minidist.checkpoint import io as checkpoint_io
from minidist.bench import timing
from minidist.model import GPT, PRESETS, GPTConfig


def _model(preset: str, vocab: int):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**PRESETS[preset], vocab_size=vocab))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, vocab, (2, 33))
    model(x[:, :-1], x[:, 1:])[1].backward()
    opt.step()  # now AdamW has its two moments: 12 bytes per parameter in all
    return model, opt


def _best_s(fn) -> float:
    """CPU seconds of this process for one call, after Timer's warm-up
    (minidist/bench/timing.py): what the checksums add is CPU work, and on a shared
    machine wall time mostly measures the neighbours."""
    return timing.measure(fn, 1, clock_fn=time.process_time).times[0]


def measure(preset: str, vocab: int, repeats: int) -> dict:
    """The best of `repeats` of each, with and without alternating (a noisy machine slows
    some runs down, never speeds one up)."""
    model, opt = _model(preset, vocab)
    row = {"preset": preset, "params_M": sum(p.numel() for p in model.parameters()) / 1e6}
    real, step = checkpoint_io.checksum, iter(range(1, 10 ** 6))
    with tempfile.TemporaryDirectory() as d:
        for _ in range(repeats):
            for label, fn in (("with", real), ("without", lambda value: 0)):
                checkpoint_io.checksum = fn
                try:
                    times = {"save": _best_s(lambda: checkpoint.save(d, next(step), model, [opt], keep=1))}
                    path = checkpoint.latest(d)
                    times["load"] = _best_s(lambda: checkpoint.load(path, model, [opt]))
                    times["verify"] = _best_s(lambda: checkpoint.verify(path))
                finally:
                    checkpoint_io.checksum = real
                for k, t in times.items():
                    row[f"{k}_{label}_s"] = min(t, row.get(f"{k}_{label}_s", t))
        row["MB"] = sum(f.stat().st_size for f in checkpoint.latest(d).iterdir()) / 1e6
    return row


def run(args) -> dict:
    presets, repeats = (("tiny",), 1) if args.quick else (("tiny", "small"), 9)
    print("CPU seconds, best of", repeats)
    print(f"{'preset':8s} {'params':>8s} {'file':>8s} | {'save: with':>10s} {'without':>8s} | "
          f"{'load: with':>10s} {'without':>8s} | {'verify all':>10s}")
    rows = []
    for preset in presets:
        r = measure(preset, 2048, repeats)  # the CPU default tokenizer, gpt2-2048
        rows.append(r)
        print(f"{preset:8s} {r['params_M']:7.2f}M {r['MB']:6.1f}MB | {r['save_with_s']:9.3f}s "
              f"{r['save_without_s']:7.3f}s | {r['load_with_s']:9.3f}s {r['load_without_s']:7.3f}s | "
              f"{r['verify_with_s']:9.3f}s")
    return {"rows": rows, "repeats": repeats}
