"""Interleaved 1F1B and ZB-H1 written as lists, before any machine runs them: what each rank
computes in which order, which messages cross after each step, and the ideal timeline, where
every forward, backward and weight step costs a fixed time and messages cost nothing.

Chapter 11 (chapters/11_pipeline.md), its appendix. minidist/pipeline/slots.py runs these lists;
`pytest tests/test_pipeline_schedules.py` checks them against torch's own schedules, replays
their messages on every link, and holds their ideal timelines to the closed forms in
minidist/pipeline/measure.py. To see one, after `from minidist.pipeline import orders, measure`:
`print(measure.draw(orders.ideal_timeline("zb-h1", 4, 8, B=1, W=1), 54))`.

An action is (kind, vstage, mb): kind "F" (forward), "B" (backward; with a split backward only
the input gradient) or "W" (the weight gradients), of micro-batch mb through virtual stage
vstage, one of the p v chunks the model is cut into (rank r holds r, r + p, r + 2p, ...; with
v = 1 the vstage is the rank). A slot is a few actions after which the rank talks once: it
sends what the slot's F and B made and receives what the next slot's need, in one batch.
"""

from __future__ import annotations

from fractions import Fraction

from minidist.pipeline.measure import Event, StepRecord


def interleaved_slots(p: int, v: int, m: int, rank: int) -> list[list[tuple]]:
    """Megatron's interleaved 1F1B on `rank`: forwards go through chunk 0 of p micro-batches
    at a time, then the same p through chunk 1, ...; backwards likewise from the last chunk.
    A warm-up of (v - 1) p + 2 (p - 1 - rank) forwards fills the pipe, then a forward and a
    backward share a slot (the four messages they cross with go as one batch, as Megatron's
    send_forward_backward_recv_forward_backward: sent one pair at a time they deadlock), then
    the backwards left. The groups of p need m divisible by p. (torch's ScheduleInterleaved1F1B
    and today's Megatron warm up so for every m; older Megatron ran all forwards first at m = p.)"""
    if m < 1 or m % p:
        near = sorted({max(p, m - m % p), m - m % p + p})
        raise ValueError(f"interleaved 1F1B takes micro-batches in groups of p = {p} (Megatron's order): "
                         f"got {m}; use {' or '.join(map(str, near))} (--grad-accum-steps)")
    total = m * v
    warmup = min((v - 1) * p + 2 * (p - 1 - rank), total)

    def step(k: int, backward: bool) -> tuple:
        group, at = divmod(k, p * v)  # the k-th forward (or backward) of this rank
        chunk = at // p if not backward else v - 1 - at // p
        return chunk * p + rank, group * p + at % p

    slots = [[("F", *step(k, False))] for k in range(warmup)]
    slots += [[("F", *step(warmup + j, False)), ("B", *step(j, True))] for j in range(total - warmup)]
    return slots + [[("B", *step(j, True))] for j in range(total - warmup, total)]


def zb_h1_slots(p: int, v: int, m: int, stage: int) -> list[list[tuple]]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024) on `stage`: 1F1B's
    warm-up and its alternation of F and B, each backward split into B (the input gradient,
    which the stage above waits for) and W (the weight gradients, which nobody waits for).
    Stage s defers its first s W's, so its B's go up a hop earlier; each later B is followed
    by the oldest pending W, and what is left runs at the end, in the bubble 1F1B leaves there.
    One action per slot (W's ride with the B before them: they run while its messages fly)."""
    if v != 1:
        raise ValueError(f"ZB-H1 runs one chunk per stage: got {v} virtual stages; use 1, or interleaved")
    warmup, done_w = min(p - 1 - stage, m), 0
    slots = [[("F", stage, i)] for i in range(warmup)]
    for k in range(m):
        if warmup + k < m:
            slots.append([("F", stage, warmup + k)])
        slots.append([("B", stage, k)])
        if k >= stage:  # past the deferred ones: the oldest pending W
            slots[-1].append(("W", stage, done_w))
            done_w += 1
    slots[-1] += [("W", stage, i) for i in range(done_w, m)]
    return slots


SLOTS = {"interleaved": interleaved_slots, "zb-h1": zb_h1_slots}


def talks(slots: list[list[tuple]], p: int, n_vstages: int) -> list[tuple[list, list]]:
    """(sends, receives) before the first slot, then after each: one batch each. A send is
    ("act", vstage, mb, peer), the output of this rank's F, or ("grad", vstage, mb, peer), the
    input gradient of its B; a receive names the action that needs it, ("act", ...) a
    forward's input, ("grad", ...) a backward's output gradient; peer is a rank of the pipe."""
    def needs(slot):
        return [("act", vs, mb, (vs - 1) % p) for kind, vs, mb in slot if kind == "F" and vs > 0] + \
               [("grad", vs, mb, (vs + 1) % p) for kind, vs, mb in slot if kind == "B" and vs < n_vstages - 1]

    def makes(slot):
        return [("act", vs, mb, (vs + 1) % p) for kind, vs, mb in slot if kind == "F" and vs < n_vstages - 1] + \
               [("grad", vs, mb, (vs - 1) % p) for kind, vs, mb in slot if kind == "B" and vs > 0]

    after = [(makes(slot), needs(slots[k + 1]) if k + 1 < len(slots) else []) for k, slot in enumerate(slots)]
    return [([], needs(slots[0]) if slots else [])] + after


def ideal_timeline(schedule: str, p: int, m: int, v: int = 1, F=1, B=2, W=0) -> list[StepRecord]:
    """Every rank's schedule on the ideal machine: a forward of a chunk costs F / v, its backward
    B / v (with a split backward only the input gradient), its W step W / v; messages are free;
    each step starts as soon as its input exists (F after the previous vstage's F, B after the
    next one's B, or after its own F on the last) and its rank is free. Times are exact
    fractions. One StepRecord per rank, for measure's bubble_fraction, in_flight and draw.
    (For zb-h1 give B and W apart: B=1, W=1 splits chapter 11's backward of 2.)"""
    cost = {"F": Fraction(F) / v, "B": Fraction(B) / v, "W": Fraction(W) / v}
    queues = [[a for slot in SLOTS[schedule](p, v, m, r) for a in slot] for r in range(p)]
    done, free = {}, [Fraction(0)] * p
    records = [StepRecord(stage=r, stages=p) for r in range(p)]
    while any(queues):
        left = sum(map(len, queues))
        for r in range(p):
            while queues[r]:
                kind, vs, mb = queues[r][0]
                after = {"F": ("F", vs - 1, mb), "W": ("B", vs, mb),
                         "B": ("B", vs + 1, mb) if vs < p * v - 1 else ("F", vs, mb)}[kind]
                if after not in done and not (kind == "F" and vs == 0):
                    break  # its input is not made yet
                start = max(free[r], done.get(after, Fraction(0)))
                free[r] = done[kind, vs, mb] = start + cost[kind]
                records[r].events.append(Event(kind, mb, start, free[r], vs // p))
                queues[r].pop(0)
        if sum(map(len, queues)) == left:
            raise RuntimeError(f"{schedule} deadlocks at p={p}, m={m}, v={v}")
    return records
