"""Two nodes on one machine: two torchrun launchers, each starting 1 process, meet through
c10d rendezvous on the loopback interface, exactly as two machines would (with the first
machine's address instead of 127.0.0.1), and train a few steps as one world of 2. The same
run is the torchrun path's end-to-end test: rank 0 alone logs, evaluates and writes the
outputs, and lets go of the run's lock (tests/test_faults.py runs `torchrun --standalone`,
with restarts)."""

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
            "--steps", "4", "--warmup-steps", "1", "--eval-interval", "2", "--log-interval", "2",
            "--eval-windows", "2", "--final-eval-windows", "2", "--sample-tokens", "2", "--out-dir", str(tmp_path)]
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
    logs = "".join(o for o, _ in outs)
    assert "2 x cpu (gloo)" in logs and logs.count("final | val loss") == 1  # rank 0 only
    steps = [line for line in logs.splitlines() if line.startswith("step ")]
    assert [line.split("|")[0].split()[1] for line in steps] == ["1/4", "2/4", "4/4"]  # rank 0's, once each
    assert "| val " in steps[1] and "tok/s" in steps[0] and "MFU" in steps[0]
    assert any(line.startswith("final | val loss") and "bits/byte" in line for line in logs.splitlines())
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert rows[-1]["val_bpb"] == summary["val_bpb"] > 0 and summary["world_size"] == 2
    assert summary["ended"] == "completed"
    assert not (tmp_path / "run.lock").exists()  # rank 0 held it, rank 1 did not trip on it; let go
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
