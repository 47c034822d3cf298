"""Exercise 11: pipeline parallelism, a 1F1B schedule that cannot deadlock, with blocking messages.

Read chapters/11_pipeline.md, section 1 "Stages and the messages between them" (why a send
waits for its receive, and what deadlocks) and section 2 "GPipe, then 1F1B" (the schedule).
The chapter's 1F1B posts the two messages that cross on a link as one batch. Here every
message is one blocking dist.send or dist.recv, and the order you post them in is yours.

The grader cuts a tiny GPT into p stages, one per process, and calls your schedule on
every stage as `schedule(run, m)` for m micro-batches, with `run`:
- run.stage, run.stages: s and p; run.prev, run.next: the neighbours' ranks (None at the
  ends of the pipe); run.group: the pipe's process group (pass group=run.group: its
  timeout is the deadlock watchdog); run.shape: every message's shape (micro-batch, T, C);
- out = run.forward(i, x): stage s's forward of micro-batch i, x the activation received
  from run.prev (None on the first stage); out is the activation to send to run.next
  (None on the last stage);
- g = run.backward(i, grad): its backward, grad the gradient of its output received from
  run.next (None on the last stage); g is the gradient of its input, to send to run.prev
  (None on the first stage). After the last backward the grader reads the gradients.
A gloo send (like NCCL's) returns only once the receiver has posted the matching receive.

Implement:
(a) one_f_one_b(run, m): 1F1B on this stage, every message a dist.send or a dist.recv;
(b) find the bug in draft_gpipe below, and fix it in place.

Graded at p = 2 and 3 stages, m = 1, p - 1, p and 2p + 1, against one process running the
whole model on the whole batch:
- (a) gradients: every stage's parameter gradients, and the input gradient its backward
  returned for each micro-batch, equal the oracle's;
- (a) order: each stage runs 1F1B's forwards and backwards, at most min(p - s, m) in flight;
- (a) no deadlock: every run finishes (a wait of 5 s is a deadlock: the report names p, m
  and where each stage waited);
- (b) draft_gpipe: every run finishes with the oracle's gradients.
Rules: no dist.isend, irecv or batch_isend_irecv (nor minidist's exchange), no collective
(not even barrier), no stage or schedule of torch.distributed.pipelining or minidist.pipeline
(see the README, "Exercises and grading").

Grade with `python -m exercises.grade 11` (a few seconds: it starts 2 and 3 processes),
`python -m exercises.grade 11 --hint` for a hint on the first failing check (again for the
next), `python -m exercises.grade 11 --reference` to grade minidist's schedules instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def one_f_one_b(run, m: int) -> None:
    """1F1B of micro-batches 0 to m - 1 on stage run.stage of run.stages: the gradients of
    one process, 1F1B's order of forwards and backwards, and no deadlock for any m."""
    raise NotImplementedError(
        "one_f_one_b is not written yet: which forwards come before the first backward on "
        "stage s, and in what order do the two ends of a link post their messages? "
        "(`python -m exercises.grade 11 --hint`)")


def draft_gpipe(run, m: int) -> None:
    """FIND THE BUG. GPipe, as a colleague wrote it: every forward, then every backward,
    each message one blocking call. It finishes at every m, but its gradients are not
    always one process's. Fix it in place."""
    x = torch.empty(run.shape) if run.prev is not None else None  # what the messages arrive in
    grad = torch.empty(run.shape) if run.next is not None else None
    for i in range(m):
        if run.prev is not None:
            dist.recv(x, run.prev, group=run.group)
        out = run.forward(i, x)
        if run.next is not None:
            dist.send(out, run.next, group=run.group)
    for i in range(m):
        if run.next is not None:
            dist.recv(grad, run.next, group=run.group)
        g = run.backward(i, grad)
        if run.prev is not None:
            dist.send(g, run.prev, group=run.group)


# Where minidist implements each (adapters in the grader running minidist.pipeline's
# one_f_one_b and gpipe on this run); `--reference` grades these. Leave it as it is.
REFERENCE = {
    "one_f_one_b": "exercises.grader.checks_11:reference_one_f_one_b",
    "draft_gpipe": "exercises.grader.checks_11:reference_draft_gpipe",
}
