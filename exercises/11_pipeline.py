"""Exercise 11: pipeline parallelism, the 1F1B schedule.

Goal. Pipeline parallelism cuts the model by layers: rank s of p holds stage s, a run of
contiguous blocks (the embeddings on the first stage, the final norm and the head on the
last). A batch is split into m micro-batches; each goes forward through stage 0, 1, ...,
p - 1, and its gradient comes back through p - 1, ..., 0. GPipe runs every forward, then
every backward: simple, but every stage holds the activations of all m micro-batches at
once. 1F1B (one forward, one backward; PipeDream-Flush, as Megatron runs it) reorders the
same work so that stage s never holds more than p - s of them, with the same bubble.
Chapter 11 (chapters/11_pipeline.md) draws both and says where the numbers come from.

You write the schedule: on one stage, the order of its forwards, backwards and messages.
The grader builds the stages (a tiny GPT, one stage per rank) and calls your function on
every stage as `schedule(run, m)`, with `run`:
- run.stage, run.stages: s and p; run.prev, run.next: the neighbouring stages' ranks
  (None at the ends of the pipe); run.group: the pipe's process group;
- run.forward(i): stage s's forward of micro-batch i. On every stage but the first, its
  input (micro-batch i's activation from stage s - 1) must have been received first;
- run.backward(i): its backward. On every stage but the last, the gradient of its output
  (from stage s + 1) must have been received first. After the last backward, the stage's
  gradients are complete: the grader reads them;
- what the messages carry: run.output(i) (the activation forward(i) made, to send down),
  run.input_grad(i) (after backward(i), the gradient of its input, to send up),
  run.new_input(i) and run.new_output_grad(i) (a buffer to receive micro-batch i's
  activation, or the gradient of its output, into: the run reads it from there).
The helpers below post these messages between neighbours (each skips what the ends of the
pipe lack); use them, or dist.batch_isend_irecv / isend / irecv / send / recv yourself.
A gloo send (and NCCL's) waits until its receiver has posted the matching receive.

Implement:
(a) one_f_one_b(run, m): the 1F1B schedule of m micro-batches on this stage;
(b) find the bug in draft_one_f_one_b below.

What the grader checks (p = 2 and 4 stages, one per process; m = 8, 5, 4, 3, 2, 1;
float32; the oracle is one process's gradient accumulation over the same micro-batches,
computed by the grader):
- gradients: after your schedule returns, every stage's gradients equal the oracle's
  (rtol 1e-5, atol 1e-7: only the order of the sums may differ), every micro-batch went
  forward and backward once on every stage, and each link between stages s and s + 1
  carried m activations down and m gradients up, one message each, nothing else;
- in flight: on stage s, the most micro-batches between their forward and their backward
  at one moment is min(p - s, m), counted from the forwards and backwards your schedule
  called;
- no deadlock: every run finishes; each run has a watchdog (a wait of 5 s for a message
  is a deadlock), and the report names the p, the m and where each stage was waiting;
- (b) as its docstring says.
The gradient and in-flight checks judge every run that finished, and need the runs with
m >= p to finish; the deadlock check needs them all.

Rules (enforced in every graded part; a part that breaks one scores 0, naming the rule):
- Only point-to-point messages between neighbouring stages, on run.group: no collectives
  (all_reduce, broadcast, all_gather, ...), no message to any other stage.
- No torch.distributed.pipelining (its stages and schedules, under any name).
- Import nothing from minidist (minidist.pipeline and its neighbours are the answer to this
  exercise, and its other modules re-export them), nor the grader (anything under
  exercises.), nor modules outside torch and the standard library's plain tools, nor reach
  anything by a name built at run time (importlib, __import__, sys.modules, getattr). The grader reads this
  file before it runs anything: such a line scores 0 in every check, naming the line.

Grade your work with `python -m exercises.grade 11` (about 20 s on a quiet 2-core machine:
it starts 2 and 4 processes), ask for a hint on the first failing check with
`python -m exercises.grade 11 --hint` (again for the next one, `--hint K` for the K-th),
and see what full marks look like with `python -m exercises.grade 11 --reference`.

To experiment, run a function of your own on several processes with
`minidist.launch.launch(fn, 2, *args)`: it returns each rank's return value and re-raises
a rank's exception here, with "[rank r of 2]" in front.
"""

from __future__ import annotations

import torch  # noqa: F401 - for you: tensors to send, torch.empty_like
import torch.distributed as dist


# ------------------------------------------------------------------ the messages

def _exchange(group, sends=(), recvs=()) -> None:
    """Post every send (tensor, peer) and every receive (buffer, peer) as one batch, then
    wait for all of them."""
    ops = [dist.P2POp(dist.isend, t, peer, group) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, group) for t, peer in recvs]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def send_forward(run, i: int) -> None:
    """Send micro-batch i's activation to the next stage (after run.forward(i))."""
    if run.next is not None:
        _exchange(run.group, sends=[(run.output(i), run.next)])


def recv_forward(run, i: int) -> None:
    """Receive micro-batch i's activation from the previous stage (before run.forward(i))."""
    if run.prev is not None:
        _exchange(run.group, recvs=[(run.new_input(i), run.prev)])


def send_backward(run, j: int) -> None:
    """Send the gradient of micro-batch j's input to the previous stage (after run.backward(j))."""
    if run.prev is not None:
        _exchange(run.group, sends=[(run.input_grad(j), run.prev)])


def recv_backward(run, j: int) -> None:
    """Receive the gradient of micro-batch j's output from the next stage (before run.backward(j))."""
    if run.next is not None:
        _exchange(run.group, recvs=[(run.new_output_grad(j), run.next)])


def send_forward_recv_backward(run, i: int, j: int) -> None:
    """Send micro-batch i's activation down and receive micro-batch j's gradient from
    below, posted together and waited together."""
    if run.next is not None:
        _exchange(run.group, sends=[(run.output(i), run.next)],
                  recvs=[(run.new_output_grad(j), run.next)])


def send_backward_recv_forward(run, j: int, i: int) -> None:
    """Send micro-batch j's input gradient up and receive micro-batch i's activation from
    above, posted together and waited together."""
    if run.prev is not None:
        _exchange(run.group, sends=[(run.input_grad(j), run.prev)],
                  recvs=[(run.new_input(i), run.prev)])


def gpipe(run, m: int) -> None:
    """GPipe, for comparison: every forward, then every backward. Correct, never
    deadlocks, and holds all m micro-batches in flight on every stage."""
    for i in range(m):
        recv_forward(run, i)
        run.forward(i)
        send_forward(run, i)
    for j in range(m):
        recv_backward(run, j)
        run.backward(j)
        send_backward(run, j)


# ------------------------------------------------------------------ (a) 1F1B

def one_f_one_b(run, m: int) -> None:
    """The 1F1B schedule of micro-batches 0 to m - 1 on stage run.stage of run.stages: the
    same gradients as GPipe, at most min(p - stage, m) micro-batches in flight, and no
    deadlock for any m."""
    raise NotImplementedError(
        "one_f_one_b is not written yet: on stage s, how many forwards must run before the "
        "first gradient can come back, and what order of messages keeps both sides of a "
        "link in step? (`python -m exercises.grade 11 --hint` gives a hint)")


# ------------------------------------------------------------------ (b) find the bug

def draft_one_f_one_b(run, m: int) -> None:
    """FIND THE BUG. A 1F1B schedule: a warm-up of forwards that fills the stages below,
    a steady state of one forward and one backward, a cool-down of the backwards left.

    The contract, which the grader checks (p = 2 and 4, m = 8, 5, 4, 3, 2, 1, each run
    under the watchdog): every run finishes; every stage's gradients equal one process's
    accumulation; at most min(p - stage, m) micro-batches are in flight on stage `stage`;
    each link carries m activations down and m gradients up, one message each.
    As shipped it finishes for some micro-batch counts and hangs for others. Fix it in place."""
    p, s = run.stages, run.stage
    warmup = min(p - s - 1, m)
    for i in range(warmup):
        recv_forward(run, i)
        run.forward(i)
        send_forward(run, i)
    if warmup < m:
        recv_forward(run, warmup)
    for j in range(m - warmup):  # forward i, then backward j, the oldest in flight
        i = warmup + j
        run.forward(i)
        send_forward(run, i)      # this activation goes down ...
        recv_backward(run, j)     # ... and the oldest one's gradient comes back
        run.backward(j)
        send_backward(run, j)     # its input's gradient goes up ...
        if i + 1 < m:
            recv_forward(run, i + 1)  # ... and the next activation comes in
    for j in range(m - warmup, m):
        recv_backward(run, j)
        run.backward(j)
        send_backward(run, j)


# Where minidist implements each; `python -m exercises.grade 11 --reference` grades these
# instead of the stubs above. Leave it as it is. Each entry is a one-line adapter in the
# grader (exercises/checks_11.py) that runs minidist.pipeline.one_f_one_b on this
# exercise's `run`.
REFERENCE = {
    "one_f_one_b": "exercises.checks_11:reference_one_f_one_b",
    "draft_one_f_one_b": "exercises.checks_11:reference_draft_one_f_one_b",
}
