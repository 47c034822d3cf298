"""Chapter 08, at scale: checkpoints that survive a failure, and the faults to prove it
(chapters/08_at_scale.md). Read in this order:

    plain.py     the plain form (the book's chapter 08): each rank saves what it holds, renamed into place
    sharded.py   save and load: each rank writes what only it holds, any world size reads it back
    slots.py     what every rank holds of each tensor, and which rank writes each piece
    io.py        the files on disk: format, checksums, atomic writes, finding the damage
    schema.py    what meta.json and each shard must be before anything is built from them
    resume.py    which checkpoint a run resumes from (--resume PATH|auto)
    faults.py    faults injected on purpose, and the collective that hangs found

`python -m minidist.run.checkpoints DIR` says of each checkpoint: intact, or damaged and where.
"""

from minidist.checkpoint.faults import inject_fault
from minidist.checkpoint.io import (CheckpointError, CheckpointPastEndError, Reader, check_step, latest,
                                    list_checkpoints, read_meta, shard_checksums, verify)
from minidist.checkpoint.sharded import NonFiniteCheckpointError, SaveError, load, save
