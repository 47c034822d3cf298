"""Exercise 13's grader on what the generic tests (tests/test_exercises.py) do not cover: a
dispatch that returns the sorting order instead of its inverse, and a combine that leaves
the gates out, each lose their own check only; torch's all_to_all_single in (b) scores the
part 0 naming the rule and the line, and so does minidist's _AllToAll; rows sent in float64
are twice the bytes allowed; the shipped draft's message reports the symptom, not the fix,
and a "fix" right at ep 2 only is caught at ep 4. Each variant is the solution
(tests/solutions/13_experts.py) with mistakes in separate parts, graded once."""

from pathlib import Path

import pytest
import torch

from exercises.grader import checks_13, core
from exercises.grader.rules import RuleBroken, watch

SOLUTION = (Path(__file__).resolve().parent / "solutions" / "13_experts.py").read_text()
DISPATCH, COMBINE, EP, SYNC = (c.name for c in core.checks_of("13"))

_INVERSE = "    inverse = torch.empty_like(order)\n    inverse[order] = torch.arange(len(order))\n"
_COMBINE = "    weighted = ys[inverse] * gates.reshape(-1)[keep.reshape(-1)].unsqueeze(1)\n"
_FORWARD = "        out = x.new_empty((sum(recv), x.shape[1]))\n        return comm.all_to_all(out, x.contiguous(), recv, send, group=group)\n"
_FIXED = "        dist.all_reduce(p.grad, group=replicas)\n        p.grad /= world\n"
VARIANTS = {  # name: {old: new} in the solution
    "the order for the inverse; torch's all_to_all_single; the shipped draft": {
        _INVERSE: "    inverse = order\n",
        "import torch.distributed as dist\n": "import torch.distributed as dist\n"
                                              "from torch.distributed.nn.functional import all_to_all_single\n",
        "    arrived = _Exchange.apply(rows, send_rows, recv_rows, group)\n":
            "    arrived = all_to_all_single(rows.new_empty(sum(recv_rows), rows.shape[1]), rows, recv_rows, send_rows)\n",
        _FIXED: "        dist.all_reduce(p.grad, group=replicas)\n        p.grad /= dist.get_world_size(replicas)\n"},
    "no gates; minidist's _AllToAll; a fix right at ep 2 only": {
        _COMBINE: "    weighted = ys[inverse]\n",
        "from minidist import comm\n": "from minidist import comm\nfrom minidist.experts.parallel import _AllToAll\n",
        "    arrived = _Exchange.apply(rows, send_rows, recv_rows, group)\n":
            "    arrived = _AllToAll.apply(rows, send_rows, recv_rows, group)\n",
        _FIXED: "        dist.all_reduce(p.grad, group=replicas)\n        p.grad /= 2 * dist.get_world_size(replicas)\n"},
    "rows sent in float64": {
        _FORWARD: "        out = x.new_empty((sum(recv), x.shape[1]), dtype=torch.float64)\n"
                  "        return comm.all_to_all(out, x.double(), recv, send, group=group).float()\n"},
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    out, tmp = {}, tmp_path_factory.mktemp("ex13")
    for i, (name, edits) in enumerate(VARIANTS.items()):
        src = SOLUTION
        for old, new in edits.items():
            assert src.count(old) == 1, f"{name}: {old!r} is not in the solution once"
            src = src.replace(old, new)
        path = tmp / f"v{i}" / "13_experts.py"
        path.parent.mkdir()
        path.write_text(src)
        out[name] = ({c.name: c for c in core.grade("13", path=path).checks}, src.splitlines())
    return out


def _line(lines: list, text: str) -> str:
    return f"13_experts.py:{next(i for i, ln in enumerate(lines) if text in ln) + 1},"


def test_the_order_for_its_inverse_loses_dispatch_only_and_torchs_all_to_all_scores_the_part_0(graded):
    r, lines = graded["the order for the inverse; torch's all_to_all_single; the shipped draft"]
    assert not r[DISPATCH].ok and ": inverse is [" in r[DISPATCH].message, r[DISPATCH].message
    assert r[COMBINE].ok, r[COMBINE].message  # graded on the grader's dispatch: independent points
    msg = r[EP].message
    assert "dist.all_to_all_single was called at " in msg and _line(lines, "arrived = all_to_all_single(") in msg, msg
    assert "not torch's all-to-all: the exchange is yours to write" in msg and "this part scores 0" in msg, msg


def test_combine_without_the_gates_loses_combine_only_and_minidists_all_to_all_scores_the_part_0(graded):
    r, lines = graded["no gates; minidist's _AllToAll; a fix right at ep 2 only"]
    assert r[DISPATCH].ok and not r[COMBINE].ok, (r[DISPATCH].message, r[COMBINE].message)
    assert r[COMBINE].message.startswith("combine, 12 tokens, top-2 of 6") and "the output differs" in r[COMBINE].message
    msg = r[EP].message
    assert "minidist.experts.parallel._AllToAll.forward was called at " in msg, msg
    assert _line(lines, "arrived = _AllToAll.apply(") in msg and "this part scores 0" in msg, msg


def test_the_shipped_drafts_message_says_what_differs_not_why_and_a_fix_for_ep_2_only_is_caught(graded):
    msg = graded["the order for the inverse; torch's all_to_all_single; the shipped draft"][0][SYNC].message
    assert msg.startswith("on 4 ranks, ep 2 (2 replica(s) of each expert), rank 0: ") and ".experts." in msg, msg
    for diagnosis in ("world", "divide", "scale", "average", "/ w"):
        assert diagnosis not in msg.lower(), (diagnosis, msg)
    msg = graded["no gates; minidist's _AllToAll; a fix right at ep 2 only"][0][SYNC].message
    assert msg.startswith("on 4 ranks, ep 4 (1 replica(s) of each expert), rank 0: "), msg


def test_rows_sent_in_float64_are_twice_the_bytes_allowed(graded):
    r = graded["rows sent in float64"][0]
    assert [name for name, c in r.items() if not c.ok] == [EP], {name: c.message for name, c in r.items()}
    assert "forward sent " in r[EP].message and "the rows for the other rank's experts" in r[EP].message


def test_minidists_run_experts_is_refused_where_it_is_called():
    with pytest.raises(RuleBroken, match=r"ExpertParallelMoE\.run_experts was called at .*test_exercise_13\.py:"), \
            watch(checks_13.RULES):
        from minidist.experts.parallel import ExpertParallelMoE
        ExpertParallelMoE.run_experts(None, torch.zeros(0, 1), torch.zeros(0))
