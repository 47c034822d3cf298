"""The combining room: where two ideas meet. The idea folders (zero/, muon/, checkpoint/,
memory/, tensor_parallel/, pipeline/, context_parallel/) never import each other; what joins them lives here,
each file under the chapter that teaches the join:

    zero_muon.py      Muon under ZeRO stages 1-3                  chapter 07
    tp_muon.py        Muon on tensor-parallel shards              chapter 10
    mesh.py           the dp x tp mesh and its gradient sync      chapter 10 (cp: 12)
    pipeline_sync.py  a stage's sync over dp and tp, eval, sampling  chapter 11
    plan_mesh.py      the planner on three axes                   chapter 11
    build.py          a run built from all of them: optimizers, gradient sync, the step  chapters 03-12
"""


