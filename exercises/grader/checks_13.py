"""Graded checks of exercise 13 (exercises/13_experts.py): (a) in one process against a loop over tokens; (b) on 2
ranks against one process running every expert; (c) on 4 ranks, a tiny MoE GPT at ep 2 and 4, against one process."""

import copy

import torch
import torch.distributed as dist

from exercises.grader import Rules, check, differ, events, first_problem, oracle, per_world_size, randn, run_all
from minidist.compose.expert_sync import sum_then_scale, expert_groups
from minidist.experts import ExpertParallelMoE, MoE, MoEConfig, MoEGPT, expert_parallel
from minidist.model import GPTConfig

E, C, TIMEOUT_S = 6, 6, 20.0  # (a)'s experts, the width; a rank that waits this long for the others is hung
RULES = Rules(frozenset({"send", "recv"}), "in exercise 13 rows move by minidist.comm.all_to_all or dist.send/recv "
              "(isend/irecv), not torch's all-to-all: the exchange is yours to write", dict.fromkeys((
                  "minidist.experts.parallel:ExpertParallelMoE.run_experts", "minidist.experts.parallel:_AllToAll."
                  "forward"), "minidist.experts.parallel holds this part's answer (what --reference grades)"))


def reference_dispatch(x, experts, keep, n_experts):  # MoE.forward's dispatch (minidist/experts/moe.py)
    token = torch.arange(len(x)).repeat_interleave(experts.shape[1])[keep.reshape(-1)]
    order = torch.argsort(expert := experts.reshape(-1)[keep.reshape(-1)], stable=True)
    return x[token[order]], torch.bincount(expert, minlength=n_experts), torch.argsort(order)


def reference_combine(ys, inverse, gates, keep):  # MoE.forward's combine, the choices back in their own order
    token = torch.arange(len(keep)).repeat_interleave(keep.shape[1])[keep.reshape(-1)]
    return ys.new_zeros(len(keep), ys.shape[1]).index_add(0, token, ys[inverse] * gates[keep][:, None])


def reference_sync_gradients(shared, experts, replicas):  # ExpertSync's rule (minidist/compose/expert_sync.py)
    sum_then_scale(shared, None, 1 / dist.get_world_size())
    sum_then_scale(experts, replicas, 1 / dist.get_world_size())


def _cases():  # (where, x, experts, keep, gates): k distinct experts a token, never those `unchosen`
    for i, (n, k, kept, unchosen) in enumerate([(12, 2, 0.75, [2]), (9, 1, 1, []), (10, 3, 0.6, [0, 5]), (1, 2, 1, [])]):
        g, pool = torch.Generator().manual_seed(1300 + i), torch.tensor([e for e in range(E) if e not in unchosen])
        experts, x = pool[torch.rand(n, len(pool), generator=g).argsort(1)[:, :k]], torch.randn(n, C, generator=g).requires_grad_()
        keep, gates = torch.rand(n, k, generator=g) < kept, torch.rand(n, k, generator=g).requires_grad_()
        yield f"{n} tokens, top-{k} of {E}, {int(keep.sum())} of {n * k} kept, unchosen {unchosen}", x, experts, keep, gates


def _same(where, got, want, inputs: dict):  # got == want, and the gradients of (got * w).sum() == want's
    if (problem := differ(f"{where}: the output", got, want)) or not got.requires_grad:
        return problem or f"{where}: the output does not require grad: backward cannot reach {', '.join(inputs)}"
    w, zero = randn(1399, *want.shape), lambda g, t: torch.zeros_like(t) if g is None else g  # noqa: E731
    got, want = (torch.autograd.grad((y * w).sum(), list(inputs.values()), allow_unused=True) for y in (got, want))
    return next(filter(None, (differ(f"{where}: the gradient of {k}", zero(g, t), zero(v, t))
                              for (k, t), g, v in zip(inputs.items(), got, want))), None)


@check("13", 2, name="dispatch: rows sorted by expert (token order within one), counts, the inverse; x's gradient", hints=[
    "List the kept choices in their own order, token by token: which of them does expert 0 get, in which order, "
    "then expert 1? Which permutation of the list is that, and what undoes it?",
    "A stable sort by expert keeps token order within an expert (torch.argsort(..., stable=True)); the rows are x "
    "at those choices' tokens. The inverse q of a permutation p has q[p[i]] = i: scatter arange, or sort p."])
def _dispatch(impl):
    for where, x, experts, keep, _ in _cases():
        got, want = impl.dispatch(x, experts.clone(), keep.clone(), E), reference_dispatch(x, experts, keep, E)
        assert isinstance(got, tuple) and len(got) == 3, f"{where}: got a {type(got).__name__}, want (rows, counts, inverse)"
        first_problem([_same(f"dispatch, {where}: rows", got[0], want[0], {"x": x}), *(
            None if torch.is_tensor(g) and g.shape == w.shape and torch.equal(g.long(), w) else
            f"dispatch, {where}: {k} is {g.tolist() if torch.is_tensor(g) else g}, want {w.tolist()}"
            for k, g, w in zip(("counts", "inverse"), got[1:], want[1:]))])


@check("13", 3, name="combine after dispatch and the experts == a loop over tokens: out, the gradients of x, gates, experts", hints=[
    "Row i of ys belongs to which kept choice, and so to which token and which gate?",
    "ys[inverse] puts the outputs back in the kept choices' own order: each then needs its token and its gate, read "
    "from keep and gates in that order, and goes into its token's row of a zero (N, C) tensor (index_add)."])
def _combine(impl):
    for where, x, experts, keep, gates in _cases():
        torch.manual_seed(13)
        mods, (rows, counts, inverse) = MoE(C, E, hidden=8).experts, reference_dispatch(x, experts, keep, E)
        ys = torch.cat([mods[str(e)](b) for e, b in enumerate(rows.split(counts.tolist()))])
        loop = torch.stack([sum((gates[t, j] * mods[str(e)](x[t]) for j, e in enumerate(experts[t].tolist())
                                 if keep[t, j]), torch.zeros(C)) for t in range(len(x))])
        first_problem([_same(f"combine, {where}", impl.combine(ys, inverse, gates, keep), loop, {
            "x": x, "gates": gates, **{f"experts.{k}": p for k, p in mods.named_parameters()}})])


def _ep_part(fns, r: int, n: int) -> list:  # per case: every rank's rows from seeds; this rank's beside one process
    problems = []
    for case, counts in enumerate([[[3, 0, 2, 4], [1, 2, 0, 5]], [[2, 3, 0, 0], [0, 4, 1, 2]], [[0] * 4, [2, 1, 3, 2]]]):
        xs, ws = ([randn(1320 + 10 * case + 5 * i + s, sum(c), C) for s, c in enumerate(counts)] for i in (0, 1))
        torch.manual_seed(13)
        full = MoE(C, 4, hidden=8)  # one process runs every expert on every rank's rows, [rank][expert] of them
        layer, k0 = ExpertParallelMoE(copy.deepcopy(full), dist.group.WORLD, dist.group.WORLD), len(events())
        want = [torch.cat([full.experts[str(e)](b) for e, b in enumerate(x.requires_grad_().split(c))]) for x, c in zip(xs, counts)]
        sum((y * w).sum() for y, w in zip(want, ws)).backward()
        x, where = xs[r].detach().clone().requires_grad_(), f"case {case}, rank {r} (rows per expert, by rank: {counts})"
        y = fns["expert_parallel_run"](layer, x, torch.tensor(counts[r]))
        problem, sent = differ(f"{where}: the output", y, want[r]), sum(e.sent for e in events()[k0:])
        if isinstance(y, torch.Tensor) and y.shape == want[r].shape and y.requires_grad:  # every rank alike: it talks
            (y * ws[r]).sum().backward()
            problem = problem or next(filter(None, [differ(f"{where}: rows.grad", x.grad, xs[r].grad), *(
                differ(f"{where}: experts.{k}.grad", p.grad, full.experts.get_parameter(k).grad)
                for k, p in layer.experts.named_parameters())]), None)
        most = 4 * C * sum(c[e] for s, c in enumerate(counts) for e in range(4) if (s == r) != (e in layer.local)) + 64
        problems.append(problem or (f"{where}: the output does not require grad: backward cannot reach rows or the "
                                    "experts" if not y.requires_grad else None if sent <= most else f"{where}: forward "
                                    f"sent {sent} bytes, want at most {most}: the rows for the other rank's experts, "
                                    "the results for its rows (fp32), the counts"))
    return problems


@check("13", 3, name="expert_parallel_run on 2 ranks == one process running every expert: out, rows.grad, the experts' gradients", hints=[
    "Rank j must post a receive of the right size before your rows can arrive: what must it know first, and from "
    "whom? And in which order do the rows arrive?",
    "Exchange the counts by an all-to-all: every split, rows to each rank and from each, follows. What arrives is "
    "grouped by sender: regroup it by expert, run each expert once, undo the regrouping, send the results back.",
    "Backward runs the same exchanges, splits swapped: a torch.autograd.Function around each (chapter 13, section 6)."])
def _ep(impl):
    results = run_all({"ep": _ep_part}, {"expert_parallel_run": impl.expert_parallel_run}, (2,), TIMEOUT_S,
                      "Every rank must make the same exchanges in the same order, empty ones too.")
    first_problem(p for _, per_rank in per_world_size(results, "ep", (2,)) for ps in per_rank for p in ps)


def _sync_part(fns, r: int, n: int) -> list:  # at ep 2 and 4: what differs from one process's gradients
    x, out = torch.randint(0, 64, (2 * n, 9), generator=torch.Generator().manual_seed(1330)), []
    for ep in (2, 4):
        with oracle():  # the grader's model, its all-to-alls and backward: only the sync is the learner's
            ep_group, replicas = expert_groups(ep)
            torch.manual_seed(0)
            one = MoEGPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=64), MoEConfig(4, 2))
            model = expert_parallel(copy.deepcopy(one), ep_group, dist.group.WORLD)
            one(x[:, :-1], x[:, 1:])[1].backward()  # the whole batch's mean; each rank: its sum times W / N
            (model(x[2 * r:2 * r + 2, :-1], x[2 * r:2 * r + 2, 1:], reduction="sum")[1] * n / (2 * n * 8)).backward()
        mine, want = dict(model.named_parameters()), dict(one.named_parameters())
        fns["draft_sync_gradients"](*([p for p in mine.values() if getattr(p, "expert", False) is e] for e in (False, True)), replicas)
        bad = [d for k, p in mine.items() if (d := differ(f"the gradient of {k}", p.grad, want[k].grad))]
        out.append(bad and f"on 4 ranks, ep {ep} ({4 // ep} replica(s) of each expert), rank {r}: {len(bad)} of "
                   f"{len(mine)} gradients differ from one process's on the whole batch: {bad[0]}")
    return out


@check("13", 2, rules=Rules(), name="find the bug: draft_sync_gradients == one process's at ep 2 (x 2 replicas) and ep 4", hints=[
    "Which gradients differ, the shared ones or the experts', and by what factor? Does it change with ep?",
    "After backward, whose tokens' shares does a replica's expert gradient hold, times what? What does the whole "
    "batch's gradient need from the replicas?",
    "A replica holds its ep group's tokens' share times W / N (chapter 13, section 7): their sum, over?"])
def _sync(impl):
    results = run_all({"sync": _sync_part}, {"draft_sync_gradients": impl.draft_sync_gradients}, (4,), TIMEOUT_S,
                      "Every rank must join the same all-reduces, over the same groups, in the same order.")
    first_problem(p for _, per_rank in per_world_size(results, "sync", (4,)) for ps in per_rank for p in ps)
