"""Where memory goes in a training step: activations counted and derived, a model of the
whole step per rank, and a measurement of its peak. Chapter 09 (chapters/09_memory.md)
derives the activations per block and per token (8d + 14 e d + 4 H + 16, e the bytes of
autocast's dtype; checkpointing keeps 4d) and the step's peak. Exercised by
`python -m minidist.run.plan memory --preset gpt2 --world-size 8 --budget-gb 80` and
`pytest tests/test_memory.py`.

The formulas live in minidist.cost_model with every closed form of the course, so that
chapter 08's tables at scale use the same count (one memory model); this module counts and
measures what they predict.
"""

from __future__ import annotations

import gc
import warnings
from contextlib import contextmanager

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from minidist.cost_model import (ELEM, GB, activation_bytes, block_activation_bytes, block_params,
                                 head_activation_bytes, model_state_bytes, rank_params,
                                 zero3_gathered_bytes)
from minidist.model import GPTConfig

__all__ = ["ELEM", "GB", "activation_bytes", "block_activation_bytes", "head_activation_bytes",
           "zero3_gathered_bytes", "count_saved_bytes", "output_grad_bytes", "step_memory", "LiveBytes", "live_tensors",
           "storages_now", "measure_peak", "gib"]


# ------------------------------------------------------------------ activations, counted

def count_saved_bytes(model, idx, targets, precision: str = "fp32") -> dict:
    """Run a forward and count the bytes autograd saves for backward, deduplicated by
    storage, leaving out the parameters (model states, not activations). Returns
    {"blocks": [bytes saved while block i ran], "rest": the others, "total"}."""
    from minidist.scaler import autocast  # a technique beside this one, imported late
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, where, per = set(), ["rest"], {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            per[where[-1]] = per.get(where[-1], 0) + s.nbytes()
        return t

    def enter(i):
        return lambda module, args: where.append(i)  # returns None: the args stay

    def leave(module, args, out):
        where.pop()  # returns None: the output stays

    hooks = []
    for i, b in enumerate(model.blocks):
        hooks += [b.register_forward_pre_hook(enter(i)), b.register_forward_hook(leave)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(idx.device, precision):
            _, loss = model(idx, targets)
    finally:
        for h in hooks:
            h.remove()
    del loss
    blocks = [per.get(i, 0) for i in range(len(model.blocks))]
    return {"blocks": blocks, "rest": per.get("rest", 0), "total": sum(blocks) + per.get("rest", 0)}


# ------------------------------------------------------------------ the step, modelled

def output_grad_bytes(cfg: GPTConfig, B: int, T: int, blocks: int, first: bool, last: bool,
                      precision: str = "fp32", tp: int = 1, sequence_parallel: bool = False) -> int:
    """Bytes a micro-batch holds between a split backward's B and its W (chapter 11's ZB-H1):
    the gradient of every parameter-holding layer's output. A block's: its LayerNorms' (fp32,
    2d per token) and its Linears' (autocast's dtype, 9d: 3d and 4d split over tp); the first
    stage's lookups (B T d and T d), the last's ln_f and logits (a tp rank's V / tp). Counted
    against split.py's tensors without tp; with it, chapter 10's layout, not measured."""
    d, e, sp = cfg.n_embd, ELEM[precision], tp if sequence_parallel else 1
    block = B * T * (4 * 2 * d + e * 2 * d) // sp + B * T * e * 7 * d // tp
    table = 4 * T * d if sp == 1 else 0  # (under sequence parallelism read outside its module: none)
    return (blocks * block + (4 * B * T * d // sp + table if first else 0)
            + (4 * B * T * d // sp + B * T * e * -(-cfg.vocab_size // tp) if last else 0))



def step_memory(cfg: GPTConfig, micro_batch: int, seq_len: int, world: int = 1, stage: int = 0,
                checkpointed: bool = False, precision: str = "fp32", bucket_cap_mb: float = 25.0, *,
                tp: int = 1, sequence_parallel: bool = False, blocks: int | None = None,
                first: bool = True, last: bool = True, in_flight: int = 1, chunks: int = 1,
                pending_w: int = 0) -> dict:
    """Bytes per rank of one train_gpt step (AdamW, fp32 master weights and gradients,
    autocast at `precision`), by component, and the peak: the larger of two moments,
    the start of backward (every activation alive, the loss's gradient just made) and the
    end of backward (gradients complete).

    On a dp x tp x pp mesh (chapters 10, 11), `world` is the dp group, and the rank holds
    `tp`'s slice of `blocks` blocks, the embeddings if `first`, the head if `last`, and the
    activations of `in_flight` micro-batches (the result's "in_flight": gradient buffers).
    Chapter 11's appendix: with `chunks` > 1 (interleaved 1F1B) `in_flight` counts (chunk,
    micro-batch) forwards, each a chunks-th of the blocks (exact when the chunks are equal),
    and the head holds one (the last chunk's forward and backward share a slot); `pending_w`
    micro-batches (ZB-H1's) also hold their layers' output gradients until their W."""
    pipelined = not (first and last)
    if stage == 3 and (tp > 1 or pipelined) or stage == 2 and pipelined:
        raise ValueError(f"ZeRO-{stage} is not built with tensor or pipeline parallelism")
    psi = rank_params(cfg, tp, blocks, first, last)
    B, T, d, V = micro_batch, seq_len, cfg.n_embd, -(-cfg.vocab_size // tp)
    # fp32 parameters (4), gradients (4) and AdamW's two moments (8), sharded per stage
    states = model_state_bytes(psi, world, stage, k=8, p=4, g=4)
    params, grads = 4 * psi / (world if stage >= 3 else 1), 4 * psi / (world if stage >= 2 else 1)
    optim = states - params - grads
    block = 4 * block_params(cfg)
    unit = min(block if stage == 3 else 4 * psi, bucket_cap_mb * 2**20)  # a bucket's gradients
    if stage == 0 or pipelined:  # DDP's buckets (or a stage's flat buffer) hold the gradients;
        in_flight_grads = 4 * psi  # backward makes fresh ones beside them
    elif stage == 3:  # gathered: the root (embeddings, ln_f) and two whole blocks (prefetch);
        # and the gradients of the bucket being reduce-scattered (not validated: see chapter 09)
        in_flight_grads = zero3_gathered_bytes(cfg) + 2 * unit
    else:             # full gradients of the unit being reduce-scattered, and its result
        in_flight_grads = 2 * unit if stage == 2 else 0.0
    n = cfg.n_layer if blocks is None else blocks
    ends = head_activation_bytes(B, T, d, cfg.vocab_size, precision, tp) - 8 * B * T - 8 * T
    heads = (1 if chunks > 1 else in_flight) if last else 0
    act = in_flight * (n * block_activation_bytes(B, T, d, cfg.n_head, precision, checkpointed, tp,
                                                  sequence_parallel) / chunks
                       + (8 * B * T + 8 * T if first else 0)) + heads * ends  # indices; the head
    act += pending_w * output_grad_bytes(cfg, B, T, n, first, last, precision, tp, sequence_parallel)
    # recomputation: one block's activations, rebuilt during backward, and the gradient
    # of its widest tensor (the MLP's hidden, fp32)
    recompute = (block_activation_bytes(B, T, d, cfg.n_head, precision, False, tp, sequence_parallel)
                 + 16 * B * T * d // tp if checkpointed else 0)
    # the logits (autocast's dtype; train.forward_backward holds them through backward),
    # and, as backward starts, the gradients of the log-softmax's output and of its input
    # (fp32 B T V each), while that output is still saved
    logits_grad = B * T * V * (ELEM[precision] + 8) if last else 0
    start = states + act + logits_grad + (in_flight_grads if stage == 3 else 0)
    # recomputing the last block: the head's saved log-softmax is gone by then
    during = states + in_flight_grads + act - 4 * B * T * V * last + recompute
    end = states + in_flight_grads + 8 * B * T * d  # gradients complete; the embeddings' last
    out = dict(params=params, grads=grads, optimizer=optim, in_flight=in_flight_grads,
               activations=act, transient=max(logits_grad, recompute),
               peak=max(start, during, end))
    return {k: float(v) for k, v in out.items()}


# ------------------------------------------------------------------ the step, measured

class LiveBytes(TorchDispatchMode):
    """Counts the bytes of live tensor storages on CPU, op by op, and their peak: every
    storage an op returns is added and watched (a weak reference), and subtracted once it
    is freed. Storages alive when counting starts are found by walking Python's objects.
    What an op allocates and frees inside itself is not seen; nor storages resized in
    place (ZeRO-3's gathers)."""

    def __init__(self, exclude: set = frozenset()):
        super().__init__()
        self.watched: dict[int, tuple[StorageWeakRef, int]] = {}
        self.live = self.peak = 0
        for t in live_tensors():
            if t.untyped_storage().data_ptr() not in exclude:
                self._add(t)
        self.start = self.peak = self.live

    def _add(self, t: torch.Tensor) -> None:
        s = t.untyped_storage()
        key = s.data_ptr()
        if key and key not in self.watched:
            self.watched[key] = (StorageWeakRef(s), s.nbytes())
            self.live += s.nbytes()

    def _sweep(self) -> None:
        for key in [k for k, (ref, _) in self.watched.items() if ref.expired()]:
            self.live -= self.watched.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._sweep()
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t)
        self.peak = max(self.peak, self.live)
        return out


def live_tensors() -> list[torch.Tensor]:
    """Every tensor Python can see (parameters, optimizer state, buffers, ...)."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance on some torch modules' lazy attributes warns
        warnings.simplefilter("ignore")
        return [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.device.type != "meta"]


def storages_now() -> set:
    """The storages alive now: pass them to measure_peak(exclude=...) to leave out what
    existed before the run being measured was built."""
    return {t.untyped_storage().data_ptr() for t in live_tensors()}


@contextmanager
def measure_peak(exclude: set = frozenset()):
    """with measure_peak() as m: ...; then m.peak, m.start: bytes of live tensors."""
    mode = LiveBytes(exclude)
    with mode:
        yield mode
    mode._sweep()


def gib(x: float) -> str:
    """x bytes in GiB (2**30 bytes), or in MiB (2**20) below a tenth of a GiB."""
    return f"{x / 2**30:.2f} GiB" if x >= 2**30 / 10 else f"{x / 2**20:.1f} MiB"
