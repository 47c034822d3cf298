"""The planner: the ZeRO stage, micro-steps and recomputation that fit a memory budget, at
the least communication and recomputation. Chapter 09 (chapters/09_memory.md). Exercised by

    python -m minidist.memory.plan --preset gpt2 --world-size 8 --budget-gb 80
    python minidist/train_gpt.py --steps 20 --zero-stage auto --grad-accum-steps auto --activation-checkpointing auto
    pytest tests/test_plan.py

A configuration is a ZeRO stage s, a number k of micro-steps (the global batch split over
N ranks and k steps, so B = batch / (N k) sequences per micro-batch) and recomputation on
or off. Its memory per rank is minidist.memory.step_memory's peak; its price, compared in
this order:

1. bytes each rank sends per optimizer step: 2 Psi (N-1)/N elements for stages 0 and 1
   (accumulation communicates once, in the last micro-step), (k + 1) Psi (N-1)/N for
   stage 2 (a reduce-scatter every micro-step, one all-gather), 3 k Psi (N-1)/N for
   stage 3 (gathers in forward and backward, a reduce-scatter, every micro-step);
2. recomputation: a second forward of every block, about a quarter more compute (chapter
   09 measures it);
3. micro-steps: smaller micro-batches use the hardware less well;
4. the stage: among equals, the simpler one.

Memory falls as k grows and the price rises, so for each (stage, recomputation) the
cheapest configuration that fits is the one with the fewest micro-steps that fits; the
planner finds that one per family and takes the cheapest of the families
(tests/test_plan.py checks it against a search of every configuration).
"""

from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import dataclass

import torch
from torch.utils.benchmark import timer as clock  # waits for the GPU's queue

from minidist.cost_model import MODELS, STRATEGIES, comm_volume
from minidist.memory.estimate import GB, step_memory
from minidist.model import GPT, PRESETS, GPTConfig, config_num_params, flops_per_token
from minidist.memory.recompute import set_activation_checkpointing

CPU_BUDGET_GB = 4.0  # per rank on a CPU, where nothing tells us what a process may use
GPU_MARGIN = 0.10    # of a GPU's memory left out: CUDA context, allocator cache, NCCL buffers


class PlanError(ValueError):
    """No configuration fits; the message says what would."""


@dataclass(frozen=True)
class Choice:
    stage: int
    accum: int
    checkpointed: bool
    micro_batch: int
    peak: float        # bytes per rank, minidist.memory.step_memory
    comm_bytes: float  # sent per rank per optimizer step

    def price(self) -> tuple:
        return (self.comm_bytes, self.checkpointed, self.accum, self.stage)

    def describe(self) -> str:
        steps = f"{self.accum} micro-step{'s' if self.accum > 1 else ''} of {self.micro_batch}"
        return f"ZeRO-{self.stage}, {steps}, {'recomputation' if self.checkpointed else 'no recomputation'}"


def _gb(nbytes: float) -> str:
    """Gigabytes with two decimals; small budgets (CPU runs) with two significant digits."""
    v = nbytes / GB
    return f"{v:.2f}" if v >= 0.1 else f"{v:.2g}"


def comm_bytes(stage: int, accum: int, psi: int, world: int, elem: int = 4) -> float:
    """Bytes each rank sends per optimizer step (fp32 on the wire, as minidist sends):
    cost_model's formula, which counts the micro-steps of each stage."""
    return comm_volume(STRATEGIES[stage], psi, world, elem_bytes=elem, accum=accum)


def _memory_here() -> float:
    """Bytes free where measure_recompute runs: the GPU's, or the machine's available memory."""
    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[0]
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return float("inf")  # unknown: let it try


def default_budget_gb(device: str) -> float:
    """The GPU's memory less GPU_MARGIN; on a CPU, CPU_BUDGET_GB."""
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory * (1 - GPU_MARGIN) / GB
    return CPU_BUDGET_GB


def evaluate(cfg: GPTConfig, batch: int, seq_len: int, world: int, stage: int, accum: int,
             checkpointed: bool, precision: str = "fp32", bucket_cap_mb: float = 25.0) -> Choice:
    micro = batch // (world * accum)
    peak = step_memory(cfg, micro, seq_len, world, stage, checkpointed, precision, bucket_cap_mb)["peak"]
    return Choice(stage, accum, checkpointed, micro, peak, comm_bytes(stage, accum, config_num_params(cfg), world))


def accum_options(batch: int, world: int) -> list[int]:
    """Micro-steps that split this rank's share of the batch evenly."""
    if batch % world:
        raise PlanError(f"a batch of {batch} sequences does not divide over {world} ranks")
    share = batch // world
    return [k for k in range(1, share + 1) if share % k == 0]


def check_sizes(batch: int, seq_len: int, world: int, budget_gb: float) -> None:
    """PlanError unless the sizes can describe a run: counts >= 1, a finite budget > 0, and
    a batch that splits over the ranks (a negative size would make a plan "fit")."""
    for name, v in (("world size", world), ("batch", batch), ("sequence length", seq_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PlanError(f"the {name} must be an integer >= 1, got {v!r}")
    if not (isinstance(budget_gb, (int, float)) and math.isfinite(budget_gb) and budget_gb > 0):
        raise PlanError(f"the memory budget must be a finite number of GB > 0, got {budget_gb!r}")
    if batch % world:
        raise PlanError(f"a batch of {batch} sequences does not divide over {world} ranks: use a "
                        f"multiple of {world}, e.g. {world * max(1, batch // world)}")


def plan(cfg: GPTConfig, batch: int, seq_len: int, world: int, budget_gb: float,
         precision: str = "fp32", stages=(0, 1, 2, 3), accums=None, ckpts=(False, True),
         bucket_cap_mb: float = 25.0) -> tuple[Choice, str]:
    """The cheapest configuration whose peak fits `budget_gb`, and one line of reasoning."""
    check_sizes(batch, seq_len, world, budget_gb)
    budget = budget_gb * GB
    valid = accum_options(batch, world)
    if accums and not set(accums) & set(valid):
        raise PlanError(f"{batch} sequences over {world} ranks do not split into {accums} micro-steps: "
                        f"choose from {valid}")
    accums = sorted(set(accums or valid) & set(valid))
    best, cheapest_miss = None, None
    for stage in stages:
        for ck in ckpts:
            for k in accums:  # fewest micro-steps first: the first that fits is this family's best
                c = evaluate(cfg, batch, seq_len, world, stage, k, ck, precision, bucket_cap_mb)
                if c.peak <= budget:
                    if best is None or c.price() < best.price():
                        best = c
                    break
                if cheapest_miss is None or c.price() < cheapest_miss.price():
                    cheapest_miss = c
    if best is None:
        raise PlanError(_nothing_fits(cfg, batch, seq_len, world, budget_gb, precision, stages, bucket_cap_mb))
    line = f"{best.describe()}: {_gb(best.peak)} of {_gb(budget)} GB"
    if cheapest_miss is not None and cheapest_miss.price() < best.price():
        line += f"; {cheapest_miss.describe()} needs {_gb(cheapest_miss.peak)} GB"
    return best, line


def _nothing_fits(cfg, batch, seq_len, world, budget_gb, precision, stages, bucket_cap_mb) -> str:
    least = min((evaluate(cfg, batch, seq_len, world, s, batch // world, True, precision, bucket_cap_mb)
                 for s in stages), key=lambda c: c.peak)
    msg = (f"nothing fits {_gb(budget_gb * GB)} GB per rank: the smallest, {least.describe()}, needs "
           f"{_gb(least.peak)} GB")
    for n in (2 ** i for i in range(1, 21)):  # more ranks, the same global batch
        if n > world and batch % n == 0 and 3 in stages:
            c = evaluate(cfg, batch, seq_len, n, 3, batch // n, True, precision, bucket_cap_mb)
            if c.peak <= budget_gb * GB:
                return msg + f"; {n} ranks would fit it ({c.describe()}: {_gb(c.peak)} GB)"
    return msg + "; use a shorter --seq-len, a smaller model, or a larger --memory-budget-gb"


# ------------------------------------------------------------------ recomputation's price

def recompute_flops_fraction(cfg: GPTConfig, seq_len: int) -> float:
    """The blocks' forward FLOPs over a step's (6 N + 12 L T d per token, chapter 01): what
    recomputation adds. The head and the loss are not recomputed."""
    d, L = cfg.n_embd, cfg.n_layer
    return (24 * L * d * d + 4 * L * seq_len * d) / flops_per_token(cfg, seq_len)


def measure_recompute(cfg: GPTConfig, micro_batch: int, seq_len: int, repeats: int = 7) -> tuple[float, float]:
    """Seconds of forward + backward without and with recomputation on this machine's CPU
    (or GPU), the median of `repeats` interleaved pairs (interleaved: a busy machine slows
    both alike), after one warm-up pair. The clock is torch.utils.benchmark's, which waits
    for the GPU's queued work; not its Timer, whose two warm-up calls before every timed
    block would triple a run of steps that take seconds each on a CPU."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = GPT(cfg).to(device)
    idx = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len), device=device)

    def step(on: bool) -> float:
        set_activation_checkpointing(model, on)
        t = clock()
        model(idx, idx)[1].backward()
        return clock() - t

    step(False), step(True)  # warm up both paths
    pairs = [(step(False), step(True)) for _ in range(repeats)]
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)


# ------------------------------------------------------------------ the table

def _config(name: str) -> GPTConfig:
    if name in MODELS:
        return MODELS[name]
    if name in PRESETS:
        return GPTConfig(**PRESETS[name])
    raise SystemExit(f"unknown model {name!r}: one of {', '.join([*PRESETS, *MODELS])}")


def table(cfg: GPTConfig, batch: int, seq_len: int, world: int, budget_gb: float, precision: str) -> list[str]:
    """Every configuration for one model, world size and budget, cheapest first."""
    rows = [evaluate(cfg, batch, seq_len, world, s, k, ck, precision)
            for s in (0, 1, 2, 3) for ck in (False, True) for k in accum_options(batch, world)]
    rows.sort(key=Choice.price)
    return [f"  {'fits' if c.peak <= budget_gb * GB else '    '}  {c.describe():55s} {c.peak / GB:8.2f} GB  "
            f"{c.comm_bytes / GB:7.2f} GB sent" for c in rows]


def _positive(kind):
    """An argparse type: a `kind` (int or float) > 0 and finite; anything else exits 2 with
    "argument --FLAG: must be ..." (a world of 0 ranks or a negative budget has no plan)."""
    what = "an integer >= 1" if kind is int else "a finite number > 0"

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if not (math.isfinite(v) and v > 0):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return v
    parse.__name__ = what
    return parse


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="What fits a memory budget, and what it costs.")
    p.add_argument("--preset", default="gpt2", help=f"one of {', '.join([*PRESETS, *MODELS])}")
    p.add_argument("--world-size", type=_positive(int), default=8)
    p.add_argument("--budget-gb", type=_positive(float), default=80.0, help="per rank")
    p.add_argument("--batch-size", type=_positive(int), default=None,
                   help="global, in sequences (default 8 per rank)")
    p.add_argument("--seq-len", type=_positive(int), default=1024)
    p.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--measure-recompute", type=_positive(int), metavar="B",
                   help="time a step of B sequences with and without recomputation here, and stop")
    p.add_argument("--vocab-size", type=_positive(int), help="default: the preset's (GPT-2's 50257)")
    a = p.parse_args(argv)
    if a.preset not in {**PRESETS, **MODELS}:
        p.error(f"argument --preset: unknown model {a.preset!r}: one of {', '.join([*PRESETS, *MODELS])}")
    batch = a.batch_size or 8 * a.world_size
    try:
        check_sizes(batch, a.seq_len, a.world_size, a.budget_gb)
    except PlanError as e:
        p.error(f"--batch-size/--world-size: {e}")
    cfg = _config(a.preset)
    if a.vocab_size:
        cfg = GPTConfig(**{**cfg.to_dict(), "vocab_size": a.vocab_size})
    if a.measure_recompute:
        cfg = GPTConfig(**{**cfg.to_dict(), "block_size": max(cfg.block_size, a.seq_len)})
        need = step_memory(cfg, a.measure_recompute, a.seq_len, 1, 0, False, "fp32")["peak"]  # (Adam's too: a margin)
        have = _memory_here()
        if need > 0.8 * have:
            p.error(f"--measure-recompute builds {a.preset} here in fp32 with a batch of {a.measure_recompute}: about "
                    f"{need / GB:.1f} GB, and this machine has {have / GB:.1f} GB free: use a smaller --preset or B")
        plain, ckpt = measure_recompute(cfg, a.measure_recompute, a.seq_len)
        print(f"{a.preset}, {a.measure_recompute} x {a.seq_len}: forward + backward {plain * 1e3:.0f} ms, with "
              f"recomputation {ckpt * 1e3:.0f} ms: +{100 * (ckpt / plain - 1):.0f}% "
              f"(the blocks' forward FLOPs: +{100 * recompute_flops_fraction(cfg, a.seq_len):.0f}%)")
        return
    print(f"{a.preset}: {config_num_params(cfg) / 1e6:.0f}M parameters, {a.world_size} ranks, batch "
          f"{batch} x {a.seq_len}, {a.precision}, budget {a.budget_gb:g} GB per rank")
    try:
        print("  plan: " + plan(cfg, batch, a.seq_len, a.world_size, a.budget_gb, a.precision)[1])
    except PlanError as e:
        print(f"  plan: {e}")
    if len(accum_options(batch, a.world_size)) <= 8:
        print("\n".join(table(cfg, batch, a.seq_len, a.world_size, a.budget_gb, a.precision)))
    print(f"\nevery model, 8 sequences of {a.seq_len} per rank per step, {a.budget_gb:g} GB per rank:")
    for name, c in MODELS.items():
        for n in (1, 8, 64, 1024):
            try:
                line = plan(c, 8 * n, a.seq_len, n, a.budget_gb, a.precision)[1].split(";")[0]
            except PlanError as e:
                line = str(e).split(";")[0]
            print(f"  {name:>5s} x {n:4d}: {line}")


if __name__ == "__main__":
    main()
