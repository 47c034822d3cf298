"""One pipeline step of every schedule by name: GPipe and 1F1B through schedules.py's
pipeline_step, interleaved 1F1B and ZB-H1 by running their slots (minidist/pipeline/orders.py)
here, with pipeline_step's contract: when `run_schedule` returns, this stage's gradients are
one process's gradient accumulation over the same micro-batches (the tied matrix's summed
over the first and the last stage), and it returns the mean loss per target token.

Chapter 11 (chapters/11_pipeline.md), its appendix. Exercised by
`pytest tests/test_pipeline_schedules.py`.

Why nothing deadlocks: after each slot the rank posts one batch (`dist.batch_isend_irecv`) of
what the slot made and what the next slot needs, and waits for it (running the slot's W's
while it flies). Each link's two ends then post the same messages in the same order, and no
wait is for a message posted after it; the tests replay every link's messages to check both,
under the strictest rule (a batch completes only when its peers post the matching batch).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

from minidist.comm import wait
from minidist.pipeline.interleaved import InterleavedStage
from minidist.pipeline.orders import SLOTS, talks
from minidist.pipeline.schedules import SCHEDULES, Observer, Stage, pipeline_step
from minidist.pipeline.split import backward_input, backward_weights, capture
from minidist.train import micro_batch_shape, target_count

ALL_SCHEDULES = (*SCHEDULES, *SLOTS)  # the names run_schedule takes


class Quiet(Observer):
    """The default watcher here: ignores everything, the chunk included."""

    def doing(self, kind: str, mb: int, stage, chunk: int = 0):
        return nullcontext()


def chunks_of(stage: Stage) -> int:
    """How many chunks `stage` holds: an InterleavedStage's v, a Stage's one."""
    return getattr(stage, "virtual_stages", 1)


def stage_for(schedule: str, model, pp_group=None, virtual_stages: int = 2) -> Stage:
    """The stage `schedule` runs on: an InterleavedStage of `virtual_stages` chunks for
    "interleaved", a Stage for the others."""
    if schedule == "interleaved":
        return InterleavedStage(model, pp_group, virtual_stages)
    return Stage(model, pp_group)


def run_schedule(stage: Stage, micro_batches, schedule: str = "1f1b", dp_group=None,
                 record: Observer | None = None, loss_scale: float = 1.0, amp=nullcontext) -> float:
    """pipeline_step for all of ALL_SCHEDULES: "gpipe", "1f1b" (a Stage), "interleaved" (an
    InterleavedStage of v >= 2 chunks), "zb-h1" (a Stage). Arguments as pipeline_step's; a
    `record` here is told each step's chunk too (a StepRecord is)."""
    if schedule not in ALL_SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}: use one of {', '.join(ALL_SCHEDULES)}")
    v = chunks_of(stage)
    if (schedule == "interleaved") != (v > 1):
        raise ValueError(f"{schedule} needs " + ("an InterleavedStage(model, pp_group, virtual_stages=v), v >= 2"
                                                 if schedule == "interleaved" else f"one chunk per stage, not {v}"))
    if schedule in SCHEDULES:
        return pipeline_step(stage, micro_batches, schedule, dp_group, record, loss_scale, amp)
    if stage.stages < 2:
        raise ValueError(f"{schedule} needs at least 2 pipeline stages: use --pp 2 or more, or 1f1b")
    if schedule == "zb-h1" and any(getattr(b, "recompute", None) is not None for b in stage.blocks.values()):
        raise ValueError("zb-h1 splits the backward by the layers' outputs, which recomputation would "
                         "make again: drop activation checkpointing, or use 1f1b")
    # normalised as pipeline_step (and minidist.train.forward_backward) normalise
    device = next(stage.parameters()).device
    count = target_count(micro_batches, () if dp_group is None else (dp_group,), device)
    slots = SLOTS[schedule](stage.stages, v, len(micro_batches), stage.stage)
    dp = 1 if dp_group is None else dist.get_world_size(dp_group)
    run = _SlotRun(stage, micro_batches, loss_scale * dp / count.item(), Quiet() if record is None else record, amp)
    run.run(slots)
    stage.allreduce_tied_grads()
    total = run.loss_sum.reshape(1)  # only the last vstage's rank added to it
    dist.all_reduce(total, group=stage.group)
    if dp_group is not None:
        dist.all_reduce(total, group=dp_group)
    return (total / count).item()


class _SlotRun:
    """One step on one rank: its micro-batches, and by (vstage, micro-batch) what each forward
    keeps for its backward (the input received, the output, the gradient that comes back, and,
    with a split backward, what its W needs), and the tensors waiting to be sent."""

    def __init__(self, stage: Stage, micro_batches, scale: float, watch: Observer, amp):
        self.s, self.mbs, self.scale, self.watch, self.amp = stage, micro_batches, scale, watch, amp
        self.p, self.v = stage.stages, chunks_of(stage)
        self.last = self.p * self.v - 1
        self.ranks = dist.get_process_group_ranks(dist.group.WORLD if stage.group is None else stage.group)
        p = next(stage.parameters())
        self.shape = stage.activation_shape(*micro_batch_shape(micro_batches))
        self.dtype, self.device = p.dtype, p.device
        self.inputs, self.outputs, self.grads, self.noted, self.pending, self.ready = {}, {}, {}, {}, {}, {}
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=p.device)
        watch.begin(stage)

    def run(self, slots) -> None:
        self.split = any(kind == "W" for slot in slots for kind, _, _ in slot)
        batches = talks(slots, self.p, self.last + 1)
        self.wait(self.post(*batches[0]))
        for slot, batch in zip(slots, batches[1:]):
            for action in slot:
                if action[0] != "W":
                    self.compute(*action)
            posted = self.post(*batch)
            for kind, vs, mb in slot:  # W's: while the messages fly
                if kind == "W":
                    with self.watch.doing("W", mb, self.s, vs // self.p):
                        backward_weights(self.pending.pop((vs, mb)))
            self.wait(posted)

    def compute(self, kind: str, vs: int, mb: int) -> None:
        chunk, key = vs // self.p, (vs, mb)
        if kind == "F":
            x, y = self.mbs[mb]
            inp = x if vs == 0 else self.inputs[key]
            notes = capture(self.s) if self.split else nullcontext([])
            with self.watch.doing("F", mb, self.s, chunk), notes as noted, self.amp():
                # (a Stage is one chunk: chunk 0's call is the plain one)
                out = self.s(inp, y if vs == self.last else None, *([chunk] if chunk else []))
                if vs == self.last:  # token-normalised, as minidist.train.forward_backward
                    self.loss_sum += out.detach().double()
                    out = out.float() * self.scale
            self.outputs[key], self.noted[key] = out, noted
            if vs < self.last:
                self.ready["act", vs, mb] = out.detach()
            return
        out, grad = self.outputs.pop(key), self.grads.pop(key, None)
        inp = self.inputs.pop(key, None)
        with self.watch.doing("B", mb, self.s, chunk):
            if self.split:
                g_in, self.pending[key] = backward_input(out, grad, inp, self.noted.pop(key))
            else:
                torch.autograd.backward(out, grad)
                g_in = None if inp is None else inp.grad
        if vs > 0:
            self.ready["grad", vs, mb] = g_in

    def post(self, sends, recvs):
        """Post one batch: each send's tensor, a fresh buffer for each receive."""
        ops, kept = [], []
        for what, vs, mb, peer in sends:
            kept.append(self.ready.pop((what, vs, mb)))
            ops.append(dist.P2POp(dist.isend, kept[-1], self.ranks[peer], self.s.group))
        for what, vs, mb, peer in recvs:
            buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            (self.inputs if what == "act" else self.grads)[vs, mb] = buf
            ops.append(dist.P2POp(dist.irecv, buf, self.ranks[peer], self.s.group))
        works = dist.batch_isend_irecv(ops) if ops else []
        return works, sends, recvs, kept

    def wait(self, posted) -> None:
        works, sends, recvs, _ = posted  # (the sent tensors stay referenced until here)
        if not works:
            return
        kind = "send+recv" if sends and recvs else ("send" if sends else "recv")
        _, vs, mb, _ = (recvs or sends)[-1]  # the one received, if any: what the wait was for
        where = f"pipeline: rank {dist.get_rank()} could not {kind} with ranks " + \
                ", ".join(str(self.ranks[peer]) for *_, peer in sends + recvs)
        with self.watch.doing(kind, mb, self.s, vs // self.p):
            for w in works:
                wait(w, where, hint=": timed out (is that rank stopped?)")
        for what, vs, mb, _ in recvs:
            if what == "act":
                self.inputs[vs, mb].requires_grad_()  # a leaf: backward leaves its gradient here
