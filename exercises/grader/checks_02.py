"""Graded checks of exercise 02 (exercises/02_collectives.py).

The three functions run on 2 and 3 ranks of the shared pool. The oracle is torch's own
all_reduce and all_gather on the same data; what the code under test sent, to whom and how
many bytes, is read from events(). A ring that deadlocks is ended by gloo's timeout.
"""

from collections import Counter

import torch
import torch.distributed as dist

from exercises.grader import Cache, Rules, check, events, first_problem, per_world_size, ring_direction, run_all
from minidist import comm

WORLD_SIZES = (2, 3)  # 3 is the smallest ring where the direction matters
TIMEOUT_S = 20.0      # a rank that waits longer for a message is stuck (tests lower it)

_OWN = "exercise 02 builds this ring itself, from dist.isend/irecv/send/recv"
RULES = Rules(
    collectives=frozenset({"send", "recv"}),
    collective_rule="exercise 02 builds all-reduce from messages: move data with "
                    "dist.isend, irecv, send and recv only",
    forbidden={f"minidist.comm:{name}": _OWN for name in
               ("all_reduce", "all_reduce_pipelined", "_ring_reduce_scatter", "_ring_all_gather")})


# --------------------------------------------------------------------- reference adapters

def reference_ring_reduce_scatter(chunks: list[torch.Tensor]) -> None:
    """minidist's ring reduce-scatter, with the exercise's signature."""
    comm._ring_reduce_scatter(chunks, "ring_reduce_scatter")


def reference_ring_all_gather(chunks: list[torch.Tensor]) -> None:
    """minidist's ring all-gather, with the exercise's signature."""
    comm._ring_all_gather(chunks, "ring_all_gather")


# --------------------------------------------------------------------- data and oracle

# Unit roundoff: the largest relative error of one rounding to the dtype.
_UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}


def _data(rank: int, shape, dtype, case: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * rank + 104729 * case + 1)
    return torch.randn(shape, generator=g).to(dtype)


def _oracle_sum(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over ranks of x, sum over ranks of |x|), by torch's all_reduce in float64: the
    sum is as good as exact, and the second sets the scale of the rounding errors."""
    exact, scale = x.to(torch.float64, copy=True), x.to(torch.float64, copy=True).abs()
    dist.all_reduce(exact)
    dist.all_reduce(scale)
    return exact, scale


def _sum_problem(got: torch.Tensor, exact: torch.Tensor, scale: torch.Tensor, n: int,
                 where: str) -> str | None:
    """None when `got` is the sum within tolerance, else what differs. A sum of N terms
    rounded at each of the ring's N-1 additions and once at the end is off by at most N
    roundings of u * sum|x| each (u: 2^-24 fp32, 2^-8 bf16), in any order; we allow twice
    that. A missing or doubled term is off by a whole |x_i|."""
    allowed = 2 * n * _UNIT_ROUNDOFF[got.dtype] * scale
    bad = ~((got.double() - exact).abs() <= allowed)  # written so that NaN counts as bad
    if not bad.any():
        return None
    i = int(bad.reshape(-1).nonzero()[0])
    return (f"{where}: element {i} is {got.reshape(-1)[i].item():.6g}, the sum over ranks is "
            f"{exact.reshape(-1)[i].item():.6g} ({int(bad.sum())} of {bad.numel()} elements "
            f"are off by more than 2*N*u*sum|x|)")


def _chunk_sizes(n: int) -> list[list[int]]:
    """torch.tensor_split's chunks of 1 element (empty chunks), 7 and 4099 (divisible by
    neither 2 nor 3), and chunks of very different sizes."""
    cases = [[len(c) for c in torch.arange(size).tensor_split(n)] for size in (1, 7, 4099)]
    return cases + [[3 + 5 * (n - i) for i in range(n)]]


# --------------------------------------------------------------------- the parts, on every rank

def _reduce_scatter_part(fns: dict, r: int, n: int) -> dict:
    problems, start = [], len(events())
    for case, sizes in enumerate(_chunk_sizes(n)):
        chunks = [_data(r, (s,), torch.float32, 100 * case + i) for i, s in enumerate(sizes)]
        exact, scale = _oracle_sum(torch.cat(chunks))  # the whole sum; we check our slice
        lo = sum(sizes[:r])
        mine = chunks[r]
        fns["ring_reduce_scatter"](chunks)
        where = f"{n} ranks, chunk sizes {sizes}: rank {r}'s chunks[{r}]"
        if chunks[r] is not mine:
            problems.append(f"{where} was replaced by another tensor; update it in place")
        else:
            problems.append(_sum_problem(mine, exact[lo:lo + sizes[r]], scale[lo:lo + sizes[r]],
                                         n, where))
    return {"problems": problems, "direction": ring_direction("ring_reduce_scatter", start, r, n)}


def _all_gather_part(fns: dict, r: int, n: int) -> dict:
    problems, start = [], len(events())
    for case, sizes in enumerate(_chunk_sizes(n)):
        mine = _data(r, (sizes[r],), torch.float32, 100 * case + r)
        # rank i's chunk i, gathered by torch (padded: its all_gather wants one size)
        padded = torch.zeros(max(max(sizes), 1))
        padded[:sizes[r]] = mine
        gathered = [torch.empty_like(padded) for _ in range(n)]
        dist.all_gather(gathered, padded)
        # the chunks this rank does not own start as NaN, so a chunk never written shows
        chunks = [mine.clone() if i == r else torch.full((s,), float("nan"))
                  for i, s in enumerate(sizes)]
        before = list(chunks)
        fns["ring_all_gather"](chunks)
        for i, (got, s) in enumerate(zip(before, sizes)):
            want = gathered[i][:s]
            if torch.equal(got, want):
                continue
            j = int((got != want).nonzero()[0])  # NaN != anything: found too
            what = ("was never written (still NaN)" if got.isnan().all() else
                    f"element {j} is {got[j].item():.6g}, rank {i}'s is {want[j].item():.6g}")
            inplace = "; receive into the list's tensor, in place" if chunks[i] is not got else ""
            problems.append(f"{n} ranks, chunk sizes {sizes}: rank {r}'s chunks[{i}] {what}{inplace}")
            break
    return {"problems": problems, "direction": ring_direction("ring_all_gather", start, r, n)}


# float32 from 1 element (fewer than ranks) to a prime number of them, one every world
# size divides (1200), a 2-D tensor; bfloat16, where every hop of the ring rounds.
_ALL_REDUCE_CASES = [(torch.float32, (1,)), (torch.float32, (7,)), (torch.float32, (1200,)),
                     (torch.float32, (4099,)), (torch.float32, (33, 31)),
                     (torch.bfloat16, (1,)), (torch.bfloat16, (7,)), (torch.bfloat16, (4099,))]


def _all_reduce_part(fns: dict, r: int, n: int) -> dict:
    out = {"float32": [], "bfloat16": [], "bytes": []}
    start = len(events())
    for case, (dtype, shape) in enumerate(_ALL_REDUCE_CASES):
        t = _data(r, shape, dtype, 1000 + case)
        exact, scale = _oracle_sum(t)
        first = len(events())
        got = fns["all_reduce"](t)
        name = str(dtype).removeprefix("torch.")
        where = f"all_reduce of a {name} tensor of shape {tuple(shape)} on {n} ranks, rank {r}"
        p = _sum_problem(t, exact, scale, n, where)
        if (p and isinstance(got, torch.Tensor) and got is not t and got.shape == t.shape
                and _sum_problem(got.to(t.dtype), exact, scale, n, where) is None):
            p = f"{where}: returned the sum in a new tensor; it belongs in `tensor` itself"
        out[name].append(p)
        sent = Counter()
        for e in events()[first:]:
            if e.kind == "send":
                sent[e.peer] += e.sent
        out["bytes"].append({"where": where, "S": t.numel() * t.element_size(), "sent": dict(sent),
                             "chunks": [c.numel() * t.element_size() for c in t.reshape(-1).tensor_split(n)]})
    out["direction"] = ring_direction("all_reduce", start, r, n)
    return out


_PARTS = {"reduce_scatter": _reduce_scatter_part, "all_gather": _all_gather_part,
          "all_reduce": _all_reduce_part}
_CACHE = Cache()


def _per_world_size(impl, part: str):
    fns = {"ring_reduce_scatter": impl.ring_reduce_scatter,
           "ring_all_gather": impl.ring_all_gather, "all_reduce": impl.all_reduce}
    results = _CACHE.get((*fns.values(), WORLD_SIZES, TIMEOUT_S), lambda: run_all(
        _PARTS, fns, WORLD_SIZES, TIMEOUT_S,
        hang_hint="With gloo a send waits until its receiver has posted the matching receive."))
    return per_world_size(results, part, WORLD_SIZES)


# --------------------------------------------------------------------- the checks

def _first_problem(impl, part: str, key: str) -> None:
    """Fail with the first problem any rank found in `part`'s results under `key`."""
    for _, per_rank in _per_world_size(impl, part):
        first_problem(p for res in per_rank for p in res[key])


@check("02", points=2, name="ring_reduce_scatter: rank r gets chunk r summed (2, 3 ranks, uneven chunks)",
       hints=["Which chunk must rank r send at the first step so that, travelling right and "
              "picking up one rank's contribution per hop, chunk r ends its trip at rank r? "
              "Work it out for N = 3 on paper.",
              "N-1 steps: at step k rank r sends one partial sum to (r+1) % N and receives one "
              "from (r-1) % N into a scratch tensor, then adds it into its own copy of that "
              "chunk, in place: chunks[r] must stay the same tensor.",
              "Post the receive and the send of a step (dist.irecv, dist.isend) before waiting "
              "on either: if every rank first calls a blocking send, every rank waits for a "
              "receive nobody has posted (chapter 02, section 2)."])
def _reduce_scatter(impl):
    _first_problem(impl, "reduce_scatter", "problems")


@check("02", points=2, name="ring_all_gather: every rank gets every chunk (2, 3 ranks, uneven chunks)",
       hints=["Which chunk is complete on rank r before the all-gather starts, and where must "
              "it go first?",
              "N-1 steps again, copying, not adding: what a rank sends at a step is what it "
              "received at the step before (its own chunk at the first).",
              "Receive straight into the list's tensor for that chunk: no scratch tensor, "
              "nothing to add."])
def _all_gather(impl):
    _first_problem(impl, "all_gather", "problems")


@check("02", points=2, name="all_reduce float32 == torch's (1 to 4099 elements, 2-D), in place",
       hints=["What do tensor.view(-1) and the pieces torch.tensor_split cuts from it share "
              "with `tensor`?",
              "Run ring_reduce_scatter, then ring_all_gather, on one list of views of the "
              "flattened tensor: what they write lands in `tensor` itself.",
              "With more ranks than elements some chunks are empty; sending an empty tensor "
              "is fine when both sides do it. Return `tensor`, not a new one."])
def _all_reduce_fp32(impl):
    _first_problem(impl, "all_reduce", "float32")


@check("02", points=1, name="all_reduce bfloat16 == torch's, within 2N roundings",
       hints=["Each hop rounds to bfloat16, and that is allowed (2N roundings); is anything "
              "else lost, or added twice?",
              "Send the native dtype: converting to float32 for the wire doubles the bytes."])
def _all_reduce_bf16(impl):
    _first_problem(impl, "all_reduce", "bfloat16")


@check("02", points=1, name="the ring's direction: sends go to (r+1) % N, receives come from (r-1) % N",
       hints=["Which rank did the message the report names go to, and which line of yours sent it?",
              "A ring going left is also a ring, but not the one asked for: in chapter 03 the "
              "direction matters. Every part, all three functions, sends right only."])
def _direction_check(impl):
    for part in _PARTS:
        for _, per_rank in _per_world_size(impl, part):
            first_problem(res["direction"] for res in per_rank)


@check("02", points=2, name="all_reduce is a ring: each rank sends 2(N-1)/N * S bytes",
       hints=["How many chunks does a rank send in each half of the ring?",
              "Reduce-scatter sends every chunk but the one the rank finishes with, "
              "all-gather every chunk but the one it receives last. Sending the whole tensor, "
              "or a chunk twice, shows up as too many bytes."])
def _ring_bytes(impl):
    for n, per_rank in _per_world_size(impl, "all_reduce"):
        for case in range(len(_ALL_REDUCE_CASES)):
            runs = [res["bytes"][case] for res in per_rank]
            S, chunks = runs[0]["S"], runs[0]["chunks"]
            # every chunk but one per half: 2(S - a chunk), between these with uneven chunks
            lo, hi = 2 * (S - max(chunks)), 2 * (S - min(chunks))
            for r, run in enumerate(runs):
                got = sum(run["sent"].values())
                assert lo <= got <= hi, (
                    f"{run['where']} ({S} bytes): sent {got} bytes {run['sent']} (by destination); "
                    f"a ring sends 2(N-1)/N * S = {2 * (n - 1) * S / n:.0f}"
                    + (f" (between {lo} and {hi} with chunks of {min(chunks)} to {max(chunks)} "
                       "bytes)" if lo != hi else ""))
            # every chunk travels N-1 hops in each half, whoever sends it
            total = sum(sum(run["sent"].values()) for run in runs)
            assert total == 2 * (n - 1) * S, (
                f"{runs[0]['where'].rsplit(',', 1)[0]}: the ranks sent {total} bytes together; "
                f"a ring sends 2(N-1) * S = {2 * (n - 1) * S}")
