"""Newton-Schulz: the orthogonalisation inside Muon, one matrix at a time or a batch of
same-shaped matrices at once, with two coefficient choices. Chapter 07
(chapters/07_muon.md), section 2. Exercised by:

    pytest tests/test_muon.py
    python -m minidist.bench.muon      # the singular-value band and the batched speedup

An odd polynomial step X <- a X + b (X X^T) X + c (X X^T)^2 X acts on each singular value
s of X as p(s) = a s + b s^3 + c s^5 and leaves the singular vectors alone, so a few steps
carry G = U S V^T towards U V^T with nothing but matrix products.

Coefficients: "jordan", Keller Jordan's fixed quintic (torch.optim.Muon's default);
"polar_express", a minimax-best quintic per step (Amsel et al., arXiv:2505.16932, 2025;
the numbers the modded-nanogpt speedrun uses, with the input divided by 1.02 ||G||_F);
or a tuple (a, b, c), as torch.optim.Muon's `ns_coefficients`.
"""

from __future__ import annotations

import torch

JORDAN = (3.4445, -4.7750, 2.0315)
NS_COEFFICIENTS = JORDAN  # the name chapter 07 and the exercise use for the default
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
POLAR_EXPRESS_MARGIN = 1.02  # divide by 1.02 ||G||_F: the safety factor the schedule was built for


def schedule(coefficients="jordan", steps: int = 5) -> tuple[list[tuple[float, float, float]], float]:
    """([(a, b, c) for each step], the margin the Frobenius norm is multiplied by)."""
    if coefficients == "jordan":
        return [JORDAN] * steps, 1.0
    if coefficients == "polar_express":
        if steps > len(POLAR_EXPRESS):
            raise ValueError(f"the polar_express schedule has {len(POLAR_EXPRESS)} steps, got "
                             f"steps={steps}: use ns_steps <= {len(POLAR_EXPRESS)} or 'jordan'")
        return list(POLAR_EXPRESS[:steps]), POLAR_EXPRESS_MARGIN
    if isinstance(coefficients, (tuple, list)) and len(coefficients) == 3:
        return [tuple(float(c) for c in coefficients)] * steps, 1.0
    raise ValueError(f"Newton-Schulz coefficients must be 'jordan', 'polar_express' or a tuple "
                     f"(a, b, c), got {coefficients!r}")


def newton_schulz(G: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16,
                  eps: float = 1e-7, coefficients="jordan") -> torch.Tensor:
    """Approximately U V^T for G = U S V^T, over the last two dimensions (leading ones are
    a batch). Runs in `dtype` (bf16: fast on tensor cores and on CPUs with AMX; fp32 on
    request) and returns that dtype."""
    if G.dim() < 2:
        raise ValueError(f"newton_schulz needs a matrix (or a batch of them), got shape {tuple(G.shape)}")
    coefs, margin = schedule(coefficients, steps)
    X = G.to(dtype)
    tall = X.size(-2) > X.size(-1)
    if tall:  # iterate on the wide side: X X^T is then the smaller Gram matrix
        X = X.mT
    batch_shape = X.shape[:-2]
    X = X.reshape(-1, *X.shape[-2:])  # (batch, m, n), m <= n
    # Frobenius norm >= spectral norm, so dividing puts every singular value in [0, 1],
    # where the polynomial is designed to work (eps guards an all-zero matrix)
    norm = X.norm(dim=(-2, -1), keepdim=True)
    X = X / (norm if margin == 1.0 else norm * margin).clamp(min=eps)
    for a, b, c in coefs:
        A = torch.bmm(X, X.mT)  # Gram matrix, m x m (bmm: `@` on 3-D bf16 is slow on CPU)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b A + c A^2
        X = torch.baddbmm(X, B, X, beta=a)  # a X + B X
    X = X.reshape(*batch_shape, *X.shape[-2:])
    return X.mT if tall else X


def newton_schulz_many(matrices: list[torch.Tensor], steps: int = 5,
                       dtype: torch.dtype = torch.bfloat16, eps: float = 1e-7,
                       coefficients="jordan") -> list[torch.Tensor]:
    """newton_schulz of each matrix, one batched chain per shape once turned wide (an (m, n)
    and an (n, m) both iterate as (min, max)). Each keeps its own norm, so each result is
    its own; a GPU's batched kernels may round differently from one by one."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, M in enumerate(matrices):
        groups.setdefault((min(M.shape), max(M.shape)), []).append(i)
    out: list[torch.Tensor | None] = [None] * len(matrices)
    for idx in groups.values():
        wide = [matrices[i].to(dtype) for i in idx]  # to dtype first, as newton_schulz does
        wide = [M.mT if M.size(0) > M.size(1) else M for M in wide]
        O = newton_schulz(torch.stack(wide), steps, dtype, eps, coefficients)
        for k, i in enumerate(idx):
            out[i] = O[k].mT if matrices[i].size(0) > matrices[i].size(1) else O[k]
    return out
