"""The planner on three axes: for a model, a world of ranks and a memory budget per rank, the
mesh dp x tp x pp, the ZeRO stage, the micro-batches, sequence parallelism and recomputation
that fit, at the least modelled step time. Chapter 11 (chapters/11_pipeline.md, section 8;
its appendix derives the memory and the price, section B, and each schedule's, section G).
Chapter 12 adds a fourth: dp x cp, every sequence cut over cp ranks (cp_memory, cp_price). Exercised by

    python -m minidist.run.plan mesh --preset gpt2 --world-size 8 --budget-gb 80
    pytest tests/test_plan_mesh.py

The most loaded rank is on the first stage (the most blocks and micro-batches in flight) or
the last (the head, the logits), so only those two are weighed (ZB-H1: all); the search is
per family (mesh, ZeRO stage, recomputation, sp), of 1F1B pipelines (plan_on_mesh: the schedule
given), held equal to a search of every configuration that weighs every stage. Left out of the
price: recomputation repeating tp's forward all-reduces, and stages unequal in time."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace

from minidist.cost_model import ELEM, GB, MESSAGES, Hardware, grad_sync_cost, link, rank_params
from minidist.memory import step_memory
from minidist.model import GPTConfig, flops_per_token
from minidist.pipeline.interleaved import stage_blocks
from minidist.pipeline.measure import in_flight_formula, pending_w_formula, schedule_bubble, step_units
from minidist.memory.plan import PlanError, check_sizes, divisors, recompute_flops_fraction, some
from minidist.memory.plan import accum_options as micro_options  # a replica's share, split evenly
from minidist.tensor_parallel.cost import comm_bytes as tp_comm_bytes


NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "interleaved 1F1B", "zb-h1": "ZB-H1"}


@dataclass(frozen=True)
class Plan:
    dp: int
    tp: int
    pp: int
    zero: int
    micro: int                # m, micro-batches per step
    checkpointed: bool
    sequence_parallel: bool
    micro_batch: int          # B, sequences per micro-batch
    peak: float               # bytes, the most loaded rank's
    step_s: float             # modelled seconds per step
    bubble: float
    sent: tuple               # bytes the busiest rank sends per step: (dp, tp, pp)
    cp: int = 1               # chapter 12: the sequence cut over cp ranks (tp = pp = 1)
    cp_sent: float = 0.0      # bytes the ring sends per rank per step
    schedule: str = "1f1b"    # the pipeline's (chapter 11 and its appendix), and its chunks per stage
    v: int = 1

    def price(self) -> tuple:
        return (self.step_s, self.bubble, sum(self.sent) + self.cp_sent, self.checkpointed, self.sequence_parallel,
                self.micro, self.zero, self.pp, self.tp, self.cp)

    def mesh(self) -> str:
        return f"dp {self.dp} x cp {self.cp}" if self.cp > 1 else f"dp {self.dp} x tp {self.tp} x pp {self.pp}"

    def describe(self) -> str:
        mb = f"{self.micro} micro-batch{'es' if self.micro > 1 else ''} of {self.micro_batch}"
        sched = NAMES[self.schedule] + (f" over {self.v} chunks per stage" if self.v > 1 else "")
        return ", ".join([self.mesh(), f"ZeRO-{self.zero}", mb] + [sched] * (self.pp > 1)
                         + ["sequence parallel"] * self.sequence_parallel
                         + ["recomputation" if self.checkpointed else "no recomputation"])


def meshes(cfg: GPTConfig, world: int) -> list[tuple[int, int, int]]:
    """(dp, tp, pp) for every split of the world that train_gpt's rules allow."""
    return [(world // (tp * pp), tp, pp) for tp in divisors(world) if cfg.n_head % tp == 0
            for pp in divisors(world // tp) if pp <= cfg.n_layer]


def zero_stages(tp: int, pp: int) -> tuple[int, ...]:
    return (0, 1) if pp > 1 else (0, 1, 2) if tp > 1 else (0, 1, 2, 3)


def stage_memory(cfg, batch, seq_len, dp, tp, pp, zero, m, ck, sp, s, precision="bf16", bucket_cap_mb=25.0, *,
                 schedule="1f1b", v=1):
    """step_memory's peak on stage s of the pipeline (bytes), as `schedule` (v chunks) holds it."""
    return step_memory(cfg, batch // (dp * m), seq_len, dp, zero, ck, precision, bucket_cap_mb, tp=tp,
                       sequence_parallel=sp, blocks=stage_blocks(cfg.n_layer, pp, v)[s], first=s == 0,
                       last=s == pp - 1, in_flight=in_flight_formula(schedule, pp, s, m, v), chunks=v,
                       pending_w=pending_w_formula(pp, s, m) if schedule == "zb-h1" else 0)["peak"]


def peak_memory(cfg, batch, seq_len, dp, tp, pp, zero, m, ck, sp, precision="bf16", bucket_cap_mb=25.0, *,
                schedule="1f1b", v=1):
    """The most loaded rank's peak: the first stage's or the last's (ZB-H1's pending W's grow
    down the pipe: every stage weighed)."""
    return max(stage_memory(cfg, batch, seq_len, dp, tp, pp, zero, m, ck, sp, s, precision, bucket_cap_mb,
                            schedule=schedule, v=v) for s in (range(pp) if schedule == "zb-h1" else {0, pp - 1}))


def price(cfg, batch, seq_len, dp, tp, pp, zero, m, ck, sp, precision="bf16", hw=None, bucket_cap_mb=25.0, *,
          schedule="1f1b", v=1):
    """(modelled step seconds, bytes sent (dp, tp, pp)) of the slowest stage (chapter 11, appendix B;
    the step lasts step_units micro-batches' work: appendix G)."""
    hw = hw or Hardware()
    B, T, d, e = batch // (dp * m), seq_len, cfg.n_embd, ELEM[precision]
    compute = flops_per_token(cfg, T) * B * T / (tp * pp) / (hw.peak_flops * hw.mfu)  # one micro-batch
    work = compute * (1 + (recompute_flops_fraction(cfg, T) if ck else 0)) * step_units(schedule, pp, m, v)
    worst = None
    cuts = stage_blocks(cfg.n_layer, pp, v)  # the stages, by what sets their price: blocks and ends
    for blocks, first, last in {(n, s == 0, s == pp - 1) for s, n in enumerate(cuts)}:
        psi = rank_params(cfg, tp, blocks, first, last)
        # tp: this stage's layers' all-reduces, every micro-batch (the embedding's, the
        # head's and the loss's counted on every stage: a small over-count in the middle)
        tp_mb = tp_comm_bytes(replace(cfg, n_layer=blocks), B, T, tp, sp, elem=e)["sent"] if tp > 1 else 0.0
        alpha, beta = link(tp, hw)
        tp_s = m * ((4 * blocks + 5) * MESSAGES[hw.latency]["all_reduce"](tp) * alpha + tp_mb * beta)
        # pp: per micro-batch and chunk, one fp32 activation down and one gradient up, per
        # neighbour (B x T x d, or this rank's T / tp positions under sequence parallelism)
        sends, message = m * (2 * v - first - last), 4.0 * B * T * d / (tp if sp else 1)
        alpha, beta = link(dp * tp * pp, hw)
        pp_s = sends * (alpha + message * beta)
        dp_bytes, dp_s = grad_sync_cost(cfg, psi, dp, tp, pp, zero, m, compute, hw, bucket_cap_mb)
        here = (work + tp_s + pp_s + dp_s, (dp_bytes, m * tp_mb, sends * message))
        worst = here if worst is None or (here[0], sum(here[1])) > (worst[0], sum(worst[1])) else worst
    return worst


def cp_sizes(world: int, seq_len: int) -> list[int]:
    """The cp sizes train_gpt runs: dividing the world, the sequence in 2 cp equal chunks (zigzag)."""
    return [cp for cp in divisors(world) if cp > 1 and seq_len % (2 * cp) == 0]


def cp_memory(cfg, batch, seq_len, dp, cp, zero, m, ck, precision="bf16", bucket_cap_mb=25.0) -> float:
    """One cp rank's peak: every weight, its T/cp tokens of each sequence's activations,
    ZeRO over the dp x cp ranks, and the ring's K, V blocks: the one held and the one arriving."""
    B, t = batch // (dp * m), seq_len // cp
    ring = 2 * 2 * B * t * cfg.n_embd * ELEM[precision]
    return step_memory(cfg, B, t, dp * cp, zero, ck, precision, bucket_cap_mb)["peak"] + ring


def cp_price(cfg, batch, seq_len, dp, cp, zero, m, ck, precision="bf16", hw=None, bucket_cap_mb=25.0):
    """(modelled step seconds, dp bytes, ring bytes) of a dp x cp rank: a 1/cp share of the
    work (zigzag's), the ring's messages, per layer and micro-batch cp - 1 K, V blocks forward and
    K, V with dK, dV backward, counted whole (hidden behind attention only for long blocks:
    a saving left out), then the gradient sync over all dp x cp ranks."""
    hw = hw or Hardware()
    B, T = batch // (dp * m), seq_len
    compute = flops_per_token(cfg, T) * B * T / cp / (hw.peak_flops * hw.mfu)  # one micro-batch
    work = compute * (1 + (recompute_flops_fraction(cfg, T) if ck else 0)) * m
    hops, block = m * cfg.n_layer * 3 * (cp - 1), 2 * B * (T // cp) * cfg.n_embd * ELEM[precision]
    alpha, beta = link(cp, hw)
    dp_bytes, dp_s = grad_sync_cost(cfg, rank_params(cfg, 1, cfg.n_layer, True, True), dp * cp, 1, 1, zero, m,
                              compute, hw, bucket_cap_mb)
    return work + hops * (alpha + block * beta) + dp_s, dp_bytes, hops * block


def _cp_best(cfg, batch, seq_len, dp, cp, zero, ck, ms, budget_gb, precision, hw, bucket_cap_mb):
    """A cp family's cheapest plan that fits among the micro-batch counts `ms`, or None."""
    best = None
    for m in ms:
        peak = cp_memory(cfg, batch, seq_len, dp, cp, zero, m, ck, precision, bucket_cap_mb)
        if peak <= budget_gb * GB:
            step_s, dp_bytes, ring = cp_price(cfg, batch, seq_len, dp, cp, zero, m, ck, precision, hw, bucket_cap_mb)
            c = Plan(dp, 1, 1, zero, m, ck, False, batch // (dp * m), peak, step_s, 0.0, (dp_bytes, 0.0, 0.0), cp, ring)
            best = c if best is None or c.price() < best.price() else best
    return best


def evaluate(cfg, batch, seq_len, dp, tp, pp, zero, m, ck, sp, precision="bf16", hw=None, bucket_cap_mb=25.0, *,
             schedule="1f1b", v=1) -> Plan:
    step_s, sent = price(cfg, batch, seq_len, dp, tp, pp, zero, m, ck, sp, precision, hw, bucket_cap_mb,
                         schedule=schedule, v=v)
    peak = peak_memory(cfg, batch, seq_len, dp, tp, pp, zero, m, ck, sp, precision, bucket_cap_mb,
                       schedule=schedule, v=v)
    return Plan(dp, tp, pp, zero, m, ck, sp, batch // (dp * m), peak, step_s, schedule_bubble(schedule, pp, m, v),
                sent, schedule=schedule, v=v)


def families(cfg: GPTConfig, seq_len: int, world: int):
    """Every (dp, tp, pp, zero, recomputation, sp): a plan but for its micro-batches."""
    for dp, tp, pp in meshes(cfg, world):
        for zero in zero_stages(tp, pp):
            for ck in (False, True):
                for sp in (False, True) if tp > 1 and seq_len % tp == 0 else (False,):
                    yield dp, tp, pp, zero, ck, sp


def _search(ms: list[int], pp: int, schedule="1f1b", v=1) -> tuple[list[int], list[int]]:
    """A family's micro-batch counts, split: those whose in-flight counts still grow with m
    (1F1B's below pp, all of GPipe's: each is checked) and the rest, whose memory falls as m
    grows (a bisection finds the first that fits; the largest needs the least)."""
    full = [in_flight_formula(schedule, pp, s, pp * 10**6, v) for s in range(pp)]
    steady = [m for m in ms if m >= pp and full == [in_flight_formula(schedule, pp, s, m, v) for s in range(pp)]]
    return [m for m in ms if m not in steady], steady


def _family_best(cfg, batch, seq_len, dp, tp, pp, zero, ck, sp, ms, budget_gb, precision, hw, bucket_cap_mb,
                 schedule="1f1b", v=1):
    """The family's cheapest plan that fits among the micro-batch counts `ms` (ascending), or None."""
    how = dict(schedule=schedule, v=v)

    def fits(m):
        return peak_memory(cfg, batch, seq_len, dp, tp, pp, zero, m, ck, sp, precision, bucket_cap_mb, **how) \
            <= budget_gb * GB
    few, many = _search(ms, pp, schedule, v)
    lo = bisect.bisect_left(many, True, key=fits)  # binary search for the first that fits
    best = None
    for m in [m for m in few if fits(m)] + many[lo:]:  # at most the divisors of a share (check_sizes)
        step_s, sent = price(cfg, batch, seq_len, dp, tp, pp, zero, m, ck, sp, precision, hw, bucket_cap_mb, **how)
        key = (step_s, schedule_bubble(schedule, pp, m, v), sum(sent), ck, sp, m)
        best = min(best, (key, m)) if best else (key, m)
    return best and evaluate(cfg, batch, seq_len, dp, tp, pp, zero, best[1], ck, sp, precision, hw, bucket_cap_mb,
                             **how)


def _least(cfg, batch, seq_len, dp, tp, pp, zero, ck, sp, ms, precision, bucket_cap_mb, schedule="1f1b", v=1):
    """(the least peak of the family over `ms`, its m): those still growing each, else the largest."""
    few, many = _search(ms, pp, schedule, v)
    return min((peak_memory(cfg, batch, seq_len, dp, tp, pp, zero, m, ck, sp, precision, bucket_cap_mb,
                            schedule=schedule, v=v), m) for m in few + many[-1:])


def best_per_family(cfg, batch, seq_len, world, budget_gb, precision="bf16", hw=None, bucket_cap_mb=25.0,
                    context_parallel=True):
    """For every family, its cheapest plan that fits (None where none does); with
    `context_parallel`, the dp x cp families too: (dp, 1, 1, zero, ck, False, cp)."""
    check_sizes(batch, seq_len, world, budget_gb)
    for f in families(cfg, seq_len, world):
        yield f, _family_best(cfg, batch, seq_len, *f, micro_options(batch, f[0]), budget_gb, precision, hw,
                              bucket_cap_mb)
    for cp in cp_sizes(world, seq_len) if context_parallel else ():
        for zero, ck in ((z, ck) for z in (0, 1, 2) for ck in (False, True)):  # (train_gpt: no ZeRO-3 with cp)
            dp = world // cp
            yield (dp, 1, 1, zero, ck, False, cp), _cp_best(cfg, batch, seq_len, dp, cp, zero, ck,
                                                             micro_options(batch, dp), budget_gb, precision, hw,
                                                             bucket_cap_mb)


def plan_mesh(cfg: GPTConfig, batch: int, seq_len: int, world: int, budget_gb: float, precision: str = "bf16",
              hw: Hardware | None = None, bucket_cap_mb: float = 25.0, context_parallel: bool = True) -> tuple[Plan, str]:
    """The cheapest plan whose most loaded rank fits `budget_gb`, and one line of reasoning
    (for a cp plan, why: what the best plan without cp needs or costs)."""
    fits = [c for _, c in best_per_family(cfg, batch, seq_len, world, budget_gb, precision, hw, bucket_cap_mb,
                                          context_parallel) if c]
    if not fits:
        raise PlanError(_nothing_fits(cfg, batch, seq_len, world, budget_gb, precision, bucket_cap_mb))
    best, *rest = sorted(fits, key=Plan.price)
    other = next((c for c in rest if c.mesh() != best.mesh()), None)
    line = explain(best, budget_gb) + (f"; next best mesh: {other.mesh()}, {1e3 * other.step_s:.1f} ms" if other else "")
    if best.cp > 1:
        plain = next((c for c in rest if c.cp == 1), None)
        line += (f"; why cp {best.cp}: each rank holds 1/{best.cp} of every sequence's activations, " +
                 (f"and the best plan without it, {plain.mesh()}, models {1e3 * plain.step_s:.1f} ms a step" if plain
                  else f"and without it nothing fits {budget_gb:g} GB per rank"))
    return best, line


def plan_on_mesh(cfg, batch, seq_len, dp, tp, pp, budget_gb, precision="bf16", sp=False, zeros=None,
                 micros=None, ckpts=(False, True), hw=None, bucket_cap_mb=25.0, schedule="1f1b",
                 virtual_stages=2) -> tuple[Plan, str]:
    """The cheapest plan on a mesh already chosen (train_gpt's --tp and --pp), among the
    ZeRO stages `zeros`, micro-batch counts `micros` and recomputation choices `ckpts`
    given (None: all that the mesh allows), for the pipeline `schedule` (interleaved: over
    `virtual_stages` chunks; ZB-H1 refuses recomputation): train_gpt's auto flags on a mesh."""
    check_sizes(batch, seq_len, dp, budget_gb)
    v = virtual_stages if schedule == "interleaved" and pp > 1 else 1  # (its m: in groups of pp)
    valid = [m for m in micro_options(batch, dp) if v == 1 or m % pp == 0]
    ms = sorted(set(micros or valid) & set(valid))
    if not ms:
        groups = f" in interleaved 1F1B's groups of --pp {pp}" if v > 1 else ""
        raise PlanError(f"{batch} sequences over {dp} data-parallel ranks do not split into {micros or 'any'} "
                        f"micro-batches{groups}: " + (f"choose from {some(valid)}" if valid else
                                                     f"use a --batch-size divisible by {dp * pp}"))
    ckpts = [ck for ck in ckpts if not (ck and schedule == "zb-h1" and pp > 1)]
    how = dict(schedule=schedule if pp > 1 else "1f1b", v=v)
    given = [(dp, tp, pp, z, ck, sp) for z in (zeros or zero_stages(tp, pp)) for ck in ckpts]  # families
    fits = [c for f in given if (c := _family_best(cfg, batch, seq_len, *f, ms, budget_gb, precision, hw,
                                                   bucket_cap_mb, **how))]
    if not fits:
        _, m, (_, _, _, z, ck, _) = min((*_least(cfg, batch, seq_len, *f, ms, precision, bucket_cap_mb, **how), f)
                                        for f in given)
        least = evaluate(cfg, batch, seq_len, dp, tp, pp, z, m, ck, sp, precision, hw, bucket_cap_mb, **how)
        raise PlanError(f"nothing fits {budget_gb:g} GB per rank on {least.mesh()}: the least, {least.describe()}, "
                        f"needs {least.peak / GB:.1f} GB; use more ranks, a shorter --seq-len, a smaller model "
                        "or a larger --memory-budget-gb")
    return min(fits, key=Plan.price), explain(min(fits, key=Plan.price), budget_gb)


def explain(c: Plan, budget_gb: float) -> str:
    dp, tp, pp = (x / GB for x in c.sent)
    axes = f"dp {dp:.2f}, cp {c.cp_sent / GB:.2f}" if c.cp > 1 else f"dp {dp:.2f}, tp {tp:.2f}, pp {pp:.2f}"
    return (f"{c.describe()}: {c.peak / GB:.1f} of {budget_gb:g} GB per rank, bubble {c.bubble:.2f}, "
            f"{(sum(c.sent) + c.cp_sent) / GB:.2f} GB sent per rank per step ({axes}), "
            f"{1e3 * c.step_s:.1f} ms a step modelled")


def _nothing_fits(cfg, batch, seq_len, world, budget_gb, precision, bucket_cap_mb) -> str:
    """Says what the least memory on this world is, and what to change."""
    peak, m, (dp, tp, pp, zero, ck, sp) = min(
        (*_least(cfg, batch, seq_len, *f, micro_options(batch, f[0]), precision, bucket_cap_mb), f)
        for f in families(cfg, seq_len, world))
    return (f"nothing fits {budget_gb:g} GB per rank on {world} ranks: the least, dp {dp} x tp {tp} x pp {pp}, "
            f"ZeRO-{zero}, {m} micro-batches of {batch // (dp * m)}{', sequence parallel' if sp else ''}, "
            f"{'recomputation' if ck else 'no recomputation'}, needs "
            f"{peak / GB:.1f} GB; use more ranks, a shorter --seq-len, a smaller model or a larger --budget-gb")
