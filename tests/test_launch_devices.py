"""Every launched process group gets the backend its tensors need: gloo for CPU tensors,
NCCL for CUDA tensors (NCCL rejects CPU tensors, so a demo built on CPU tensors that got
NCCL would fail on a machine with GPUs).

minidist.launch picks gloo unless the caller asks for a GPU run. Here the parent pretends
to be a host with eight GPUs (torch.cuda patched), records which backend launch and Pool
choose, and runs representative launched functions, a notebook's (02's collectives, 06's
ZeRO by hand) and a grader's (exercise 02, minidist's reference), with a guard in every
rank: each call of a collective or send/recv on a ProcessGroup first checks that its
tensors are on the device that group's backend takes. The guard is proven to catch a
tensor on the wrong device before anything relies on it finding none.
"""

import ast
import json

import pytest
import torch
import torch.distributed as dist

import minidist.run.launch as L
import minidist.run.pool as P
from conftest import ROOT
from minidist.launch import launch
from minidist.run.pool import Pool

# The ProcessGroup methods that move tensors: torch.distributed's functions all call one
# of them (dist.all_reduce -> allreduce, dist.isend -> send, ...), so do minidist.comm's.
MOVES_TENSORS = ("allreduce", "allreduce_coalesced", "broadcast", "allgather", "_allgather_base",
                 "all_gather_single", "allgather_coalesced", "allgather_into_tensor_coalesced",
                 "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single",
                 "reduce_scatter_tensor_coalesced", "reduce", "gather", "scatter", "alltoall",
                 "alltoall_base", "all_to_all_single", "send", "recv", "recv_anysource")
TAKES = {"gloo": "cpu", "nccl": "cuda"}  # the device type of the tensors each backend takes


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)


def _guarded(fn, *args):
    """In a rank: fn(*args) with every tensor-moving ProcessGroup call checked first.
    Returns (fn's value, {"calls": n, "wrong": [...]}): the parent asserts on both (a
    violation is recorded, not raised, so a grader's own error handling cannot hide it)."""
    seen = {"calls": 0, "wrong": []}

    def check(pg, name, args):
        want = TAKES.get(pg.name())
        seen["calls"] += 1
        for t in _tensors(args):
            if want is None or t.device.type != want:
                seen["wrong"].append(f"{name} on {pg.name()} got a {t.device.type} tensor")

    saved = {}
    for name in MOVES_TENSORS:
        if not hasattr(dist.ProcessGroup, name):
            continue
        orig = getattr(dist.ProcessGroup, name)
        saved[name] = dist.ProcessGroup.__dict__.get(name)

        def wrapper(pg, *a, _orig=orig, _name=name, **k):
            check(pg, _name, a)
            return _orig(pg, *a, **k)
        setattr(dist.ProcessGroup, name, wrapper)
    try:
        return fn(*args), seen
    finally:  # a Pool's processes serve later calls: leave the class as it was
        for name, orig in saved.items():
            if orig is None:
                delattr(dist.ProcessGroup, name)
            else:
                setattr(dist.ProcessGroup, name, orig)


@pytest.fixture
def gpu_host(monkeypatch):
    """This process looks like a host with eight GPUs; the backend of every launch and
    Pool it starts is recorded. (The ranks see the real machine: were NCCL chosen, their
    torch.cuda.set_device would fail here.)"""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.delenv("MINIDIST_DEVICE", raising=False)
    chosen = []
    real = L.choose_backend

    def recording(world_size, backend, device):
        chosen.append(real(world_size, backend, device))
        return chosen[-1]
    monkeypatch.setattr(L, "choose_backend", recording)
    monkeypatch.setattr(P, "choose_backend", recording)
    return chosen


def test_the_backend_follows_what_the_caller_asks_for(gpu_host):
    # nothing asked: gloo on CPU, however many GPUs there are
    assert L.choose_backend(2, None, None) == ("gloo", "cpu")
    assert L.choose_backend(2, None, "cpu") == L.choose_backend(2, "gloo", None) == ("gloo", "cpu")
    # a GPU run asked for: NCCL, one GPU per rank
    assert L.choose_backend(2, None, "cuda") == L.choose_backend(2, "nccl", None) == ("nccl", "cuda")
    assert L.choose_backend(2, None, "auto") == ("nccl", "cuda")  # eight GPUs, two ranks
    assert L.choose_backend(9, None, "auto") == ("gloo", "cpu")   # not one GPU per rank
    with pytest.raises(ValueError, match="takes cuda tensors"):
        L.choose_backend(2, "nccl", "cpu")
    with pytest.raises(ValueError, match="device must be"):
        L.choose_backend(2, None, "gpu")
    assert Pool(2).backend == "gloo"  # a Pool starts nothing until its first run


def test_a_gpu_run_on_a_host_without_one_says_so():
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        launch(abs, 2, -1, device="cuda")


def _meta_all_reduce():
    try:  # the guard sees it first; gloo then refuses the meta tensor
        dist.all_reduce(torch.empty(3, device="meta"))
    except Exception:  # noqa: BLE001 - what gloo says is not the point here
        pass
    dist.all_reduce(torch.ones(2))
    return dist.get_backend()


def test_the_guard_catches_a_tensor_on_the_wrong_device():
    out = launch(_guarded, 2, _meta_all_reduce)
    for backend, seen in out:
        assert backend == "gloo" and seen["calls"] == 2
        assert seen["wrong"] == ["allreduce on gloo got a meta tensor"]


def _notebook_functions(name):
    """The imports and function definitions of notebooks/`name` (its other statements
    are not run): the functions the notebook launches, as its cells define them."""
    nb = json.loads((ROOT / "notebooks" / name).read_text())
    ns = {"__name__": "__main__"}  # cloudpickle ships __main__'s functions by value, as from a kernel
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        src = "".join(cell["source"])
        src = "\n".join(ln for ln in src.splitlines() if not ln.lstrip().startswith(("%", "!")))
        keep = [node for node in ast.parse(src).body
                if isinstance(node, (ast.FunctionDef, ast.Import))
                or (isinstance(node, ast.ImportFrom) and node.module != "nbfigures")]
        exec(compile(ast.Module(keep, type_ignores=[]), name, "exec"), ns)
    return ns


def test_notebooks_launched_functions_keep_their_tensors_on_their_backends_device(gpu_host):
    from minidist.model import GPTConfig
    nb02 = _notebook_functions("02_collectives.ipynb")
    out = launch(_guarded, 2, nb02["check_collectives"], (1, 7))  # as notebook 02 calls it
    assert all(max(r["diffs"].values()) < 1e-5 for r, _ in out)

    nb06 = _notebook_functions("06_zero.ipynb")
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=32)
    x = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(0))
    batches = [(x, torch.roll(x, -1, dims=1))]
    by_hand = launch(_guarded, 2, nb06["by_hand"], cfg, batches, dict(lr=1e-2))  # ZeRO 1-3 by hand
    assert set(by_hand[0][0]) == {1, 2, 3}

    assert gpu_host == [("gloo", "cpu")] * 2  # eight GPUs, CPU tensors: gloo, both times
    for _, seen in out + by_hand:
        assert seen["calls"] > 10 and seen["wrong"] == []


def test_a_graders_launched_functions_keep_their_tensors_on_their_backends_device(gpu_host, monkeypatch):
    from exercises.grader import Cache, checks_02, core
    monkeypatch.setattr(checks_02, "WORLD_SIZES", (2,))
    monkeypatch.setattr(checks_02, "_CACHE", Cache())  # results of an earlier grading in this session
    seen = []
    real_run = Pool.run

    def guarded_run(self, fn, *args, **kw):
        outs = real_run(self, _guarded, fn, *args, **kw)
        seen.extend(s for _, s in outs)
        return [value for value, _ in outs]
    monkeypatch.setattr(Pool, "run", guarded_run)
    pool = Pool(2, timeout_s=60)  # the grader's shared pool, on this test's own processes
    monkeypatch.setattr("exercises.grader.ranks.shared_pool", lambda n: pool)
    try:
        result = core.grade("02", reference=True)
    finally:
        pool.close()
    assert result.points == result.max_points, {c.name: c.message for c in result.checks if not c.ok}
    assert gpu_host == [("gloo", "cpu")]
    assert seen and sum(s["calls"] for s in seen) > 10
    assert [w for s in seen for w in s["wrong"]] == []
