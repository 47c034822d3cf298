"""The planner: the ZeRO stage, micro-steps and recomputation that fit a memory budget, at
the least communication and recomputation. Chapter 09 (chapters/09_memory.md), section
"the planner", derives the memory and the price (Choice.price, compared in order: bytes
sent, recomputation, micro-steps, the stage). Exercised by

    python -m minidist.run.plan memory --preset gpt2 --world-size 8 --budget-gb 80
    python minidist/train_gpt.py --steps 20 --zero-stage auto --grad-accum-steps auto --activation-checkpointing auto
    pytest tests/test_plan.py

Memory falls as the micro-steps k grow and the price rises, so each (stage, recomputation)
family's best is its fewest k that fits, found by bisection over the divisors of a rank's
share of the batch. Every search is bounded: sizes beyond MAX_COUNT are refused.
"""

from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import dataclass

import torch
from torch.utils.benchmark import timer as clock  # waits for the GPU's queue

from minidist.cost_model import STRATEGIES, comm_volume
from minidist.memory.estimate import GB, step_memory
from minidist.model import GPT, GPTConfig, config_num_params, flops_per_token
from minidist.memory.recompute import set_activation_checkpointing

CPU_BUDGET_GB = 4.0  # per rank on a CPU, where nothing tells us what a process may use
GPU_MARGIN = 0.10    # of a GPU's memory left out: CUDA context, allocator cache, NCCL buffers
MAX_COUNT = 2**24    # sequences, tokens or ranks: beyond any run the cost model describes


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

    def price(self) -> tuple:  # bytes sent, recomputation (a second forward), micro-steps, stage
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


def divisors(n: int) -> list[int]:
    """Every divisor of n, ascending: pairs (k, n // k) up to sqrt(n), so a search over
    them costs sqrt(n) steps, not n (a few thousand at MAX_COUNT)."""
    return sorted({d for k in range(1, math.isqrt(n) + 1) if n % k == 0 for d in (k, n // k)})


def accum_options(batch: int, world: int) -> list[int]:
    """Micro-steps that split this rank's share of the batch evenly."""
    if batch % world:
        raise PlanError(f"a batch of {batch} sequences does not divide over {world} ranks")
    return divisors(batch // world)


def some(values: list[int], n: int = 8) -> str:
    """A list for a message: the first n, and how many more."""
    return ", ".join(map(str, values[:n])) + (f" (and {len(values) - n} more)" if len(values) > n else "")


def check_sizes(batch: int, seq_len: int, world: int, budget_gb: float) -> None:
    """PlanError unless the sizes can describe a run: counts >= 1, a finite budget > 0, and
    a batch that splits over the ranks (a negative size would make a plan "fit")."""
    for name, v, fix in (("world size", world, "fewer ranks"), ("batch", batch, "a smaller --batch-size"),
                         ("sequence length", seq_len, "a shorter --seq-len")):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PlanError(f"the {name} must be an integer >= 1, got {v!r}")
        if v > MAX_COUNT:  # (and the searches over its divisors stay short)
            raise PlanError(f"the {name} must be at most {MAX_COUNT:,}, got {v:,}: more than any run the "
                            f"cost model describes; use {fix}")
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
                        f"choose from {some(valid)}")
    accums = sorted(set(accums or valid) & set(valid))
    best, cheapest_miss = None, None
    for stage in stages:
        for ck in ckpts:
            def at(k):
                return evaluate(cfg, batch, seq_len, world, stage, k, ck, precision, bucket_cap_mb)
            # memory falls as k grows: the fewest micro-steps that fit is this family's best
            first = bisect.bisect_left(accums, True, key=lambda k: at(k).peak <= budget)
            if first < len(accums):
                c = at(accums[first])
                best = c if best is None or c.price() < best.price() else best
            if first > 0:  # a miss: the family's cheapest is its fewest micro-steps
                c = at(accums[0])
                cheapest_miss = c if cheapest_miss is None or c.price() < cheapest_miss.price() else cheapest_miss
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
