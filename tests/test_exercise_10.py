"""Exercise 10's grader on what the generic tests (tests/test_exercises.py) do not cover:
the shipped draft's messages report symptoms, not the diagnosis; each planted mistake loses
its own check(s), and only those; a solution that calls what the rules forbid scores 0 on
that part only, naming the rule and the line. Each variant is the plain solution
(tests/solutions/10_tensor_parallel.py) with mistakes written into separate parts, graded
once, on 2 ranks (the grader's own world sizes are 2 and 3)."""

from pathlib import Path

import pytest

from exercises.grader import checks_10, core

SOLUTION = (Path(__file__).resolve().parent / "solutions" / "10_tensor_parallel.py").read_text()
CE, CE_BYTES, QKV, SP_GRAD, SP_DROP = (c.name for c in core.checks_of("10"))

_CE_CALL = "    return _VocabParallelCrossEntropy.apply(logits, targets, start, group)\n"
_QKV = "    rows = torch.cat([torch.arange(a, b) + i * C for i in range(3)])  # its q, then k, then v rows\n"
_GRAD = "        return _scatter_positions(grad.contiguous(), ctx.group), None"
_SEED = "            torch.manual_seed(seed + dist.get_rank(group))\n"

MISTAKES = {  # name: ({old: new} in the solution, the checks it must fail)
    "gathers the logits; plain qkv cut; gradient divided by t; seeds by rank without a fork": ({
        _CE_CALL: """    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, logits.detach())
    parts[dist.get_rank(group)] = logits
    full = torch.cat(parts, -1)
    return F.cross_entropy(full.view(-1, full.shape[-1]), targets.view(-1))
""",
        _QKV: "    rows = torch.arange(rank * 3 * C // world_size, (rank + 1) * 3 * C // world_size)\n",
        _GRAD: """        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return _scatter_positions(grad / dist.get_world_size(ctx.group), ctx.group), None""",
        "        with torch.random.fork_rng(devices=[]):\n": "        if True:\n",
    }, {CE_BYTES, QKV, SP_GRAD, SP_DROP}),
    "all-reduces the padded logits; a fixed seed per rank": ({
        _CE_CALL: """    r, V_r = dist.get_rank(group), logits.shape[-1]
    V = torch.tensor([V_r])
    dist.all_reduce(V, group=group)
    full = torch.zeros(*logits.shape[:-1], int(V), requires_grad=False)
    full[..., start:start + V_r] = logits.detach()
    dist.all_reduce(full, group=group)
    full = torch.cat([full[..., :start], logits, full[..., start + V_r:]], -1)
    return F.cross_entropy(full.view(-1, full.shape[-1]), targets.view(-1))
""",
        _SEED: "            torch.manual_seed(1234 + dist.get_rank(group))\n",
    }, {CE_BYTES, SP_DROP}),
    "the local max; the draft's gradient; the same seed on every rank": ({
        "        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)\n": "",
        _GRAD: """        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return _scatter_positions(grad, ctx.group), None""",
        _SEED: "            torch.manual_seed(seed)\n",
    }, {CE, SP_GRAD, SP_DROP}),
    "backward ignores the incoming gradient": ({
        "        return (g * grad / len(local))": "        return (g / len(local))",
    }, {CE}),
}

FORBIDDEN = {  # minidist's answer for (a), DTensor in (b)
    "import torch.nn.functional as F\n": "import torch.nn.functional as F\n"
    "from minidist.tensor_parallel.gpt import vocab_parallel_cross_entropy as theirs\n"
    "from torch.distributed.tensor import distribute_tensor\n",
    _CE_CALL: "    return theirs(logits, targets, start, group)\n",
    "    C = weight.shape[1]\n": "    distribute_tensor(weight)\n    C = weight.shape[1]\n",
}


def _variant(tmp: Path, name: str, edits: dict) -> Path:
    src = SOLUTION
    for old, new in edits.items():
        assert src.count(old) == 1, f"{name}: {old!r} is not in the solution once"
        src = src.replace(old, new)
    path = tmp / f"{abs(hash(name))}.py"
    path.write_text(src)
    return path


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ex10")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(checks_10, "WORLD_SIZES", (2,))
        out = {name: core.grade("10", path=_variant(tmp, name, edits))
               for name, (edits, _) in MISTAKES.items()}
        out["forbidden"] = core.grade("10", path=_variant(tmp, "forbidden", FORBIDDEN))
        out["draft"] = core.grade("10")
    return {name: {c.name: c for c in r.checks} for name, r in out.items()}


@pytest.mark.parametrize("name", list(MISTAKES))
def test_each_mistake_loses_its_checks_and_only_those(graded, name):
    failed = {n for n, c in graded[name].items() if not c.ok}
    assert failed == MISTAKES[name][1], {n: graded[name][n].message for n in failed}
    for n in failed:
        assert "on 2 ranks" in graded[name][n].message or n == QKV, graded[name][n].message


def test_gathering_the_logits_is_seen_in_what_moved(graded):
    gathered, summed = (graded[n][CE_BYTES].message for n in list(MISTAKES)[:2])
    assert "forward moved all-gather" in gathered, gathered
    assert "forward moved all-reduce" in summed and "at most 384 bytes" in summed, summed


def test_a_forbidden_call_scores_its_part_0_naming_the_rule_and_the_line(graded, tmp_path):
    r, lines = graded["forbidden"], _variant(tmp_path, "forbidden", FORBIDDEN).read_text().splitlines()
    at = {what: f".py:{lines.index(text) + 1}," for what, text in (
        ("ce", "    return theirs(logits, targets, start, group)"), ("qkv", "    distribute_tensor(weight)"))}
    for n in (CE, CE_BYTES):
        assert "minidist.tensor_parallel.gpt.vocab_parallel_cross_entropy was called at" in r[n].message, r[n].message
        assert at["ce"] in r[n].message and "scores 0" in r[n].message, r[n].message
    assert "torch.distributed.tensor.distribute_tensor was called at" in r[QKV].message, r[QKV].message
    assert at["qkv"] in r[QKV].message and "not DTensor" in r[QKV].message, r[QKV].message
    assert r[SP_GRAD].ok and r[SP_DROP].ok, (r[SP_GRAD].message, r[SP_DROP].message)


def test_the_drafts_messages_say_what_differs_not_why(graded):
    grad, drop = graded["draft"][SP_GRAD].message, graded["draft"][SP_DROP].message
    assert grad.startswith("on 2 ranks, rank 0: ") and "differs from one process's by up to" in grad, grad
    assert "positions 3:6 (rank 1's) are dropped exactly where positions 0:3" in drop, drop
    for message in (grad, drop):
        for diagnosis in ("twice", "summed", "all_reduce", "all-reduce", "same mask", "seed", "fork", "rng"):
            assert diagnosis not in message.lower(), (diagnosis, message)
