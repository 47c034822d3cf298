"""Exercise 10's grader: the stubs score 0, minidist scores full, a plain solution written
the way the exercise asks scores full, classic mistakes lose the checks they belong to,
and solutions that break a rule score 0 on the parts they break, naming the rule.

(tests/test_exercises.py proves the stub/reference pair for every exercise too.) The
mistakes and rule-breakers run on 2 ranks only (the grader itself runs 2 and 3). The
solutions live at module level: cloudpickle ships them to the ranks by name.
"""

import importlib

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn as nn
import torch.nn.functional as F

from exercises import checks_10 as C10
from exercises import grade as G
from grading_helpers import assert_keys_name_each_check_once, failed_checks, message_of

EX10 = importlib.import_module("exercises.10_tensor_parallel")

KEYS = {"fg": "f and g", "column": "ColumnParallelLinear:", "row": "RowParallelLinear:",
        "mlp": "ParallelMLP ==", "comm": "communication and work",
        "sp_grad": "sequence_parallel_mlp's gradients", "sp_dropout": "sequence_parallel_mlp's dropout"}


# -- 0. a plain solution, written the way the exercise asks

class _F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _G(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def plain_f(x, group):
    return _F.apply(x, group)


def plain_g(x, group):
    return _G.apply(x, group)


def _block(n, group):
    t, r = dist.get_world_size(group), dist.get_rank(group)
    return slice(r * n // t, (r + 1) * n // t)


class PlainColumn(nn.Module):
    f = staticmethod(plain_f)

    def __init__(self, full, group):
        super().__init__()
        rows, self.group = _block(full.out_features, group), group
        self.weight = nn.Parameter(full.weight.detach()[rows].clone())
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach()[rows].clone())

    def forward(self, x):
        return F.linear(type(self).f(x, self.group), self.weight, self.bias)


class PlainRow(nn.Module):
    def __init__(self, full, group):
        super().__init__()
        cols, self.group = _block(full.in_features, group), group
        self.weight = nn.Parameter(full.weight.detach()[:, cols].clone())
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())

    def forward(self, x):
        y = plain_g(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class PlainMLP(nn.Module):
    column, row = PlainColumn, PlainRow

    def __init__(self, full, group):
        super().__init__()
        self.c_fc = type(self).column(full.c_fc, group)
        self.c_proj = type(self).row(full.c_proj, group)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return EX10._gather_positions(x, group)

    @staticmethod
    def backward(ctx, grad):
        return EX10._scatter_positions(grad, ctx.group), None  # the reduce-scatter sums once


def plain_sequence_parallel_mlp(x, w_fc, w_proj, group, p=0.0):
    h = _Gather.apply(x, group)
    y = EX10._ScatterPositions.apply(F.linear(F.gelu(F.linear(h, w_fc), approximate="tanh"), w_proj), group)
    if p > 0:
        seed = int(torch.randint(0, 2**62, (1,)))  # the same on every rank; the stream moves on
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + dist.get_rank(group))
            y = F.dropout(y, p, training=True)
    return x + y


PLAIN = {"copy_to_region": plain_f, "reduce_from_region": plain_g, "ColumnParallelLinear": PlainColumn,
         "RowParallelLinear": PlainRow, "ParallelMLP": PlainMLP,
         "sequence_parallel_mlp": plain_sequence_parallel_mlp}


# -- 1. mistakes

class BiasOnEveryRank(PlainRow):
    """The bias added by every rank before the sum: counted t times."""

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        return plain_g(y, self.group)


class MLPBiasOnEveryRank(PlainMLP):
    row = BiasOnEveryRank


def f_without_backward_sum(x, group):
    return x  # identity both ways: the input's gradient stays this rank's partial sum


class ColumnWithoutSum(PlainColumn):
    f = staticmethod(f_without_backward_sum)


class MLPWithoutSum(PlainMLP):
    column = ColumnWithoutSum


# -- 2. rule-breakers

def torch_nn_all_reduce(x, group):
    return dist_nn.all_reduce(x, group=group)  # torch's autograd-aware all-reduce: g, ready-made


def minidist_column(full, group):
    import minidist.tensor_parallel as tp  # the answer, imported
    return tp.ColumnParallelLinear(full, group)


class MinidistMLP(PlainMLP):
    column = staticmethod(minidist_column)


# --------------------------------------------------------------------- the gradings

@pytest.fixture
def two_ranks(monkeypatch):
    monkeypatch.setattr(C10, "WORLD_SIZES", (2,))


def _grade(overrides):
    return G.grade("10", overrides=overrides)


def test_keys_name_each_check_once():
    assert_keys_name_each_check_once("10", KEYS)


def test_stubs_score_zero():
    r = G.grade("10")
    assert r.points == 0 and r.total == len(KEYS)
    failed, messages = failed_checks(r, KEYS)
    assert failed == set(KEYS)
    assert "summed over the ranks twice" in message_of(messages, KEYS, "sp_grad")
    assert "same dropout mask" in message_of(messages, KEYS, "sp_dropout")


def test_reference_scores_full():
    r = G.grade("10", reference=True)
    assert r.points == r.max_points == 14, {c.name: c.message for c in r.checks if not c.ok}


def test_plain_solution_scores_full(two_ranks):
    r = _grade(PLAIN)
    assert r.points == r.max_points, {c.name: c.message for c in r.checks if not c.ok}


def test_bias_added_on_every_rank_loses_row_and_mlp(two_ranks):
    r = _grade({**PLAIN, "RowParallelLinear": BiasOnEveryRank, "ParallelMLP": MLPBiasOnEveryRank})
    failed, messages = failed_checks(r, KEYS)
    assert failed == {"row", "mlp"}, messages
    assert "1 more copies of the bias" in message_of(messages, KEYS, "row")


def test_f_without_backward_all_reduce_loses_its_checks(two_ranks):
    r = _grade({**PLAIN, "copy_to_region": f_without_backward_sum,
                "ColumnParallelLinear": ColumnWithoutSum, "ParallelMLP": MLPWithoutSum})
    failed, messages = failed_checks(r, KEYS)
    assert failed == {"fg", "column", "mlp", "comm"}, messages
    assert "sum over the group's ranks" in message_of(messages, KEYS, "column")


def test_torch_distributed_nn_functional_scores_zero_where_used(two_ranks):
    r = _grade({**PLAIN, "reduce_from_region": torch_nn_all_reduce})
    failed, messages = failed_checks(r, KEYS)
    assert failed == {"fg", "comm"}, messages
    assert "torch.distributed.nn.functional" in message_of(messages, KEYS, "fg")
    assert "scores 0" in message_of(messages, KEYS, "fg")


def test_importing_minidist_tensor_parallel_scores_zero_where_used(two_ranks):
    r = _grade({**PLAIN, "ColumnParallelLinear": minidist_column, "ParallelMLP": MinidistMLP})
    failed, messages = failed_checks(r, KEYS)
    assert failed == {"column", "mlp", "comm"}, messages
    for key in ("column", "mlp"):
        assert "minidist.tensor_parallel.layers.ColumnParallelLinear was called" in message_of(messages, KEYS, key)


def test_minidist_functions_under_the_stub_names_are_not_the_reference(two_ranks):
    # the same objects the reference adapters call, taken directly: not trusted, they trip
    from minidist import tensor_parallel as tp
    r = _grade({**PLAIN, "copy_to_region": tp.copy_to_region, "reduce_from_region": tp.reduce_from_region})
    failed, messages = failed_checks(r, KEYS)
    assert failed == {"fg", "comm"}, messages
    assert "minidist.tensor_parallel.layers.copy_to_region was called" in message_of(messages, KEYS, "fg")
    assert "scores 0" in message_of(messages, KEYS, "fg")


class DTensorColumn(PlainColumn):
    """torch's own column split: the import trips (or, where DTensor is loaded already,
    the style's constructor)."""

    def __init__(self, full, group):
        super().__init__(full, group)
        from torch.distributed.tensor.parallel import ColwiseParallel
        ColwiseParallel()


class DTensorMLP(PlainMLP):
    column = DTensorColumn


def test_dtensor_parallel_styles_score_zero_where_used(two_ranks):
    r = _grade({**PLAIN, "ColumnParallelLinear": DTensorColumn, "ParallelMLP": DTensorMLP})
    failed, messages = failed_checks(r, KEYS)
    assert failed == {"column", "mlp", "comm"}, messages
    assert "torch.distributed.tensor" in message_of(messages, KEYS, "column")
    assert "scores 0" in message_of(messages, KEYS, "column")


CHEATS = {
    "from minidist.tensor_parallel import copy_to_region\n": "minidist.tensor_parallel",
    "import minidist.tensor_parallel.gpt as tpg\n": "minidist.tensor_parallel.gpt",
    "from minidist import tensor_parallel\n": "minidist.tensor_parallel",
    "from torch.distributed.tensor.parallel import parallelize_module\n": "torch.distributed.tensor",
    "import torch.distributed as dist\ny = dist.nn.functional.all_reduce\n": "torch.distributed.nn",
    "from exercises.checks_10 import reference_copy_to_region\n": "exercises",
    "import importlib\n": "importlib",
    "import torch\ny = torch.ops.c10d.allreduce_\n": "torch.ops",
}


@pytest.mark.parametrize("source", list(CHEATS))
def test_file_check_names_the_line_and_the_rule(source):
    problems = C10.file_problems("import torch.nn as nn\n" + source)
    assert problems, source
    line = source.count("\n") + 1  # the source's last line, after the one above it
    assert f"line {line}:" in problems[0] and CHEATS[source] in problems[0], problems


def test_the_stub_file_passes_the_file_check():
    assert C10.file_problems(C10.LEARNER_FILE.read_text()) == []


def test_a_file_that_imports_the_answer_scores_zero_everywhere(tmp_path, monkeypatch):
    cheat = tmp_path / "10_tensor_parallel.py"
    cheat.write_text(C10.LEARNER_FILE.read_text().replace(
        "import torch.nn as nn\n", "import torch.nn as nn\nfrom minidist.tensor_parallel import *\n", 1))
    monkeypatch.setattr(C10, "LEARNER_FILE", cheat)
    r = _grade(PLAIN)  # even with a working solution: nothing runs
    assert r.points == 0
    assert all("minidist.tensor_parallel" in c.message and "line" in c.message for c in r.checks)
