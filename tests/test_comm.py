"""minidist.comm against torch.distributed (the oracle) on gloo: every collective, world
sizes 1-4, sizes that do not divide, every dtype and op; the pipelined all-reduce in the
same processes, bit for bit the plain one, with segments of the default size and of a
few elements; byte counts against the ring formulas; a rank that never joins is a named
error, not a hang."""

import functools
import time

import pytest
import torch
import torch.distributed as dist

from minidist import comm
from minidist.launch import launch
from minidist.run.pool import shared_pool

SIZES = (1, 2, 7, 1000, 4099)  # 1 element, fewer than ranks, odd, divisible, prime
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _data(rank, size, dtype, salt=0):
    g = torch.Generator().manual_seed(1000 * rank + size + salt)
    return torch.randn(size, generator=g).to(dtype)


def _tol(dtype, n):
    # fp32 and any 2-rank sum are one addition: exact. With more ranks the ring adds in
    # another order than gloo, and each bf16/fp16 hop rounds: allow a few units in the
    # last place of the result (bf16 has 8 significant bits, fp16 11).
    if dtype == torch.float32:
        return dict(rtol=1e-6, atol=1e-6)
    ulp = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}[dtype]
    return dict(rtol=2 * ulp * n, atol=2 * ulp * n)


def _all_collectives():
    r, n = dist.get_rank(), dist.get_world_size()
    for dtype in DTYPES:
        for size in SIZES:
            for op in ("sum", "avg"):
                ours, theirs = _data(r, size, dtype), _data(r, size, dtype)
                comm.all_reduce(ours, op=op)
                dist.all_reduce(theirs)
                if op == "avg":
                    theirs = (theirs.float() / n).to(dtype)
                torch.testing.assert_close(ours, theirs, **_tol(dtype, n),
                                           msg=lambda m: f"all_reduce {op} {dtype} {size}: {m}")
                # the pipelined variant: same chunks, same additions, so the same bits,
                # in one segment per chunk and in segments of 16 bytes (4 to 8 elements)
                for segment in (comm.SEGMENT_BYTES, 16):
                    default, comm.SEGMENT_BYTES = comm.SEGMENT_BYTES, segment
                    try:
                        piped = comm.all_reduce_pipelined(_data(r, size, dtype), op=op)
                    finally:
                        comm.SEGMENT_BYTES = default
                    assert torch.equal(piped, ours), f"all_reduce_pipelined {op} {dtype} {size} {segment}"
            # all_gather: into a list (uneven sizes allowed) and into one tensor
            x = _data(r, size, dtype)
            mine = [torch.empty(size, dtype=dtype) for _ in range(n)]
            ref = [torch.empty(size, dtype=dtype) for _ in range(n)]
            comm.all_gather(mine, x)
            dist.all_gather(ref, x)
            assert all(torch.equal(a, b) for a, b in zip(mine, ref))
            flat = torch.empty(n * size, dtype=dtype)
            comm.all_gather(flat, x)
            assert torch.equal(flat, torch.cat(ref))
            # reduce_scatter: oracle is torch's all_reduce, then this rank's block
            for op in ("sum", "avg"):
                inp = _data(r, n * size, dtype, salt=1)
                full = inp.clone()
                dist.all_reduce(full)
                out = torch.empty(size, dtype=dtype)
                kept = inp.clone()
                comm.reduce_scatter(out, inp, op=op)
                assert torch.equal(inp, kept)  # like torch's, the input is left as it was
                want = full[r * size:(r + 1) * size]
                if op == "avg":
                    want = (want.float() / n).to(dtype)
                torch.testing.assert_close(out, want, **_tol(dtype, n))
            # broadcast from every source, a non-contiguous tensor among them
            for src in range(n):
                ours = _data(r, size, dtype, salt=2)
                theirs = ours.clone()
                comm.broadcast(ours, src)
                dist.broadcast(theirs, src)
                assert torch.equal(ours, theirs)
    t = _data(r, 24, torch.float32).view(4, 6).t()  # non-contiguous: results land in place
    ref, piped = t.clone(), t.clone()
    comm.all_reduce(t)
    comm.all_reduce_pipelined(piped)
    dist.all_reduce(ref)
    torch.testing.assert_close(t, ref)
    assert torch.equal(piped, t)
    return True


def _byte_counts(size):
    x = torch.zeros(size)
    out = {}
    with comm.count_bytes() as sent:
        comm.all_reduce(x)
        comm.all_gather(torch.zeros(dist.get_world_size() * size), x)
        comm.reduce_scatter(torch.zeros(size), torch.zeros(dist.get_world_size() * size))
        comm.all_reduce_pipelined(x)
    with comm.count_bytes() as outer, comm.count_bytes() as inner:
        comm.all_reduce(x)
    out.update(sent, nested=(outer["all_reduce"], inner["all_reduce"]))
    return out


def _everything():
    """One call per world size, in the session's shared pool of processes (tests/conftest.py),
    serves every test below that needs that world."""
    return {"equal": _all_collectives(), "bytes": _byte_counts(1200), "uneven_bytes": _byte_counts(1001),
            "bad_args": _bad_args() if dist.get_world_size() == 2 else None}


@functools.lru_cache(maxsize=None)
def _results(world):
    return shared_pool(world).run(_everything)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_collectives_equal_torch_distributed(world):
    assert [r["equal"] for r in _results(world)] == [True] * world


@pytest.mark.parametrize("world", [2, 3, 4])
def test_bytes_sent_follow_the_ring_formulas(world):
    S = 4 * 1200  # bytes of 1200 fp32 elements, divisible by 2, 3 and 4
    for counts in (r["bytes"] for r in _results(world)):
        assert counts["all_reduce"] == 2 * (world - 1) * S // world
        assert counts["all_reduce_pipelined"] == counts["all_reduce"]
        # all_gather of S bytes per rank moves (N-1)/N of the N*S-byte result; likewise
        # reduce_scatter of an N*S-byte input
        assert counts["all_gather"] == (world - 1) * S
        assert counts["reduce_scatter"] == (world - 1) * S
        assert counts["nested"] == (counts["all_reduce"], counts["all_reduce"])


def test_uneven_sizes_send_exactly_2_n_minus_1_times_s_in_total():
    world, size = 3, 1001
    counts = [r["uneven_bytes"] for r in _results(world)]
    # every element leaves its rank N-1 times per phase, summed over ranks
    assert sum(c["all_reduce"] for c in counts) == 2 * (world - 1) * 4 * size
    assert [c["all_reduce_pipelined"] for c in counts] == [c["all_reduce"] for c in counts]


def _one_rank_skips(woke):
    if dist.get_rank() == 1:
        time.sleep(120)
        open(woke, "w").close()  # only reached if nobody stopped this rank
        return
    comm.all_reduce(torch.ones(10))


def test_rank_that_never_joins_is_a_named_timeout(monkeypatch, tmp_path):
    monkeypatch.setenv("MINIDIST_TIMEOUT", "1")  # the children inherit it and read it as they wait
    woke = tmp_path / "woke"
    with pytest.raises(TimeoutError, match=r"all_reduce: reduce-scatter step 1/1: rank 0 could not"):
        launch(_one_rank_skips, 2, str(woke), timeout_s=300)
    # rank 0 gave up on its own timeout (launch's is far longer) and launch stopped the
    # sleeping rank instead of waiting for it: checked by what happened, not by a clock
    assert not woke.exists()


def _bad_args():
    with pytest.raises(ValueError, match="op must be"):
        comm.all_reduce(torch.ones(3), op="max")
    with pytest.raises(ValueError, match="op must be"):
        comm.all_reduce_pipelined(torch.ones(3), op="max")
    with pytest.raises(ValueError, match="needs 2 input tensors"):
        comm.reduce_scatter(torch.ones(3), [torch.ones(3)])
    with pytest.raises(ValueError, match=r"world_size \* input.numel"):
        comm.all_gather(torch.ones(5), torch.ones(3))
    with pytest.raises(ValueError, match="src must be a rank"):
        comm.broadcast(torch.ones(3), 5)
    return True


def test_bad_arguments_are_clear_errors():
    assert [r["bad_args"] for r in _results(2)] == [True, True]


def test_byte_counters_nest_even_when_their_counts_are_equal():
    """An inner context that closes with the same (empty) count as the outer one removes
    itself, not the outer: both close cleanly, and a new one counts from zero."""
    with comm.count_bytes() as outer:
        with comm.count_bytes() as inner:
            pass
        assert inner == outer == {}
        assert [c for c in comm._sent.open if c is outer] and not [c for c in comm._sent.open if c is inner]
    assert not comm._sent.open


def test_work_counters_nest_too():
    """count_work keeps its counters as count_bytes does (minidist.metrics.Tallies): after an
    inner context with the outer's (empty) count closes, the outer one still counts."""
    from minidist.context_parallel.work import count_work, record_work
    with count_work() as outer:
        with count_work() as inner:
            record_work("ring_attention", 0)
        record_work("ring_attention", 5)
    record_work("ring_attention", 7)  # none open: counted nowhere
    assert outer == {"ring_attention": 5} and inner == {"ring_attention": 0}
