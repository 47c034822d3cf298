"""`python -m minidist.bench zero`: memory, bytes sent and step time of ZeRO stages 0-3.
Chapter 06 (chapters/06_zero.md). Exercised by `python -m minidist.bench zero --quick`
(tests/test_bench.py).

train_gpt's default model with AdamW, per world size: the bytes each rank holds after a step
against the ZeRO paper's formula (K = 8: fp32 AdamW), the bytes sent per step counted on
minidist's rings, the step time relative to stage 0 (torch's collectives), ZeRO-3 with and
without prefetch; then the paper's formulas (K = 12) for its larger models and clusters.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from minidist.comm import all_reduce, count_bytes
from minidist.cost_model import model_state_bytes
from minidist.ddp import DDP
from minidist.bench import cpu_default
from minidist.bench.report import pyplot, save_figure
from minidist.bench.timing import interleaved
from minidist.launch import launch
from minidist.model import GPT, GPTConfig, config_num_params
from minidist.train import forward_backward
from minidist.zero import zero_optimizer


def fp32_formula_bytes(psi: float, n: int, stage: int) -> float:
    """What the run here should hold per rank: the ZeRO paper's formula with fp32
    parameters and gradients (4 bytes each) and AdamW's two fp32 moments (K = 8)."""
    return model_state_bytes(psi, n, stage, k=8, p=4, g=4)


VARIANTS = ["stage0", "stage1", "stage2", "stage3", "stage3_no_prefetch"]


def _build(name, cfg, collectives):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**cfg))
    kw = dict(lr=1e-4, betas=(0.9, 0.95))
    if name == "stage0":
        ddp = DDP(model)
        return ddp, torch.optim.AdamW(model.parameters(), **kw), None
    stage = int(name[5])
    opt = zero_optimizer(model, list(model.parameters()), torch.optim.AdamW, stage,
                         prefetch=not name.endswith("no_prefetch"), collectives=collectives, **kw)
    return model, opt, opt


def _measure(cfg, per_rank_batch, rounds, steps):
    nbytes = lambda t: t.numel() * t.element_size()
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, cfg["vocab_size"], (per_rank_batch, cfg["block_size"]), generator=g)
    micro = [(x, torch.roll(x, -1, 1))]
    out = {"memory": {}, "sent": {}}
    for name in VARIANTS[:4]:  # bytes on the wire and memory, with the ring collectives
        fwd, opt, zero = _build(name, cfg, "minidist")
        for i in range(2):  # the first step creates the optimizer state; count the second
            with count_bytes() as sent:
                forward_backward(fwd, micro, dist.get_world_size(), zero)
                if zero is None:  # stage 0: the average DDP takes, on the ring, to count it
                    flat = torch.cat([p.grad.flatten() for p in fwd.module.parameters()])
                    all_reduce(flat, op="avg")
                opt.step()
            if i == 1:  # after the step, before zero_grad: every gradient still held
                out["sent"][name] = sum(sent.values())
                out["memory"][name] = opt.memory_bytes() if zero else {
                    "params": sum(nbytes(p) for p in fwd.module.parameters()),
                    "grads": sum(nbytes(p.grad) for p in fwd.module.parameters()),
                    "optimizer_state": sum(nbytes(v) for s in opt.state.values() for v in s.values())}
            opt.zero_grad()
    runners = {n: _build(n, cfg, "torch") for n in VARIANTS}

    def step(n):
        fwd, opt, zero = runners[n]
        forward_backward(fwd, micro, dist.get_world_size(), zero)
        opt.step()
        opt.zero_grad()
    times = interleaved({n: (lambda n=n: step(n)) for n in VARIANTS}, rounds, steps, before=lambda n: dist.barrier())
    out["step_s"] = {n: m.median for n, m in times.items()}
    return out if rank == 0 else None


def run(args) -> dict:
    cfg, global_batch, rounds, steps = cpu_default(args.quick)  # train_gpt's CPU default model
    psi = config_num_params(GPTConfig(**cfg))
    result = {"psi": psi, "config": cfg, "runs": {}}
    print(f"default GPT (tiny, vocab 2048): {psi:,} parameters, AdamW, fp32 (K = 8)")
    for n in args.world_sizes:
        r = launch(_measure, n, cfg, global_batch // n, rounds, steps, timeout_s=900)[0]
        result["runs"][n] = r
        print(f"\nN = {n}: {'stage':20} {'held MB':>8} {'formula MB':>10} {'ratio':>6} "
              f"{'sent MB':>8} {'x Psi(N-1)/N':>12} {'step vs 0':>9}")
        for name in VARIANTS:
            stage = int(name[5])
            line = f"{'':7}{name:20}"
            if name in r["memory"]:
                m = r["memory"][name]
                held = m["params"] + m["grads"] + m["optimizer_state"]
                f = fp32_formula_bytes(psi, n, stage)
                line += (f" {held / 1e6:8.3f} {f / 1e6:10.3f} {held / f:6.3f} {r['sent'][name] / 1e6:8.3f}"
                         f" {r['sent'][name] / (4 * psi * (n - 1) / n):12.2f}")
            else:
                line += " " * 49
            print(line + f" {r['step_s'][name] / r['step_s']['stage0']:9.3f}")
        pre = r["step_s"]["stage3_no_prefetch"] / r["step_s"]["stage3"]
        print(f"{'':7}ZeRO-3 prefetch: step time without / with = {pre:.3f}")
    print("\nThe paper's formulas, mixed-precision Adam (2 + 2 + K = 12 bytes per parameter), GB per rank:")
    table = {}
    print(f"{'model':>10} {'N':>4} {'stage 0':>8} {'stage 1':>8} {'stage 2':>8} {'stage 3':>8}")
    for label, size in (("GPT-2 124M", 124e6), ("1.5B", 1.5e9), ("7.5B", 7.5e9)):
        for n in (8, 64):
            row = [model_state_bytes(size, n, s) / 1e9 for s in range(4)]
            table[f"{label} N={n}"] = row
            print(f"{label:>10} {n:4d} " + " ".join(f"{v:8.2f}" for v in row))
    result["paper_table_gb"] = table
    _plot(result, Path(args.out) / "zero.png")
    return result


def _plot(result, path) -> None:
    plt = pyplot()
    runs = result["runs"]
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 4), squeeze=False)
    for ax, (n, r) in zip(axes[0], runs.items()):
        names = [v for v in VARIANTS if v in r["memory"]]
        held = [sum(r["memory"][v][k] for k in ("params", "grads", "optimizer_state")) / 1e6 for v in names]
        form = [fp32_formula_bytes(result["psi"], n, int(v[5])) / 1e6 for v in names]
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], held, 0.4, label="measured")
        ax.bar([x + 0.2 for x in xs], form, 0.4, label="formula")
        ax.set_xticks(list(xs), names)
        ax.set(ylabel="MB per rank", title=f"ZeRO memory per rank, N={n}")
        ax.legend(), ax.grid(alpha=0.3, axis="y")
    save_figure(fig, path)
