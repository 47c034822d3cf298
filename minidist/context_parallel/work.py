"""What context parallelism costs per rank, counted on the run and in closed form: the
attention work (score entries computed), the bytes each rank sends, the memory it holds.
Chapter 12 (chapters/12_context_parallel.md). Exercised by tests/test_context_parallel.py.

Units. Work: score entries, one query against one key, per batch row and head (a block of
a x b entries costs 4abD FLOPs forward). Bytes: S = B * H * T_local * D * element size,
the size of one rank's slice of q, k or v.
"""

from __future__ import annotations

from minidist.cost_model import SENT_FRACTION
from minidist.metrics import Tallies

_work = Tallies()  # count_work's


def count_work():
    """Count the score entries each attention computes on this rank while the block runs:

        with count_work() as work:
            ring_attention(q, k, v, group)
        work["ring_attention"]   # entries per (batch row, head)
    """
    return _work.counting()


def record_work(name: str, entries: int) -> None:
    _work.add(name, entries)


def ring_work(T: int, n: int, rank: int, layout: str, causal: bool = True) -> int:
    """Score entries `rank` computes in ring attention over a sequence of T tokens.

    Without a mask every query meets every key: T/N x T. With a causal mask a query chunk
    meets the key chunks at or before it (the diagonal chunk is computed whole, then
    masked); chunks wholly in the future are skipped.
      contiguous, chunks of T/N: rank r's chunk r meets chunks 0..r: (r+1) (T/N)^2, so
        the last rank does N times the first one's work.
      zigzag, chunks of T/2N: chunk r meets r+1 chunks, chunk 2N-1-r meets 2N-r:
        (2N+1) (T/2N)^2, the same on every rank (the contiguous mean is 2N+2 of those:
        smaller diagonal chunks waste less on masked entries).
    """
    if not causal:
        return T * T // n
    if layout == "contiguous":
        return (rank + 1) * (T // n) ** 2
    return (2 * n + 1) * (T // (2 * n)) ** 2


def imbalance(T: int, n: int, layout: str) -> float:
    """The busiest rank's causal work over the mean rank's: the step waits for the busiest."""
    work = [ring_work(T, n, r, layout) for r in range(n)]
    return max(work) / (sum(work) / n)


def slice_bytes(B: int, H: int, T: int, D: int, n: int, elem: int = 4) -> int:
    """S: one rank's slice of q, k or v."""
    return B * H * (T // n) * D * elem


def attention_bytes(method: str, B: int, H: int, T: int, D: int, n: int, elem: int = 4) -> dict:
    """Bytes one rank sends for one attention call, {"forward": ..., "backward": ...}.

    ring: K and V (2S) pass N-1 hops forward; backward they pass again, and dK, dV (2S)
      travel with them N hops, the last one home to their owner.
    allgather: K and V gathered, (N-1) 2S; backward dK, dV reduce-scattered, (N-1) 2S.
    ulysses: q, k, v to head shards and the output back, each an all-to-all of S that
      sends (N-1)/N of it: 4S (N-1)/N each way.
    """
    S = slice_bytes(B, H, T, D, n, elem)
    if n == 1:
        return {"forward": 0, "backward": 0}
    if method == "ring":
        return {"forward": 2 * (n - 1) * S, "backward": 2 * (n - 1) * S + 2 * n * S}
    if method == "allgather":
        return {"forward": 2 * (n - 1) * S, "backward": 2 * (n - 1) * S}
    if method == "ulysses":
        each = round(4 * S * SENT_FRACTION["all_to_all"](n))
        return {"forward": each, "backward": each}
    raise ValueError(f"method must be 'ring', 'allgather' or 'ulysses', got {method!r}")


def attention_memory(method: str, B: int, H: int, T: int, D: int, n: int, elem: int = 4,
                     layout: str = "contiguous") -> dict:
    """Bytes one rank holds at the forward's peak: {"kv": K and V, "scores": one score
    matrix}. ring: its own K, V (kept for backward), the block at hand and the one
    arriving, 2S min(N, 3); scores one chunk pair at a time. allgather: the whole K, V,
    2NS; scores T/N x T. ulysses: q, k, v and the output over the whole sequence for H/N
    heads, 4S; scores H/N heads of T x T. Score entries are counted at `elem` bytes."""
    S = slice_bytes(B, H, T, D, n, elem)
    chunk = T // (n if layout == "contiguous" else 2 * n)
    if method == "ring":
        return {"kv": 2 * S * min(n, 3), "scores": B * H * chunk * chunk * elem}
    if method == "allgather":
        return {"kv": 2 * n * S, "scores": B * H * (T // n) * T * elem}
    if method == "ulysses":
        return {"kv": 4 * S, "scores": B * (H // n) * T * T * elem}
    raise ValueError(f"method must be 'ring', 'allgather' or 'ulysses', got {method!r}")
