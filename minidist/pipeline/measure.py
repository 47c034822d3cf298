"""What a pipeline step is measured with: its timeline, its bubble and its in-flight
activations, each beside the formula it is checked against.

Chapter 11 (chapters/11_pipeline.md). A `StepRecord` is an Observer of the schedule in
minidist/pipeline/schedules.py (`pipeline_step(..., record=StepRecord())`): it times each
forward, backward and batch of messages (on a GPU, synchronised: `stamp`) and counts what each
forward saves for backward. Exercised by `pytest tests/test_pipeline.py` and
`pytest tests/test_pipeline_schedules.py`. The formulas, for p stages and m micro-batches:
bubble (p - 1) / (m + p - 1) in GPipe and 1F1B; in flight, GPipe m micro-batches on every stage,
1F1B min(p - stage, m) on stage `stage`; interleaved 1F1B's and ZB-H1's below theirs, each exact
on the ideal timeline (minidist/pipeline/orders.py) where F, B and W cost fixed units.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from minidist.cost_model import block_activation_bytes
from minidist.model import GPTConfig
from minidist.pipeline.schedules import Observer

COMPUTE = ("F", "B", "W")  # the kinds of event that are work; the rest is waiting or talking


@dataclass
class Event:
    """One thing a stage did: `kind` "F", "B", "W" (a split backward's weight half), "send",
    "recv", "send+recv" or "idle", of micro-batch `mb` in the stage's `chunk` (interleaved 1F1B's;
    0 elsewhere); start and end in seconds since the barrier that began the step."""
    kind: str
    mb: int | None
    start: float
    end: float
    chunk: int = 0


def stamp(device: torch.device) -> float:
    """The timeline's clock on `device`: perf_counter, after waiting for the GPU there. A CUDA
    kernel or NCCL message is only queued when its call returns, so an unsynchronised stamp
    would time the queueing, not the work; this serialises host and GPU, costing a few
    microseconds per stamp. On a CPU (gloo) a call returns when its work is done: no wait."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@dataclass
class StepRecord(Observer):
    """What one stage saw during one step (pipeline_step(..., record=this) fills it). With
    count_saved=False the forwards' saved bytes are not counted: the count's hooks hold every
    saved tensor through Python, and slow a split backward (ZB-H1's B) the more, the more
    micro-batches wait for their W (chapter 11's appendix, G): a timed step should not count."""
    stage: int = 0
    stages: int = 1
    events: list = field(default_factory=list)       # Event, in the order they happened
    saved_bytes: list = field(default_factory=list)  # per forward, in order: bytes saved for backward
    count_saved: bool = True

    def order(self) -> list[tuple[str, int]]:
        """The schedule as run: [("F", 0), ("F", 1), ("B", 0), ...]."""
        return [(e.kind, e.mb) for e in self.events if e.kind in COMPUTE]

    def actions(self) -> list[tuple[str, int, int]]:
        """The same with each step's chunk: [("F", chunk, mb), ...]."""
        return [(e.kind, e.chunk, e.mb) for e in self.events if e.kind in COMPUTE]

    @property
    def peak_in_flight(self) -> int:
        """Most (chunk, micro-batch) forwards whose backward had not ended at one moment."""
        return in_flight(self.actions())

    @property
    def peak_saved(self) -> int:
        """Most bytes saved for backward held at one moment (a forward's until its last
        backward step: W where the backward is split, B elsewhere)."""
        sizes = iter(self.saved_bytes)
        return _peak(self.actions(), lambda unit: next(sizes, 0))

    def begin(self, stage) -> None:
        self.stage, self.stages = stage.stage, stage.stages
        self._device = next(stage.parameters()).device  # a record is pickled: no closures
        dist.barrier(group=stage.group)  # every stage's clock starts at the same moment
        self._t0 = stamp(self._device)

    @contextmanager
    def doing(self, kind: str, mb: int, stage, chunk: int = 0):
        counted, hooks = count_saved_bytes(stage) if kind == "F" and self.count_saved else ([0], nullcontext())
        start = stamp(self._device)
        with hooks:
            yield
        self.events.append(Event(kind, mb, start - self._t0, stamp(self._device) - self._t0, chunk))
        if kind == "F" and self.count_saved:
            self.saved_bytes.append(counted[0])


# ------------------------------------------------------------------ the formulas

def bubble_formula(p: int, m: int) -> float:
    """The idle share of a step, (p - 1) / (m + p - 1): with equal stages, each one works
    m units of the m + p - 1 that the step lasts (p - 1 fill the pipe and drain it)."""
    return (p - 1) / (m + p - 1)


def in_flight_formula(schedule: str, p: int, stage: int, m: int, v: int = 1) -> int:
    """Micro-batches whose activations stage `stage` holds at once, at most; for interleaved
    1F1B, (chunk, micro-batch) pairs, each a v-th of the stage's blocks. Read off each order:
    1F1B holds its warm-up plus one; interleaved its longer warm-up, (v - 1) p + 2 (p - 1 -
    stage), plus one; ZB-H1 holds a micro-batch until its W, and stage s defers s of them past
    its p - 1 - s warm-up, so every stage holds p."""
    if schedule == "gpipe":
        return m
    if schedule == "interleaved":
        return min((v - 1) * p + 2 * (p - 1 - stage) + 1, v * m)
    return min(p, m) if schedule == "zb-h1" else min(p - stage, m)


def interleaved_bubble_formula(p: int, m: int, v: int) -> float:
    """Interleaved 1F1B's idle share of a step, (p - 1) / (v m + p - 1): the pipe fills and
    drains through chunks a v-th of a stage long, so the p - 1 hops cost (p - 1)(F + B) / v
    of the m (F + B) + (p - 1)(F + B) / v the step lasts. Megatron states it relative to the
    work, idle / work = (p - 1) / (v m). Exact on the ideal timeline when p divides m."""
    return (p - 1) / (v * m + p - 1)


def zb_h1_idle(p: int, m: int, F=1, B=1, W=1):
    """Idle time per stage of ZB-H1 on the ideal timeline, with F, B and W the forward, input-
    and weight-gradient times: (p - 1)(F + B - min(F, B, W)), the paper's (p - 1)(F + B - W)
    when W is the shortest; 1F1B's is (p - 1)(F + B + W). Exact for m >= p (checked in the
    tests); the step lasts m (F + B + W) plus this."""
    if m < p:
        raise ValueError(f"the closed form holds from m = p = {p} micro-batches on; got m = {m}")
    return (p - 1) * (F + B - min(F, B, W))


def step_units(schedule: str, p: int, m: int, v: int = 1) -> float:
    """A step's length on the ideal timeline, in units of one micro-batch's forward and
    backward through one stage (its work is m of them; the bubble 1 - m / this). GPipe and
    1F1B: m + p - 1. Interleaved: m + (p - 1) / v (p dividing m). ZB-H1 with F = B = W
    (chapter 11's backward of two forwards, split in two halves): m + (p - 1) / 3 from m = p
    on, where each hop saves one W of its three thirds; below, m + (2 (p - 1) - (m - 1)) / 3."""
    if schedule == "interleaved":
        return m + (p - 1) / v
    if schedule == "zb-h1":
        return m + (2 * (p - 1) - min(m - 1, p - 1)) / 3
    return m + p - 1


def schedule_bubble(schedule: str, p: int, m: int, v: int = 1) -> float:
    """The idle share of the ideal step: 1 - m / step_units; GPipe's and 1F1B's bubble_formula."""
    units = step_units(schedule, p, m, v)
    return (units - m) / units


def pending_w_formula(p: int, stage: int, m: int) -> int:
    """ZB-H1's most W's pending at once on `stage` (its B done, its W not): the s deferred,
    and the one of the slot that just ran its B."""
    return min(stage + 1, m)


def stage_activation_bytes(cfg: GPTConfig, B: int, T: int, n_blocks: int, first: bool,
                           last: bool) -> int:
    """Bytes one micro-batch of B x T tokens leaves saved for backward on a stage of
    `n_blocks` blocks, fp32 (chapter 09's count, split at the cut): the blocks, plus the
    embeddings' indices on the first stage and the head's activations and the loss's fp32
    total weight on the last. Exact, to the byte."""
    d, V = cfg.n_embd, cfg.vocab_size
    total = n_blocks * block_activation_bytes(B, T, d, cfg.n_head)
    if first:
        total += 8 * B * T + 8 * T                          # idx, positions
    if last:
        total += B * T * (8 + 4 * d + 8 + 4 * d + 4 * V)    # targets, ln_f in/stats/out, log-softmax
        total += 4                                          # nll_loss's total weight
    return total


# ------------------------------------------------------------------ the measurements

def count_saved_bytes(module):
    """(counter, context): inside the context, every storage autograd saves for backward is
    counted once into counter[0], `module`'s parameters left out (chapter 09's count)."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen, counted = set(), [0]

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            counted[0] += st.nbytes()
        return t
    return counted, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def with_idle(records: list[StepRecord]) -> list[list[Event]]:
    """Every stage's events with its gaps filled by "idle" events, from the barrier to the
    moment the last stage finished (so every stage's timeline spans the same step)."""
    end = max((e.end for r in records for e in r.events), default=0.0)
    out = []
    for r in records:
        events, t = [], 0.0
        for e in sorted(r.events, key=lambda e: e.start):
            if e.start > t:
                events.append(Event("idle", None, t, e.start))
            events.append(e)
            t = max(t, e.end)
        if end > t:
            events.append(Event("idle", None, t, end))
        out.append(events)
    return out


def bubble_fraction(records: list[StepRecord]) -> float:
    """The measured bubble of one step, all stages' records together: the share of the
    step's time (barrier to last event, times p stages) in which a stage did no forward
    or backward (messages and Python's overhead count as bubble)."""
    span = max((e.end for r in records for e in r.events), default=0.0)
    if span <= 0:
        return 0.0
    busy = sum(e.end - e.start for r in records for e in r.events if e.kind in COMPUTE)
    return 1.0 - busy / (len(records) * span)


def in_flight(order: list[tuple]) -> int:
    """The most micro-batches between their forward and the end of their backward, from a
    stage's order: ("F", mb), ... or ("F", chunk, mb), ... (the end: W where there is one)."""
    return _peak(order, lambda unit: 1)


def _peak(order, size) -> int:
    """The most of `size(unit)` held at once: a unit (an order entry's tail) from its F to
    its W if the order has one, else its B."""
    split = {tuple(a[1:]) for a in order if a[0] == "W"}
    held, now, most = {}, 0, 0
    for kind, *unit in order:
        unit = tuple(unit)
        if kind == "F":
            held[unit] = size(unit)
            now += held[unit]
        elif kind == "W" or unit not in split:
            now -= held.pop(unit)
        most = max(most, now)
    return most


def draw(records: list[StepRecord], width: int = 72) -> str:
    """The timelines as text, one line per stage: micro-batch i's forward the digit i, its
    backward the i-th letter, its W (a split backward's weight half) the i-th capital (all mod
    10), "." where the stage waited or talked; with chunks, a line under each giving each
    step's chunk."""
    span = max((e.end for r in records for e in r.events), default=0.0) or 1.0
    chunked = any(e.chunk for r in records for e in r.events)
    lines = []
    for r in records:
        row, chunks = ["."] * width, [" "] * width
        for e in r.events:
            if e.kind in COMPUTE:
                a, b = int(e.start / span * width), max(int(e.end / span * width), int(e.start / span * width) + 1)
                mark = {"F": "0123456789", "B": "abcdefghij", "W": "ABCDEFGHIJ"}[e.kind][e.mb % 10]
                for i in range(a, min(b, width)):
                    row[i], chunks[i] = mark, str(e.chunk % 10)
        lines.append(f"stage {r.stage}: " + "".join(row))
        if chunked:
            lines.append("  chunk: " + "".join(chunks).rstrip())
    return "\n".join(lines)
