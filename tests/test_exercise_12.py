"""Exercise 12's grader on what the generic tests (tests/test_exercises.py) do not cover: a
merge that exponentiates the scores loses the merge check at large scores; SDPA over a
K, V gathered with all_gather scores the ring 0 naming the rule and the line, and a gather
made of messages to every rank is seen in where they went; minidist's merge scores 0;
the shipped draft's message reports the symptom, not the fix; torch's context_parallel and
minidist's ring_attention are refused where they are called. Each variant is the solution
(tests/solutions/12_context_parallel.py) with mistakes in separate parts, graded once."""

from pathlib import Path

import pytest
import torch

import minidist.context_parallel as cp
from exercises.grader import checks_12, core
from exercises.grader.rules import RuleBroken, watch

SOLUTION = (Path(__file__).resolve().parent / "solutions" / "12_context_parallel.py").read_text()
MERGE, RING, DRAFT = (c.name for c in core.checks_of("12"))

_MERGE_BODY = "    top = torch.maximum(lse, block_lse)\n"
_RING_BODY = "    r, n = dist.get_rank(group), dist.get_world_size(group)\n"
_DRAFT = "    second = first + (2 * n - 1 - 2 * rank) * c\n"
_SDPA_AFTER = """    mask = _positions(T, r, n, layout)[:, None] >= torch.cat([_positions(T, s, n, layout) for s in range(n)])
    return F.scaled_dot_product_attention(q, K, V, attn_mask=mask if causal else None)
"""
VARIANTS = {  # name: {old: new} in the solution
    "exponentiates; all_gather then SDPA": {
        _MERGE_BODY: "    a, b = torch.exp(lse), torch.exp(block_lse)\n"
                     "    return (a[..., None] * out + b[..., None] * block_out) / (a + b)[..., None], torch.log(a + b)\n",
        _RING_BODY: _RING_BODY + """    T = q.shape[2] * n
    K, V = [torch.empty_like(k) for _ in range(n)], [torch.empty_like(v) for _ in range(n)]
    dist.all_gather(K, k.contiguous(), group=group)
    dist.all_gather(V, v.contiguous(), group=group)
    K, V = torch.cat(K, dim=2), torch.cat(V, dim=2)
""" + _SDPA_AFTER},
    "minidist's merge; every rank's K, V sent to every rank; the shipped draft": {
        "import torch.nn.functional as F\n": "import torch.nn.functional as F\n"
                                              "from minidist.context_parallel import merge as theirs\n",
        _MERGE_BODY: "    return theirs(out, lse, block_out, block_lse)\n",
        _RING_BODY: _RING_BODY + """    T = q.shape[2] * n
    parts = [torch.stack([k, v]) if s == r else torch.empty(2, *k.shape) for s in range(n)]
    reqs = [dist.isend(parts[r], s) for s in range(n) if s != r]
    reqs += [dist.irecv(parts[s], s) for s in range(n) if s != r]
    for req in reqs:
        req.wait()
    K, V = torch.cat(parts, dim=3).unbind(0)
""" + _SDPA_AFTER,
        _DRAFT: "    second = first + (2 * n - 2 * rank) * c\n"},
}


def _variant(tmp: Path, name: str) -> Path:
    src = SOLUTION
    for old, new in VARIANTS[name].items():
        assert src.count(old) == 1, f"{name}: {old!r} is not in the solution once"
        src = src.replace(old, new)
    path = tmp / f"v{list(VARIANTS).index(name)}" / "12_context_parallel.py"
    path.parent.mkdir()
    path.write_text(src)
    return path


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ex12")
    out = {}
    for name in VARIANTS:
        path = _variant(tmp, name)
        out[name] = ({c.name: c for c in core.grade("12", path=path).checks}, path.read_text().splitlines())
    return out


def _line(lines: list, text: str) -> str:
    return f"12_context_parallel.py:{next(i for i, ln in enumerate(lines) if text in ln) + 1},"


def test_exponentiating_the_scores_fails_the_merge_and_gathering_k_v_scores_the_ring_0(graded):
    r, lines = graded["exponentiates; all_gather then SDPA"]
    assert not r[MERGE].ok and "scores up to " in r[MERGE].message and "(scores up to 1)" not in r[MERGE].message
    assert "got nan" in r[MERGE].message or "got inf" in r[MERGE].message, r[MERGE].message
    msg = r[RING].message
    assert "dist.all_gather was called at " in msg and _line(lines, "dist.all_gather(K") in msg, msg
    assert "all-gather way, not the ring" in msg and "this part scores 0" in msg, msg
    assert r[DRAFT].ok, r[DRAFT].message


def test_minidists_merge_scores_0_and_messages_to_every_rank_are_not_a_ring(graded):
    r, lines = graded["minidist's merge; every rank's K, V sent to every rank; the shipped draft"]
    msg = r[MERGE].message
    assert "minidist.context_parallel.ring.merge was called at " in msg and _line(lines, "return theirs(") in msg, msg
    assert "write them yourself" in msg and "scores 0" in msg, msg
    msg = r[RING].message
    assert msg.startswith("ring_attention(causal=False, layout='contiguous') on 3 ranks: rank 0 sent "), msg
    assert "to rank 2 at " in msg and _line(lines, "dist.isend(parts[r], s)")[:-1] + "; in the ring it sends only to rank 1" in msg, msg


def test_the_shipped_drafts_message_says_what_differs_not_why(graded):
    msg = graded["minidist's merge; every rank's K, V sent to every rank; the shipped draft"][0][DRAFT].message
    assert msg.startswith("on 2 ranks, rank 0: the output differs from SDPA's causal attention"), msg
    for diagnosis in ("chunk", "mirror", "2n", "offset", "one too"):
        assert diagnosis not in msg.lower(), (diagnosis, msg)


def test_torch_context_parallel_and_minidists_ring_are_refused_where_they_are_called():
    x = torch.zeros(1, 1, 2, 2)
    with pytest.raises(RuleBroken, match=r"minidist\.context_parallel\.ring\.ring_attention was called at "
                                         r".*test_exercise_12\.py:"), watch(checks_12.RULES):
        cp.ring_attention(x, x, x)
    with pytest.raises(RuleBroken, match=r"experimental\.context_parallel was called at .*test_exercise_12\.py:"), \
            watch(checks_12.RULES):
        from torch.distributed.tensor.experimental import context_parallel  # imported once watched: still seen
        context_parallel(None)
