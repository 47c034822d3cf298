"""Two nodes on one machine: two torchrun launchers, each starting 1 process, meet through
c10d rendezvous on the loopback interface, exactly as two machines would (with the first
machine's address instead of 127.0.0.1), and train a few steps as one world of 2."""

import json
import os
import socket
import subprocess
import sys

from conftest import ROOT


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_train_together(tmp_path):
    port = _free_port()
    args = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--seq-len", "16", "--batch-size", "4",
            "--steps", "3", "--warmup-steps", "1", "--eval-interval", "100", "--final-eval-windows", "2",
            "--sample-tokens", "2", "--out-dir", str(tmp_path)]
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
         f"--node_rank={n}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
         "--rdzv-id=minidist-test", "minidist/train_gpt.py", *args],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"}) for n in (0, 1)]
    outs = []
    for p in nodes:
        try:
            outs.append(p.communicate(timeout=240))
        finally:
            p.kill()
    assert all(p.returncode == 0 for p in nodes), outs
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2
    logs = "".join(o for o, _ in outs)
    assert "2 x cpu (gloo)" in logs and logs.count("final | val loss") == 1  # rank 0 only
