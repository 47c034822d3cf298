"""Chapter 07, Muon (chapters/07_muon.md): momentum orthogonalised by Newton-Schulz, the work
dealt over the ranks. Read in this order:

    orthogonalize.py  Newton-Schulz, one matrix or a batch of same-shaped ones
    optimizer.py      Muon, its distributed rounds, and the split of a model's parameters

Muon beside ZeRO's shards and on tensor-parallel shards combine two ideas: minidist/compose/.
"""

from minidist.muon.optimizer import (NS_COEFFICIENTS, newton_schulz, newton_schulz_many, schedule, adjust_lr,
    Muon, RoundBucket, plan_buckets, hidden_matrices, split_params, check_routing)
