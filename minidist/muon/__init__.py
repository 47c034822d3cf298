"""Chapter 07, Muon (chapters/07_muon.md): momentum orthogonalised by Newton-Schulz, the work
dealt over the ranks. Read in this order:

    plain.py          the plain form (the book's chapter 07): Newton-Schulz, Muon, one round at a time
    orthogonalize.py  Newton-Schulz, one matrix or a batch of same-shaped ones, two coefficient choices
    optimizer.py      Muon as training runs it: rounds in overlapped buckets; the split of a model's parameters

Muon beside ZeRO's shards and on tensor-parallel shards combine two ideas: minidist/compose/.
"""

from minidist.muon.optimizer import (NS_COEFFICIENTS, newton_schulz, newton_schulz_many, schedule, adjust_lr,
    Muon, RoundBucket, plan_buckets, hidden_matrices, split_params, check_routing)
