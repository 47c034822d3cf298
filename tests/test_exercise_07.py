"""Exercise 07's grader: torch's Muon, torch's or minidist's Newton-Schulz, or an all-gather in
Muon on shards, score 0 on the part that calls them, naming the line; each classic mistake
loses its own checks. Newton-Schulz and one-process Muon mistakes run here, one function
swapped; the distributed ones are tests/solutions/07_muon.py with pieces changed, several
parts' mistakes in one file (the parts are graded apart), each file graded once, on 2 ranks.
"""

import importlib.util
import re
from pathlib import Path

import pytest

from exercises.grader import checks_07 as C7
from exercises.grader import core

SOLUTION = (Path(__file__).parent / "solutions" / "07_muon.py").read_text()
# the checks, by a word of their names
CHECKS = {"values": "singular value", "tall": "tall", "batched": "batched", "dtype": "dtype and eps",
          "bits": "bit for bit torch's own", "one": "Muon, one process", "ranks": "every rank's param",
          "missing": "gradients None", "owner": "one owner", "shards": "the shards put together",
          "momenta": "momentum whole", "bytes": "bytes received"}
PART = {"a": {"values", "tall", "batched", "dtype", "bits"}, "b": {"one", "ranks", "missing", "owner"},
        "c": {"shards", "momenta", "bytes"}}
RET = "return X.mT if tall else X"
NS = "    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # singular values in [0, 1]\n"
# name: (edits (old, new) of the solution, the checks that must fail)
HERE = {
    "no division by the norm": ([(NS, "")], PART["a"]),
    "one norm for the whole batch": ([("X.norm(dim=(-2, -1), keepdim=True)", "X.norm()")],
                                     {"batched", "bits"}),
    "tall matrices not transposed": ([("tall = X.size(-2) > X.size(-1)", "tall = False")], {"tall", "bits"}),
    "G divided in place": ([(NS, NS.replace("X / X.norm", "X.div_(X.norm").replace("eps)", "eps))"))],
                           {"dtype"}),
    "no eps": ([(".clamp(min=eps)", "")], {"dtype"}),
    "fp32 inside, dtype at the end": ([("X = G.to(dtype)", "X = G.float()"),
                                       (RET, "return (X.mT if tall else X).to(dtype)")], {"bits"}),
    "torch's Newton-Schulz inside": ([("    a, b, c = NS_COEFFICIENTS\n", "    return torch.optim._muon."
                                       "_zeropower_via_newtonschulz(G, NS_COEFFICIENTS, steps, eps)\n")],
                                     PART["a"]),
    "Nesterov ignored": ([('M = p.grad.lerp(buf, g["momentum"]) if g["nesterov"] else buf', "M = buf")],
                         {"one"}),
    "momentum summed": ([('buf.lerp_(p.grad, 1 - g["momentum"])', 'buf.mul_(g["momentum"]).add_(p.grad)')],
                        {"one"}),
}
GATHER = "        dist.all_gather_single(torch.empty(n * S), grad_shard, group=group)\n"
# name: (edits, {check that must fail: a phrase of its message})
ADJUST = "from minidist.muon import adjust_lr"
MINE = "    mine = [i for i, o in enumerate(owners) if o == rank]\n"
ON_RANKS = {
    "torch's Muon; shards without momentum": (
        [("class Muon(torch.optim.Optimizer):", "class Muon(torch.optim.Muon):"),
         ("        buf = momenta.setdefault(i, torch.zeros_like(grad))\n"
          "        buf.lerp_(grad, 1 - momentum)\n        M = grad.lerp(buf, momentum) if nesterov else buf\n",
          "        M = grad\n")],
        {**dict.fromkeys(PART["b"], "torch.optim.Muon was called at"), "shards": "torch.optim.Muon's",
         "momenta": "keeps momenta []"}),
    "minidist's Newton-Schulz; an all-gather; every rank orthogonalises all": (
        [("    a, b, c = NS_COEFFICIENTS\n", "    return ns_reference(G, steps, dtype, eps)\n"),
         (ADJUST, ADJUST + ", newton_schulz as ns_reference  #"),
         (MINE, GATHER[4:] + MINE), ("if world == 1:", "if True:")],
        {**dict.fromkeys(PART["a"], "minidist.muon.orthogonalize.newton_schulz was called at"),
         **dict.fromkeys(PART["c"], "dist.all_gather_into_tensor was called at"),
         "owner": "momentum_buffer is on ranks"}),
    "updates sent in fp32": (
        [("send = torch.zeros(1 + max(items[i][0].numel() for i in round_), dtype=self.ns_dtype)",
          "send = torch.zeros(1 + max(items[i][0].numel() for i in round_))"),
         ("recv = torch.empty(sum(in_sizes), dtype=ns_dtype)", "recv = torch.empty(sum(in_sizes))"),
         ("send = torch.cat(send) if send else torch.empty(0, dtype=ns_dtype)",
          "send = torch.cat(send).float() if send else torch.empty(0)")],
        {"owner": "its collectives sent", "bytes": "received"}),
}


def _edited(tmp: Path, name: str, edits) -> Path:
    text = SOLUTION
    for old, new in edits:
        assert text.count(old) == 1, (name, old)
        text = text.replace(old, new)
    path = tmp / f"{''.join(c if c.isalnum() else '_' for c in name)}.py"
    path.write_text(text)
    return path


def _failed(result) -> dict:
    return {key: c.message for c in result.checks if not c.ok
            for key, word in CHECKS.items() if word in c.name}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ex07")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(C7, "WORLD_SIZES", (2,))
        return {name: (core.grade("07", path=(path := _edited(tmp, name, edits))), path)
                for name, (edits, _) in ON_RANKS.items()}


def test_the_keys_name_each_check_once():
    names = [c.name for c in core.checks_of("07")]
    assert sorted(k for k, w in CHECKS.items() for n in names if w in n) == sorted(CHECKS)
    assert set().union(*PART.values()) == set(CHECKS)


@pytest.mark.parametrize("mistake", list(HERE))
def test_a_slip_here_loses_its_checks(mistake, tmp_path, monkeypatch):
    edits, must_fail = HERE[mistake]
    spec = importlib.util.spec_from_file_location("variant_07", _edited(tmp_path, mistake, edits))
    spec.loader.exec_module(module := importlib.util.module_from_spec(spec))
    name = "Muon" if must_fail == {"one"} else "newton_schulz"
    here = PART["a"] if name == "newton_schulz" else {"one"}  # the checks of the part that run here
    monkeypatch.setitem(core.CHECKS, "07", [c for c in core.checks_of("07")
                                            if any(CHECKS[k] in c.name for k in here)])
    failed = _failed(core.grade("07", reference=True, overrides={name: getattr(module, name)}))
    assert set(failed) == must_fail, failed
    assert not any(re.match(r"\w+Error|not implemented", m) for m in failed.values()), failed
    if "torch's" in mistake:
        assert all("_zeropower_via_newtonschulz was called at" in m and "scores 0" in m
                   for m in failed.values()), failed


RULE_AT = {"torch.optim.Muon": "super().__init__(params, defaults)",  # where each rule is broken
           "dist.all_gather_into_tensor": GATHER.strip(),
           "minidist.muon.orthogonalize.newton_schulz": "return ns_reference(G, steps, dtype, eps)"}


@pytest.mark.parametrize("mistake", list(ON_RANKS))
def test_each_mistake_on_ranks_loses_its_checks(mistake, graded):
    result, path = graded[mistake]
    failed, must_fail = _failed(result), ON_RANKS[mistake][1]
    assert set(failed) == set(must_fail), failed
    lines = path.read_text().splitlines()
    for key, phrase in must_fail.items():
        assert phrase in failed[key], (key, failed[key])
        if phrase.endswith("was called at"):  # the rule, at the line that broke it: its part scores 0
            line = next(i for i, text in enumerate(lines, 1) if RULE_AT[phrase.split(" was")[0]] in text)
            assert f"{path.name}:{line}" in failed[key] and "scores 0" in failed[key], failed[key]
