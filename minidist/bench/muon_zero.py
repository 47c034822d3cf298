"""`python -m minidist.bench muon`, its last table: Muon beside AdamW under ZeRO stages 0-3,
against AdamW alone at the same stage. Chapter 07 (chapters/07_muon.md), section "Muon
under ZeRO". Exercised by `python -m minidist.bench muon --quick` (tests/test_bench.py);
this table alone: `python -m minidist.bench muon_zero --world-sizes 2`.

train_gpt's default CPU model, built as train_gpt builds it (compose.build's make_optimizers
and gradient_sync), on N ranks: optimizer state per rank and bytes sent per step (every
collective counted as a ring sends it) against their formulas
(minidist.cost_model.muon_comm_volume), the step time against AdamW's, and the optimizer's share.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from minidist.bench import collective_bytes, cpu_default
from minidist.bench.timing import clock, interleaved
from minidist.cost_model import SENT_FRACTION, muon_comm_volume
from minidist.launch import launch
from minidist.model import GPT, GPTConfig
from minidist.muon import split_params
from minidist.compose.build import gradient_sync, make_optimizers
from minidist.train import forward_backward

VARIANTS = [(opt, stage) for stage in (0, 1, 2, 3) for opt in ("adamw", "muon")]


def _build(cfg: dict, optimizer: str, stage: int):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**cfg))
    opts = make_optimizers(model, optimizer=optimizer, zero_stage=stage, lr=1e-3, weight_decay=0.1,
                           muon_lr=0.02, muon_momentum=0.95, muon_weight_decay=0.0)
    return model, opts, gradient_sync(model, opts, zero_stage=stage)


def _step(model, opts, sync, micro, n) -> float:
    """One training step; returns the seconds its optimizer steps took (Timer's clock)."""
    forward_backward(model, micro, n, sync)
    t0 = clock()
    for o in opts:
        o.step()
    t = clock() - t0
    for o in opts:
        o.zero_grad(set_to_none=True)
    return t


def _measure(cfg: dict, per_rank_batch: int, rounds: int, steps: int):
    n, rank = dist.get_world_size(), dist.get_rank()
    x = torch.randint(0, cfg["vocab_size"], (per_rank_batch, cfg["block_size"]),
                      generator=torch.Generator().manual_seed(rank))
    micro = [(x, torch.roll(x, -1, 1))]
    runners = {v: _build(cfg, *v) for v in VARIANTS}
    out = {"sent": {}, "state": {}, "step_s": {}, "opt_share": {}}
    for v, (model, opts, sync) in runners.items():
        _step(model, opts, sync, micro, n)  # the first step creates the optimizer state
        with collective_bytes() as c:
            _step(model, opts, sync, micro, n)
        out["sent"][v] = sum(SENT_FRACTION[k](n) * b for k, b in c.items() if k in SENT_FRACTION) + c["all_to_all"]
        out["state"][v] = {type(o).__name__: sum(t.numel() * t.element_size() for s in o.state.values()
                                                 for t in s.values() if torch.is_tensor(t) and t.dim())
                           for o in opts}
    # the barrier before each block also zeroes the variant's optimizer seconds, so that after
    # the block they hold its timed steps' alone (Timer's warm-up steps come after the barrier)
    opt_s, shares = dict.fromkeys(VARIANTS, 0.0), {v: [] for v in VARIANTS}

    def step(v):
        opt_s[v] += _step(*runners[v], micro, n)

    def before(v):
        dist.barrier()
        opt_s[v] = 0.0
    times = interleaved({v: (lambda v=v: step(v)) for v in VARIANTS}, rounds, steps, before=before,
                        after=lambda v, block: shares[v].append(opt_s[v] / block.raw_times[0]))
    out["step_s"] = {v: m.median for v, m in times.items()}
    out["opt_share"] = {v: statistics.median(s) for v, s in shares.items()}
    return out if rank == 0 else None


def formulas(cfg: dict, n: int) -> dict:
    """Per (optimizer, stage): the state bytes and bytes sent each rank should have."""
    model = GPT(GPTConfig(**cfg))
    hidden, rest = split_params(model)
    psi_m, psi = sum(p.numel() for p in hidden), sum(p.numel() for p in model.parameters())
    in_blocks = {id(p) for b in model.blocks for p in b.parameters()}
    psi_root = sum(p.numel() for p in model.parameters() if id(p) not in in_blocks)
    out = {}
    for opt, stage in VARIANTS:
        pm = psi_m if opt == "muon" else 0
        adamw_state = 8 * (psi - pm) / (n if stage else 1)
        out[opt, stage] = dict(state=adamw_state + 4 * pm / n,
                               sent=muon_comm_volume(stage, psi - pm, pm, n, psi_root))
    return out


def run(cfg: dict, n: int, per_rank_batch: int, rounds: int, steps: int) -> dict:
    """The table at n ranks, printed; returned with its formulas, keys "opt/stage"."""
    r = launch(_measure, n, cfg, per_rank_batch, rounds, steps, timeout_s=900)[0]
    want = formulas(cfg, n)
    print(f"  N = {n}: {'':12} {'state MB':>9} {'/formula':>8} {'sent MB':>8} {'/formula':>8} "
          f"{'sent/AdamW':>10} {'step/AdamW':>10} {'opt share':>9}")
    table = {}
    for opt, stage in VARIANTS:
        v = (opt, stage)
        state = sum(r["state"][v].values())
        row = dict(state=state, state_formula=want[v]["state"], sent=r["sent"][v],
                   sent_formula=want[v]["sent"], sent_vs_adamw=r["sent"][v] / r["sent"]["adamw", stage],
                   step_vs_adamw=r["step_s"][v] / r["step_s"]["adamw", stage], step_s=r["step_s"][v],
                   opt_share=r["opt_share"][v])
        table[f"{opt}/{stage}"] = row
        print(f"  {'':7}{opt:6} stage {stage} {state / 1e6:9.3f} {state / row['state_formula']:8.3f} "
              f"{row['sent'] / 1e6:8.3f} {row['sent'] / row['sent_formula']:8.3f} "
              f"{row['sent_vs_adamw']:10.3f} {row['step_vs_adamw']:10.3f} {row['opt_share']:9.3f}")
    return table


def cli(args) -> dict:
    """`python -m minidist.bench muon_zero`: the table alone, at each --world-sizes."""
    cfg, batch, rounds, steps = cpu_default(args.quick)  # train_gpt's CPU default model
    return {n: run(cfg, n, max(1, batch // n), rounds, steps) for n in args.world_sizes if n > 1}
