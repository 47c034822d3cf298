"""Exercise 13: experts, a mixture of experts and expert parallelism by two all-to-alls.

Goal. A router sends each of N tokens to k of E experts. To run each expert once, on all
its tokens together, the kept choices are sorted by expert (dispatch): expert e's rows are
one contiguous block. Each result goes back to its token, times its gate (combine). With
expert parallelism the experts live on the ranks of an ep group: the sorted rows travel to
their expert's rank by an all-to-all and come back by a second one. Read
chapters/13_experts.md, section 2 "Dispatch and combine", section 6 "Expert parallelism:
two all-to-alls" and, for (c), section 7 "The gradient rules".

Write (each function's docstring is its contract):
(a) dispatch(x, experts, keep, n_experts) -> (rows, counts, inverse), and
    combine(ys, inverse, gates, keep) -> out;
(b) expert_parallel_run(layer, rows, counts): the counts, then the rows, to the experts'
    ranks, the experts run, the results back; differentiable;
(c) find the bug in draft_sync_gradients (expert parallelism's gradient sync), in place.

What is graded (float32, rtol and atol 1e-5, against one process):
- (a) on random routings (uneven counts, experts no token chose, dropped choices, top-1 to
  top-3): dispatch's rows, counts and inverse exactly as a stable sort by expert gives
  them, and x's gradient through rows; combine after dispatch and the experts: out, and
  the gradients of x, the gates and every expert, equal a loop over tokens;
- (b) on 2 ranks, 2 experts each, uneven counts, an empty expert, a rank that sends the
  other nothing, a rank with no rows: every result, then rows.grad and each expert's
  gradients after backward, equal one process running every expert on every rank's rows;
  forward sends at most the counts, the rows for the other rank's experts and the
  results of the rows it received;
- (c) on 4 ranks, at ep 2 (2 replicas of each expert) and ep 4: after the sync every
  gradient equals one process's on the whole batch.

Rules: in (b) data moves by minidist.comm.all_to_all or dist.send, recv, isend and irecv:
not torch's all_to_all_single or all_to_all (nor torch.distributed.nn's), nor the answers
in minidist.experts.parallel (see the README, "Exercises and grading").

Grade with `python -m exercises.grade 13` (a few seconds: it starts 2 and 4 processes),
`python -m exercises.grade 13 --hint` for a hint on the first failing check (again for the
next), `python -m exercises.grade 13 --reference` to grade minidist's instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minidist import comm  # noqa: F401 - its all_to_all, for (b)


# ------------------------------------------------------------------ (a) dispatch and combine

def dispatch(x: torch.Tensor, experts: torch.Tensor, keep: torch.Tensor,
             n_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (N, C): the tokens; experts (N, k): each token's k chosen experts (distinct);
    keep (N, k) bool: the choices that fit their expert's capacity. Returns
    (rows, counts, inverse): rows (M, C), M the kept choices, the token row of each kept
    choice, sorted by expert, in token order within an expert (gradients flow to x);
    counts (n_experts,) long, the rows of each expert (0 for an expert nobody chose);
    inverse (M,) long, the inverse of the sorting permutation: rows[inverse] lists the
    kept choices in their own order, token by token, slot by slot."""
    raise NotImplementedError(
        "dispatch is not written yet: which permutation puts the kept choices in expert order, "
        "and which undoes it? (`python -m exercises.grade 13 --hint`)")


def combine(ys: torch.Tensor, inverse: torch.Tensor, gates: torch.Tensor,
            keep: torch.Tensor) -> torch.Tensor:
    """ys (M, C): the expert output of each of dispatch's rows, in their order; inverse:
    dispatch's; gates (N, k): each choice's gate; keep (N, k): as given to dispatch.
    Returns out (N, C): out[t] is the sum over token t's kept choices j of
    gates[t, j] times the output for choice (t, j); zeros for a token with none kept.
    Differentiable in ys and gates (the router learns here)."""
    raise NotImplementedError(
        "combine is not written yet: which row of ys belongs to choice (t, j), and where does "
        "its result go? (`python -m exercises.grade 13 --hint`)")


# ------------------------------------------------------------------ (b) expert parallelism

def expert_parallel_run(layer, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Each row through its expert, the experts spread over the n ranks of layer.ep_group:
    rank r holds layer.local = range(r*E/n, (r+1)*E/n) of the E = len(counts) experts, as
    layer.experts = {str(e): module}. rows (M, C), counts (E,): this rank's rows sorted by
    expert, as dispatch returns them (counts[e] rows for expert e), so the rows for rank
    j's experts are one block. Returns (M, C): row i's expert output, in rows' order.
    First the counts, so that each rank knows how many rows it receives from each, then
    the rows; run this rank's experts on what arrived, grouped by expert; send the results
    back. Backward reaches rows and the experts' weights, by the same exchanges reversed."""
    raise NotImplementedError(
        "expert_parallel_run is not written yet: before rank j can receive your rows, what must "
        "it know? (`python -m exercises.grade 13 --hint`)")


# ------------------------------------------------------------------ (c) find the bug

def draft_sync_gradients(shared: list, experts: list, replicas) -> None:
    """FIND THE BUG. The gradient sync of an MoE GPT under expert parallelism, as a
    colleague wrote it. Every rank of the world holds other tokens and has run backward on
    its summed loss times W / N (chapter 04: W ranks, N tokens in the whole batch). `shared`:
    the parameters every rank holds (attention, the router, embeddings); `experts`: the
    parameters of the experts this rank holds, which saw every token its ep group sent
    them; `replicas`: the group of the ranks that hold the same experts (one in each ep
    group). Afterwards every gradient must be the whole batch's, as one process computes
    it. It runs, with the right shapes, but not with one process's values. Fix it in place."""
    world = dist.get_world_size()
    for p in shared:  # every rank saw other tokens: average, as data parallelism does
        dist.all_reduce(p.grad)
        p.grad /= world
    for p in experts:  # an expert's replicas saw other tokens: average over them
        dist.all_reduce(p.grad, group=replicas)
        p.grad /= dist.get_world_size(replicas)


# Where minidist implements each (minidist.experts; dispatch and combine are MoE.forward's lines,
# the sync is ExpertSync's rule, adapters in the grader); `--reference` grades these. Leave it as it is.
REFERENCE = {
    "dispatch": "exercises.grader.checks_13:reference_dispatch",
    "combine": "exercises.grader.checks_13:reference_combine",
    "expert_parallel_run": "minidist.experts.parallel:ExpertParallelMoE.run_experts",
    "draft_sync_gradients": "exercises.grader.checks_13:reference_sync_gradients",
}
