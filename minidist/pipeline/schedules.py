"""Pipeline parallelism: the GPT cut by layers into stages, one per rank of the pipeline
group, passing activations forward and their gradients back to its neighbours by
point-to-point messages; and two schedules of the micro-batches, GPipe (all forwards, then
all backwards) and 1F1B (one forward, one backward). Chapter 11 (chapters/11_pipeline.md);
`pytest tests/test_pipeline.py` checks both against one process's gradient accumulation.

Read top to bottom: `split_layers`, `Stage`, `exchange`, `Observer`, `gpipe` and
`one_f_one_b` (written with a `_Run`'s forward, backward and talk), `pipeline_step`.

Why nothing deadlocks. A send may not finish before the receiver posts its receive (not
on gloo, not in NCCL's kernels), so on each link both sides post the same messages in the
same order. GPipe keeps that by construction: all activations go down, then all gradients
come up. 1F1B's steady state does not: a stage sends activation i down and next needs
gradient j from below, while the stage below sends gradient j up and next needs
activation i; posted one at a time, each send waits for a receive the other side posts
only after its own send. So the send and the receive that cross on one link go as one
batch (`dist.batch_isend_irecv`, as Megatron's send_forward_recv_backward). Every stage
knows the activation shape from its micro-batches, so receive buffers need no message.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn

from minidist.comm import wait
from minidist.model import GPT
from minidist.train import micro_batch_shape, target_count


def split_layers(n_layer: int, pp: int) -> list[range]:
    """The blocks of each of `pp` stages: contiguous, as equal as they divide, the extra
    ones on the first stages (the last stage also runs the head, the first only a lookup)."""
    if not 1 <= pp <= n_layer:
        raise ValueError(f"--pp {pp} needs 1 to n_layer={n_layer} stages (each stage holds at least "
                         f"one block): use --pp <= {n_layer}, or a deeper model")
    base, extra = divmod(n_layer, pp)
    sizes = [base + (s < extra) for s in range(pp)]
    starts = [sum(sizes[:s]) for s in range(pp)]
    return [range(a, a + n) for a, n in zip(starts, sizes)]


def describe_cut(n_layer: int, pp: int) -> str:
    """The cut, for the log: "stage 0: embeddings + blocks 0-1 | stage 1: blocks 2-3 + ln_f + head"."""
    parts = []
    for s, r in enumerate(split_layers(n_layer, pp)):
        blocks = f"block {r[0]}" if len(r) == 1 else f"blocks {r[0]}-{r[-1]}"
        parts.append(f"stage {s}: " + " + ".join((["embeddings"] if s == 0 else []) + [blocks]
                                                 + (["ln_f + head"] if s == pp - 1 else [])))
    return " | ".join(parts)


class Stage(nn.Module):
    """This rank's stage of `model` (the same on every stage): its blocks, plus the
    embeddings on the first stage and the final norm and head on the last, named as in the
    full model, so a stage's state_dict is a slice of the full one. `model`: a GPT, whose
    weights are copied, or this rank's tensor-parallel shard of one (chapter 10's
    ParallelGPT), taken as it is. `pp_group`: this pipeline's ranks in stage order (None:
    the world). forward(x, targets) takes token indices on the first stage, the previous
    stage's activation elsewhere; it returns the activation to send on, and on the last
    stage the loss summed over the targets (-1 masked), as model(x, y, reduction="sum")."""

    def __init__(self, model: nn.Module, pp_group=None):
        super().__init__()
        self.group = pp_group
        self.stage, self.stages = dist.get_rank(pp_group), dist.get_world_size(pp_group)
        ranks = dist.get_process_group_ranks(dist.group.WORLD if pp_group is None else pp_group)
        self.config = cfg = model.config
        self.layers = split_layers(cfg.n_layer, self.stages)[self.stage]
        self.is_first, self.is_last = self.stage == 0, self.stage == self.stages - 1
        self.prev = None if self.is_first else ranks[self.stage - 1]  # global ranks (P2POp's);
        self.next = None if self.is_last else ranks[self.stage + 1]   # None at the pipe's ends
        self.kind = type(model)  # the ends run its embed and head, which read only what we take
        self.tp_group = getattr(model, "tp_group", None)  # chapter 10's, when model is a shard
        self.sequence_parallel = getattr(model, "sequence_parallel", False)
        take = copy.deepcopy if isinstance(model, GPT) else (lambda module: module)
        if self.is_first or self.is_last:
            self.wte = take(model.wte)  # the tied matrix: the lookup and the head
        if self.is_first:
            self.wpe, self.drop = take(model.wpe), take(model.drop)
        self.blocks = nn.ModuleDict({str(i): take(model.blocks[i]) for i in self.layers})
        if self.is_last:
            self.ln_f = take(model.ln_f)
            self.lm_head = (nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False, device="meta")
                            if isinstance(model, GPT) else model.lm_head)
            self.lm_head.weight = self.wte.weight  # tied again, as in the full model
        # The first and the last stage each hold the tied matrix and get one part of its
        # gradient (the lookup's, the head's), summed by allreduce_tied_grads with `tied_peer`.
        ends = self.stages > 1 and (self.is_first or self.is_last)
        self.tied_peer = (ranks[-1] if self.is_first else ranks[0]) if ends else None
        self._check_same_model()

    def activation_shape(self, b: int, T: int) -> tuple:
        """The shape of what crosses a link for a micro-batch of b sequences of T tokens:
        (b, T, C); (b, T/t, C), this rank's positions, under sequence parallelism."""
        t = dist.get_world_size(self.tp_group) if self.sequence_parallel else 1
        return b, T // t, self.config.n_embd

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        return self.kind.embed(self, idx)

    def head(self, x: torch.Tensor, targets=None, reduction: str = "sum"):
        return self.kind.head(self, x, targets, reduction)

    @torch.no_grad()
    def _check_same_model(self) -> None:
        # Every stage must be cut from the same shape of model, or activations of the wrong
        # width would cross the links. One all-reduce of (v, -v) under MAX gives the largest
        # and smallest of each number (and, under NCCL, sets up the pipe's communicator).
        c = self.config
        v = torch.tensor([c.n_layer, c.n_embd, c.vocab_size, c.block_size], dtype=torch.float64,
                         device=self.blocks[str(self.layers[0])].ln_1.weight.device)
        both = torch.cat([v, -v])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        if not (torch.equal(both[:4], v) and torch.equal(-both[4:], v)):
            raise ValueError("pipeline stages were cut from different model configs: build every "
                             "stage from the same GPTConfig")

    def describe(self) -> str:
        return describe_cut(self.config.n_layer, self.stages)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if self.is_first:  # x: token indices (B, T)
            x = self.embed(x)
        for block in self.blocks.values():
            x = block(x)
        return self.head(x, targets)[1] if self.is_last else x

    @torch.no_grad()
    def allreduce_tied_grads(self) -> None:
        """Sum the tied matrix's gradient over the first and the last stage (after the last
        backward, before the step): each then holds the full model's gradient of wte.
        Megatron all-reduces it over a group of those two ranks; an all-reduce of two is one
        swap, which needs no group of its own (making one is a collective of the whole
        world): each end sends its part and adds the other's; a + b == b + a, same bits."""
        if self.tied_peer is None:
            return
        grad = self.wte.weight.grad
        if grad is None:
            grad = self.wte.weight.grad = torch.zeros_like(self.wte.weight)
        theirs = torch.empty_like(grad)
        exchange(self.group, [(grad, self.tied_peer)], [(theirs, self.tied_peer)])
        grad.add_(theirs)


def exchange(group, sends=(), recvs=()) -> None:
    """Post every send (tensor, peer) and receive (buffer, peer) as one batch; wait for all,
    each within the run's timeout: a stopped neighbour is an error naming it, not a hang."""
    ops = [dist.P2POp(dist.isend, t, peer, group) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, group) for t, peer in recvs]
    what = [f"send to rank {p}" for _, p in sends] + [f"receive from rank {p}" for _, p in recvs]
    works = dist.batch_isend_irecv(ops) if ops else []  # (one work for all, where a backend coalesces)
    for w, verb in zip(works, what if len(works) == len(ops) else [", ".join(what)]):
        wait(w, f"pipeline: rank {dist.get_rank()} could not {verb} in its pp group "
             f"{dist.get_process_group_ranks(group or dist.group.WORLD)}", hint=": timed out (is that rank stopped?)")


class Observer:
    """Who watches a step: told when it begins (`begin`), then each thing the stage does
    inside `doing(kind, mb, stage)`: "F" or "B" of micro-batch mb, or a batch of messages,
    "send", "recv" or "send+recv" (mb the one awaited). This one, the default, ignores it
    all; minidist.pipeline.measure.StepRecord records the timeline."""

    def begin(self, stage: Stage) -> None:
        pass

    def doing(self, kind: str, mb: int, stage: Stage):
        return nullcontext()


class _Run:
    """One step on one stage: its micro-batches, what each forward keeps for its backward
    (the input received, the output, the gradient that comes back), and its Observer."""

    def __init__(self, stage: Stage, micro_batches, scale: float, watch: Observer, amp=nullcontext):
        self.s, self.mbs, self.scale, self.watch, self.amp = stage, micro_batches, scale, watch, amp
        p = next(stage.parameters())
        self.shape = stage.activation_shape(*micro_batch_shape(micro_batches))
        self.dtype, self.device = p.dtype, p.device
        self.inputs, self.outputs, self.grads = {}, {}, {}  # by micro-batch
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=p.device)
        watch.begin(stage)

    def talk(self, send_act=None, recv_act=None, send_grad=None, recv_grad=None) -> None:
        """One batch of messages, each named by its micro-batch: this stage's output sent down,
        the previous one's received, the gradient of this stage's input sent up, that of its
        output received; those the ends of the pipe lack are dropped."""
        s, sends, recvs = self.s, [], []
        mb = [i for i, peer in ((send_act, s.next), (send_grad, s.prev), (recv_act, s.prev),
                                (recv_grad, s.next)) if i is not None and peer is not None]
        if not mb:  # the micro-batches these carry: none, at this end of the pipe
            return
        if send_act is not None and s.next is not None:
            sends.append((self.outputs[send_act].detach(), s.next))
        if send_grad is not None and s.prev is not None:
            sends.append((self.inputs.pop(send_grad).grad, s.prev))
        if recv_act is not None and s.prev is not None:
            self.inputs[recv_act] = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            recvs.append((self.inputs[recv_act], s.prev))
        if recv_grad is not None and s.next is not None:
            self.grads[recv_grad] = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            recvs.append((self.grads[recv_grad], s.next))
        kind = "send+recv" if sends and recvs else ("send" if sends else "recv")
        with self.watch.doing(kind, mb[-1], s):  # the one received, if any: what the wait was for
            exchange(s.group, sends, recvs)
        if recv_act is not None and s.prev is not None:
            self.inputs[recv_act].requires_grad_()  # a leaf: backward leaves its gradient here

    def forward(self, i: int) -> None:
        x, y = self.mbs[i]
        inp = x if self.s.is_first else self.inputs[i]
        with self.watch.doing("F", i, self.s), self.amp():  # amp: the forward's autocast (--precision)
            out = self.s(inp, y if self.s.is_last else None)
            if self.s.is_last:  # token-normalised, as minidist.train.forward_backward
                self.loss_sum += out.detach().double()
                out = out.float() * self.scale
        self.outputs[i] = out

    def backward(self, j: int) -> None:
        out = self.outputs.pop(j)
        with self.watch.doing("B", j, self.s):
            if self.s.is_last:
                out.backward()
            else:
                torch.autograd.backward(out, self.grads.pop(j))


# ------------------------------------------------------------------ the schedules

def gpipe(run: _Run, m: int) -> None:
    """GPipe: every micro-batch forward, then every one backward; it holds all m at once."""
    for i in range(m):
        run.talk(recv_act=i)
        run.forward(i)
        run.talk(send_act=i)
    for i in range(m):
        run.talk(recv_grad=i)
        run.backward(i)
        run.talk(send_grad=i)


def one_f_one_b(run: _Run, m: int) -> None:
    """1F1B: enough forwards to fill the pipe below this stage (p - stage - 1, the
    warm-up), then one forward and one backward in turn (the steady state), then the
    backwards left (the cool-down). The same bubble as GPipe, but a stage holds at most
    p - stage micro-batches' activations instead of m."""
    warmup = min(run.s.stages - run.s.stage - 1, m)
    for i in range(warmup):
        run.talk(recv_act=i)
        run.forward(i)
        run.talk(send_act=i)
    if warmup < m:
        run.talk(recv_act=warmup)
    for j in range(m - warmup):  # forward i, then backward j, the oldest in flight
        i = warmup + j
        run.forward(i)
        run.talk(send_act=i, recv_grad=j)  # the pair that crosses on the link below
        run.backward(j)
        run.talk(send_grad=j, recv_act=i + 1 if i + 1 < m else None)  # and on the link above
    for j in range(m - warmup, m):
        run.talk(recv_grad=j)
        run.backward(j)
        run.talk(send_grad=j)


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def pipeline_step(stage: Stage, micro_batches, schedule: str = "1f1b", dp_group=None,
                  record: Observer | None = None, loss_scale: float = 1.0, amp=nullcontext) -> float:
    """Forward and backward of every micro-batch (x, y) through the pipeline; when it
    returns, this stage's gradients are those of one process's gradient accumulation over
    the same micro-batches (the tied matrix's summed over first and last stage), and the
    return value, on every stage, is the mean loss per target token. Every stage is handed
    the same micro-batches (the first reads x, the last y). The loss is normalised as
    minidist.train.forward_backward does (`dp_group`: the replicas that will average these
    gradients). `loss_scale`: fp16's; `amp`: the forwards' autocast; `record`: an Observer."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}: use one of {', '.join(SCHEDULES)}")
    device = next(stage.parameters()).device
    count = target_count(micro_batches, () if dp_group is None else (dp_group,), device)
    dp = 1 if dp_group is None else dist.get_world_size(dp_group)
    watch = Observer() if record is None else record
    run = _Run(stage, micro_batches, loss_scale * dp / count.item(), watch, amp)
    SCHEDULES[schedule](run, len(micro_batches))
    stage.allreduce_tied_grads()
    # Only the last stage computed the loss; the others add zero, so the sum is exact.
    total = run.loss_sum.reshape(1)
    dist.all_reduce(total, group=stage.group)
    if dp_group is not None:
        dist.all_reduce(total, group=dp_group)
    return (total / count).item()
