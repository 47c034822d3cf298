"""A pipeline stage of v chunks, for interleaved 1F1B (Narayanan et al., "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", 2021): the model's blocks cut into
p v chunks of contiguous blocks, and rank r of the pipe holding chunks r, r + p, r + 2p, ...
(v of them), so a micro-batch goes round the ring of ranks v times.

Chapter 11 (chapters/11_pipeline.md), its appendix. Exercised by
`pytest tests/test_pipeline_schedules.py`; run by minidist/pipeline/slots.py's run_schedule.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn

from minidist.model import GPT
from minidist.pipeline.schedules import Stage, split_layers


def chunk_layers(n_layer: int, p: int, v: int) -> list[range]:
    """The blocks of each of the p v chunks, in model order (chunk c on rank c mod p)."""
    if v < 1 or n_layer < p * v:
        raise ValueError(f"{v} virtual stages on each of {p} stages cut the model into {p * v} chunks of at "
                         f"least one block, and it has n_layer={n_layer}: use --pp-virtual-stages 1 to "
                         f"{max(1, n_layer // p)}, or a deeper model")
    return split_layers(n_layer, p * v)


def describe_chunks(n_layer: int, p: int, v: int) -> str:
    """For the log: "stage 0: embeddings + blocks 0, 2 | stage 1: blocks 1, 3 + ln_f + head"."""
    cuts, parts = chunk_layers(n_layer, p, v), []
    for s in range(p):
        blocks = ", ".join(f"{r[0]}" if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in cuts[s::p])
        parts.append(f"stage {s}: " + " + ".join((["embeddings"] if s == 0 else []) + [f"blocks {blocks}"]
                                                 + (["ln_f + head"] if s == p - 1 else [])))
    return " | ".join(parts)


def stage_blocks(n_layer: int, p: int, v: int = 1) -> list[int]:
    """How many blocks each of the p ranks holds: a contiguous cut's (v = 1), or its v chunks'."""
    return [sum(map(len, chunk_layers(n_layer, p, v)[s::p])) if v > 1 else len(r)
            for s, r in enumerate(split_layers(n_layer, p))]


class InterleavedStage(Stage):
    """This rank's v chunks of `model`, as Stage holds one: named as in the full model (its
    state_dict a slice of the full one), the embeddings on the first stage (chunk 0 is rank
    0's) and the final norm and head on the last (so is the last chunk), the tied matrix on
    both, summed by allreduce_tied_grads. forward(x, targets, chunk) runs local chunk `chunk`
    (vstage chunk p + stage). With virtual_stages=1 it is a Stage."""

    def __init__(self, model: nn.Module, pp_group=None, virtual_stages: int = 2):
        p = dist.get_world_size(pp_group)
        cuts = chunk_layers(model.config.n_layer, p, virtual_stages)
        super().__init__(model, pp_group)  # the ends, the tied matrix, the links, the check
        self.virtual_stages = v = virtual_stages
        self.chunks = [cuts[c * p + self.stage] for c in range(v)]
        self.layers = [i for r in self.chunks for i in r]
        take = copy.deepcopy if isinstance(model, GPT) else (lambda module: module)
        # Stage took the contiguous cut's blocks; this rank's are these (the others are freed)
        self.blocks = nn.ModuleDict({str(i): take(model.blocks[i]) for i in self.layers})

    def describe(self) -> str:
        return describe_chunks(self.config.n_layer, self.stages, self.virtual_stages)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None, chunk: int = 0) -> torch.Tensor:
        vstage = chunk * self.stages + self.stage
        if vstage == 0:  # x: token indices (B, T)
            x = self.embed(x)
        for i in self.chunks[chunk]:
            x = self.blocks[str(i)](x)
        return self.head(x, targets)[1] if vstage == self.stages * self.virtual_stages - 1 else x
