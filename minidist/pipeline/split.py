"""A stage's backward split in two, as the zero-bubble schedules need it: B, the gradient of
the stage's input (what the stage before waits for), and W, the gradients of its weights
(what nobody waits for, so it can run later, in a bubble).

Chapter 11 (chapters/11_pipeline.md), its appendix; minidist/pipeline/slots.py runs ZB-H1 with
it, and `pytest tests/test_pipeline_schedules.py` checks the sum of the halves against one
process's backward.

How, with autograd alone. During the forward, `capture` notes the output of every layer that
holds parameters, as a gradient edge (the graph node that made it, not the tensor: nothing is
kept alive that the graph does not keep). B asks autograd for the gradient of the input and of
every noted output at once, keeping the graph; autograd skips every weight-gradient product,
which no one asked for. W then asks, layer by layer, for that layer's parameters only, from the
gradient of its output: one matmul per Linear, walking no further back. Asking W for all the
weights in one call from the loss instead would redo B's whole walk. Between B and W a
micro-batch holds its activations (the graph) and its layers' output gradients.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.autograd.graph import get_gradient_edge


class Notes(list):
    """What `capture` noted: (layer, gradient edge of its output) in call order, and in
    `others` the parameters no noted layer holds, used outside a layer's call (under
    sequence parallelism the position table is read by F.embedding, not by its module):
    B gets their gradients at once, as an unsplit backward would."""
    others: list


@contextmanager
def capture(module: torch.nn.Module):
    """Inside: a Notes that fills with (layer, gradient edge of its output) for every call of a
    submodule of `module` that holds parameters needing gradients, in call order; its
    `others` is filled on leaving."""
    noted = Notes()

    def note(layer, args, out):
        if isinstance(out, torch.Tensor) and out.requires_grad:
            noted.append((layer, get_gradient_edge(out)))
    owners = [mod for mod in module.modules() if any(p.requires_grad for p in mod.parameters(recurse=False))]
    handles = [mod.register_forward_hook(note) for mod in owners]
    try:
        yield noted
    finally:
        for h in handles:
            h.remove()
    held = {id(p) for layer, _ in noted for p in layer.parameters(recurse=False)}
    noted.others = [p for p in module.parameters() if p.requires_grad and id(p) not in held]


def backward_input(out: torch.Tensor, grad: torch.Tensor | None, inp: torch.Tensor | None, noted: Notes):
    """B: from `out` (the loss, grad None, on the last stage; else the output with the
    gradient received for it), the gradient of the stage input `inp` (None on the first stage,
    whose input is token indices), and what W needs: [(layer, edge, gradient of its output)].
    The gradients of `noted.others` are added into .grad here."""
    edges, others = [edge for _, edge in noted], getattr(noted, "others", [])
    wanted = ([inp] if inp is not None else []) + edges + others
    # the graph stays for W; allow_unused: a parameter in `others` may not be used at all
    grads = torch.autograd.grad(out, wanted, grad, retain_graph=True, allow_unused=True)
    g_in = grads[0] if inp is not None else None
    first = len(wanted) - len(edges) - len(others)
    for p, g in zip(others, grads[first + len(edges):]):
        if g is not None:
            p.grad = g if p.grad is None else p.grad.add_(g)
    return g_in, [(layer, edge, g) for (layer, edge), g in zip(noted, grads[first:first + len(edges)])
                  if g is not None]  # (None: an output the loss does not depend on)


def backward_weights(pending: list) -> None:
    """W: each layer's parameter gradients from its output's, added into .grad as backward
    would add them (each parameter once per micro-batch: one layer uses it)."""
    for layer, edge, g in pending:
        params = [p for p in layer.parameters(recurse=False) if p.requires_grad]
        for p, w in zip(params, torch.autograd.grad([edge], params, [g], allow_unused=True)):
            if w is not None:
                p.grad = w if p.grad is None else p.grad.add_(w)
