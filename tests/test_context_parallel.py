"""Context parallelism (minidist/context_parallel/) against one process: ring, all-gather and
Ulysses attention equal to F.scaled_dot_product_attention on the whole sequence, outputs and
the gradients of q, k and v, causal and not, contiguous and zigzag, at N = 2, 3, 4; the work
per rank the ring counts against its closed form (the causal imbalance and zigzag's cure);
the bytes each way sends, counted by comm.count_bytes, against theirs; minidist's all-to-all
against torch's all_to_all_single; bad shapes refused with what to use; the GPT over a cp
group (context_parallel/gpt.py) against the one-process GPT: the loss, every gradient (summed
over the cp ranks), bf16 autocast and sampling. One pool call per N does every check, with
each oracle computed once per configuration."""

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from minidist import comm
from minidist.context_parallel import (ATTENTIONS, LAYOUTS, ContextParallelGPT, attention_bytes, chunk_ids,
                                       count_work, gather_sequence, imbalance, positions, ring_work,
                                       split_sequence)
from minidist.model import GPT, GPTConfig

NS = (2, 3, 4)
B, D = 1, 8
TOL = 1e-5  # fp32: blockwise sums in another order than SDPA's; measured errors are at most 2.4e-6


def _sizes(n):
    return 2 * n, 6 * n  # H (divisible by N, for Ulysses), T (chunks of 3 tokens in zigzag)


def _compare(group, q, k, v, dout, sdpa_cache):
    """Every way x layout x causal on `group`, against SDPA on the whole sequence (computed
    once per causal flag): {(way, layout, causal): (max error, bytes fwd, bytes bwd, work)}."""
    out = {}
    for causal in (True, False):
        if causal not in sdpa_cache:
            qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
            o = F.scaled_dot_product_attention(qf, kf, vf, is_causal=causal)
            o.backward(dout)
            sdpa_cache[causal] = (o.detach(), qf.grad, kf.grad, vf.grad)
        for layout in LAYOUTS:
            want = [split_sequence(w, group, 2, layout) for w in sdpa_cache[causal]]
            for way, attention in ATTENTIONS.items():
                ql, kl, vl = (split_sequence(t, group, 2, layout).requires_grad_() for t in (q, k, v))
                with comm.count_bytes() as fwd, count_work() as work:
                    o = attention(ql, kl, vl, group, causal=causal, layout=layout)
                with comm.count_bytes() as bwd:
                    o.backward(split_sequence(dout, group, 2, layout))
                got = (o.detach(), ql.grad, kl.grad, vl.grad)
                err = max((a - b).abs().max().item() for a, b in zip(got, want))
                out[way, layout, causal] = (err, dict(fwd), dict(bwd), dict(work))
                if way == "ring":  # the inverse of the cut, on the real output
                    whole = gather_sequence(o.detach(), group, 2, layout)
                    out["gather", layout, causal] = (whole - sdpa_cache[causal][0]).abs().max().item()
    return out


def _all_to_all_cases():
    """minidist's all_to_all against torch's all_to_all_single, bit for bit."""
    r, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(r)
    ok = []
    even = torch.randn(3 * n, 2, generator=g)
    ours, theirs = torch.empty_like(even), torch.empty_like(even)
    ok.append(torch.equal(comm.all_to_all(ours, even), (dist.all_to_all_single(theirs, even), theirs)[1]))
    # uneven, empty blocks among them: rank r sends (r + j) % 3 rows to rank j
    send_sizes = [(r + j) % 3 for j in range(n)]
    recv_sizes = [(j + r) % 3 for j in range(n)]
    x = torch.randn(sum(send_sizes), 5, generator=g)
    ours, theirs = x.new_empty(sum(recv_sizes), 5), x.new_empty(sum(recv_sizes), 5)
    comm.all_to_all(ours, x, recv_sizes, send_sizes)
    dist.all_to_all_single(theirs, x, recv_sizes, send_sizes)
    ok.append(torch.equal(ours, theirs))
    with comm.count_bytes() as sent:
        comm.all_to_all(torch.empty(3 * n, 2), torch.ones(3 * n, 2))
    return ok, sent["all_to_all"]


def _refusals():
    n = dist.get_world_size()
    H, T = _sizes(n)
    z = torch.zeros
    cases = {
        "split_contiguous": lambda: split_sequence(z(1, H, T + 1, D), None, 2, "contiguous"),
        "split_zigzag": lambda: split_sequence(z(1, H, 3 * n, D), None, 2, "zigzag"),
        "layout": lambda: split_sequence(z(1, H, T, D), None, 2, "striped"),
        "ring_zigzag_odd": lambda: ATTENTIONS["ring"](*[z(1, H, 3, D)] * 3, None, layout="zigzag"),
        "shapes": lambda: ATTENTIONS["allgather"](z(1, H, 6, D), z(1, H, 6, D), z(1, H, 4, D), None),
        "ulysses_heads": lambda: ATTENTIONS["ulysses"](*[z(1, H + 1, 6, D)] * 3, None),
        "ints": lambda: ATTENTIONS["ring"](*[z(1, H, 6, D, dtype=torch.long)] * 3, None),
        "a2a_splits": lambda: comm.all_to_all(z(n + 1), z(n + 1)),
    }
    said = {}
    for name, call in cases.items():
        try:
            call()
            said[name] = None
        except ValueError as e:
            said[name] = str(e)
    return said


def _gpt_cases():
    """The cp GPT, every way x layout, against the one-process GPT on the same whole batch:
    {(way, layout): (loss error, largest gradient error, bf16 loss error, sampled alike)}."""
    n = dist.get_world_size()
    torch.manual_seed(0)  # the same model and batch on every rank
    cfg = GPTConfig(n_layer=2, n_head=n, n_embd=8 * n, block_size=4 * n, vocab_size=64)
    one = GPT(cfg)
    x, y = torch.randint(0, 64, (2, 4 * n)), torch.randint(0, 64, (2, 4 * n))
    y[0, 1] = -1  # a masked target counts nowhere
    loss = one(x, y, reduction="sum")[1]
    loss.backward()
    want = {name: p.grad for name, p in one.named_parameters()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want_bf16 = one(x, y, reduction="sum")[1].item()
    prompt, greedy = x[:1, :3], dict(max_new_tokens=4 * n - 3, top_k=1)
    sampled = one.generate(prompt, **greedy)
    out = {}
    for way in ATTENTIONS:
        for layout in LAYOUTS:
            cp = ContextParallelGPT(one, None, way, layout)
            xl, yl = (split_sequence(t, None, 1, layout) for t in (x, y))
            got = cp(xl, yl, reduction="sum")[1]
            got.backward()
            total = got.detach().reshape(1)
            dist.all_reduce(total)
            grad_err = 0.0
            for name, p in cp.named_parameters():
                dist.all_reduce(p.grad)  # the whole gradient: every rank's share, summed
                grad_err = max(grad_err, (p.grad - want[name]).abs().max().item())
            with torch.autocast("cpu", dtype=torch.bfloat16):
                bf16 = cp(xl, yl, reduction="sum")[1].detach().float().reshape(1)
            dist.all_reduce(bf16)
            out[way, layout] = ((total - loss.detach()).abs().item(), grad_err, abs(bf16.item() - want_bf16),
                                torch.equal(cp.generate(prompt, **greedy), sampled))
    return out


def _everything():
    r, n = dist.get_rank(), dist.get_world_size()
    H, T = _sizes(n)
    g = torch.Generator().manual_seed(0)  # the same whole sequence on every rank
    q, k, v, dout = (torch.randn(B, H, T, D, generator=g) for _ in range(4))
    result = {"world": _compare(None, q, k, v, dout, {}), "a2a": _all_to_all_cases(),
              "refused": _refusals(), "gpt": _gpt_cases()}
    if n == 4:  # two cp groups of 2 inside the world ({0, 2} and {1, 3}): messages by global rank
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        result["subgroup"] = _compare(groups[r % 2], q[..., :12, :], k[..., :12, :], v[..., :12, :],
                                      dout[..., :12, :], {})
    return result


@functools.lru_cache(maxsize=None)
def _results(pool, n):
    return pool(n).run(_everything)


@pytest.mark.parametrize("n", NS)
def test_every_way_equals_sdpa_on_the_whole_sequence_with_gradients(pool, n):
    for rank, res in enumerate(_results(pool, n)):
        for key, value in res["world"].items():
            err = value if key[0] == "gather" else value[0]
            assert err <= TOL, f"rank {rank}: {key}: max |difference| from SDPA {err:.2e} > {TOL}"
        for key, value in res.get("subgroup", {}).items():
            err = value if key[0] == "gather" else value[0]
            assert err <= TOL, f"rank {rank} in a cp group of 2: {key}: {err:.2e} > {TOL}"


@pytest.mark.parametrize("n", NS)
def test_bytes_each_way_sends_equal_the_closed_forms(pool, n):
    H, T = _sizes(n)
    names = {"ring": ("ring_attention", "ring_attention_backward"),
             "allgather": ("all_to_all", "all_to_all"), "ulysses": ("all_to_all", "all_to_all")}
    for res in _results(pool, n):
        for (way, layout, causal), value in res["world"].items():
            if way == "gather":
                continue
            _, fwd, bwd, _ = value
            want = attention_bytes(way, B, H, T, D, n)
            assert fwd == {names[way][0]: want["forward"]}, (way, layout, causal)
            assert bwd == {names[way][1]: want["backward"]}, (way, layout, causal)


@pytest.mark.parametrize("n", NS)
def test_ring_work_per_rank_equals_the_formula_and_zigzag_evens_it(pool, n):
    H, T = _sizes(n)
    results = _results(pool, n)
    for causal in (True, False):
        for layout in LAYOUTS:
            work = [res["world"]["ring", layout, causal][3]["ring_attention"] for res in results]
            assert work == [ring_work(T, n, r, layout, causal) for r in range(n)], (layout, causal)
    causal_work = {layout: [res["world"]["ring", layout, True][3]["ring_attention"] for res in results]
                   for layout in LAYOUTS}
    c = T // n
    assert causal_work["contiguous"] == [(r + 1) * c * c for r in range(n)]  # the last does N times the first
    assert len(set(causal_work["zigzag"])) == 1 and imbalance(T, n, "zigzag") == 1.0
    assert imbalance(T, n, "contiguous") == pytest.approx(2 * n / (n + 1))
    # all-gather's SDPA computes every entry of its T/N x T scores, masked or not
    assert all(res["world"]["allgather", "contiguous", True][3]["allgather_attention"] == T * T // n
               for res in results)


@pytest.mark.parametrize("n", NS)
def test_all_to_all_equals_torch_all_to_all_single(pool, n):
    for ok, sent in (res["a2a"] for res in _results(pool, n)):
        assert ok == [True, True]
        assert sent == (n - 1) * 2 * 4 * 3  # every block but its own: 3 rows of 2 fp32 each


@pytest.mark.parametrize("n", NS)
def test_bad_shapes_are_refused_saying_what_to_use(pool, n):
    said = _results(pool, n)[0]["refused"]
    assert said["split_contiguous"] == (f"split_sequence: a sequence of {6 * n + 1} tokens does not cut into "
                                        f"{n} equal chunks (contiguous over {n} ranks cuts N): pad it to a "
                                        f"multiple of {n}")
    assert said["split_zigzag"].startswith(f"split_sequence: a sequence of {3 * n} tokens does not cut into {2 * n}")
    assert f"pad it to a multiple of {2 * n}; or layout='contiguous'" in said["split_zigzag"]
    assert said["layout"] == "split_sequence: layout must be one of 'contiguous', 'zigzag', got 'striped'"
    assert "zigzag needs an even T_local" in said["ring_zigzag_odd"] and "layout='contiguous'" in said["ring_zigzag_odd"]
    assert "must have one shape (B, H, T_local, D)" in said["shapes"]
    assert f"{2 * n + 1} heads do not split over {n} ranks" in said["ulysses_heads"]
    assert "must be floating point of one dtype, got torch.int64" in said["ints"]
    assert "all_to_all: input_split_sizes must be" in said["a2a_splits"]


@pytest.mark.parametrize("n", NS)
def test_the_cp_gpt_equals_one_process_loss_gradients_bf16_and_samples(pool, n):
    for rank, res in enumerate(_results(pool, n)):
        for key, (loss_err, grad_err, bf16_err, same_sample) in res["gpt"].items():
            assert loss_err <= 1e-4 and grad_err <= TOL, (rank, key, loss_err, grad_err)  # fp32 (a sum of 8N tokens)
            # bf16: each way's blockwise softmax rounds in its own order; SDPA's to its own
            assert bf16_err <= 0.02 * 8 * n, (rank, key, bf16_err)
            assert same_sample, (rank, key)


def test_the_cp_gpt_refuses_what_it_cannot_run():
    one = GPT(GPTConfig(n_layer=1, n_head=3, n_embd=12, block_size=8, vocab_size=16, dropout=0.1))
    with pytest.raises(ValueError, match="no attention dropout"):
        ContextParallelGPT(one, None)
    with pytest.raises(ValueError, match="must be one of ring, allgather, ulysses, got 'flash'"):
        ContextParallelGPT(one, None, "flash")


def test_positions_and_chunks_follow_the_layout():
    assert chunk_ids(1, 3, "zigzag") == [1, 4] and chunk_ids(2, 3, "contiguous") == [2]
    assert positions(8, 0, 2, "zigzag").tolist() == [0, 1, 6, 7]
    assert positions(8, 1, 2, "zigzag").tolist() == [2, 3, 4, 5]
    assert positions(8, 1, 2, "contiguous").tolist() == [4, 5, 6, 7]
    every = torch.cat([positions(24, r, 4, "zigzag") for r in range(4)])
    assert sorted(every.tolist()) == list(range(24))  # a partition of the sequence
