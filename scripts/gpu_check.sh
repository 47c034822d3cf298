#!/usr/bin/env bash
# One short run on one NVIDIA GPU (an H200 when lent one), for chapter 08
# (chapters/08_at_scale.md): what the CPU machines here cannot measure. Under 8 minutes
# in all; every result goes under $OUT (default ./gpu_out):
#
#   env.txt          (a) torch and CUDA versions, nvidia-smi
#   train/, train.log (c) GPT-2 124M, bf16 autocast, 30 steps on 1 GPU: tokens/s and MFU
#   memory.json      (d) model + gradients + AdamW state of GPT-2 124M (fp32) measured by
#                        the allocator, beside the ZeRO paper's formula, and what ZeRO at
#                        N GPUs would leave per GPU (from the formula: one GPU cannot shard)
#   ns.json          (e) Newton-Schulz (5 steps) TFLOP/s, ours and torch.optim.Muon's, bf16
#   pytest.log       (b) the test suite with the GPU visible; run last, so that a slow
#                        suite cannot starve the measurements above of time
#   summary.txt      one screen of the figures above
#
# Each stage has its own timeout and a failure does not stop the others; status.txt
# holds each stage's exit status (124: timed out). Usage, from the repository root:
#
#   bash scripts/gpu_check.sh
#
# The Python parts run on a CPU too, at toy sizes, which is how they are tested where
# there is no GPU: DEVICE=cpu SMALL=1 SKIP_PYTEST=1 bash scripts/gpu_check.sh
# (PYTEST_ARGS narrows the suite, e.g. PYTEST_ARGS=tests/test_model.py; BUDGET_S moves the
# overall deadline that pytest's timeout is cut from.)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu_out}
DEVICE=${DEVICE:-cuda}
SMALL=${SMALL:-0}
BUDGET_S=${BUDGET_S:-470}  # the whole script; pytest gets what the other stages leave
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export OUT DEVICE SMALL
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # minidist importable without installing
export MINIDIST_DATA=${MINIDIST_DATA:-${TMPDIR:-/tmp}/minidist-gpu-check-data}  # token shards: not in $OUT
: > "$OUT/status.txt"

stage() {  # stage NAME SECONDS COMMAND...: run with a timeout, log, record the exit status
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s) ==="
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 5 "$OUT/$name.log"
  echo "$name $rc" >> "$OUT/status.txt"
}

# (a) the machine ------------------------------------------------------------------
stage nvidia_smi 20 nvidia-smi  # exit status 127 in status.txt: no nvidia-smi here
stage versions 20 python -c "import sys, torch; print('python', sys.version.split()[0], '| torch',
torch.__version__, '| cuda', torch.version.cuda, '| available', torch.cuda.is_available(), '|',
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"
cat "$OUT/versions.log" "$OUT/nvidia_smi.log" > "$OUT/env.txt"

# (c) GPT-2 124M, bf16, one GPU ----------------------------------------------------------
if [ "$SMALL" = 1 ]; then
  MODEL=(--preset tiny --tokenizer gpt2-2048 --batch-size 4 --steps 3 --warmup-steps 1 --log-interval 1)
else
  MODEL=(--preset gpt2 --batch-size 32 --steps 30 --warmup-steps 5 --log-interval 5)
fi
stage train 150 python minidist/train_gpt.py --device "$DEVICE" --precision bf16 "${MODEL[@]}" \
  --eval-interval 1000 --final-eval-windows 16 --sample-tokens 0 --out-dir "$OUT/train"

# (d) memory of model, gradients and AdamW state, against the formula ---------------------
stage memory 45 python - <<'PY'
import json, os
import torch
from minidist.cost_model import activation_bytes, model_state_bytes
from minidist.model import GPT, PRESETS, GPTConfig, config_num_params

dev, small = torch.device(os.environ["DEVICE"]), os.environ["SMALL"] == "1"
cfg = GPTConfig(**PRESETS["tiny"], vocab_size=2048) if small else GPTConfig()  # GPT-2 124M
B, T = (2, cfg.block_size) if small else (8, cfg.block_size)
cuda = dev.type == "cuda"
alloc = (lambda: torch.cuda.memory_allocated(dev)) if cuda else (lambda: None)
nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)
torch.manual_seed(0)
model = GPT(cfg).to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randint(0, cfg.vocab_size, (B, T), device=dev)
out = {"device": str(dev), "psi": config_num_params(cfg), "batch": [B, T]}
for precision in ("fp32", "bf16"):  # bf16 autocast: the activations the formula counts
    for _ in range(2):  # the first step creates AdamW's state; measure the second
        opt.zero_grad(set_to_none=True)
        before = alloc()
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        with torch.autocast(dev.type, torch.bfloat16, enabled=precision == "bf16"):
            loss = model(x, x)[1]
        loss.backward()
        peak = torch.cuda.max_memory_allocated(dev) if cuda else None
        opt.step()
    out[precision] = {"allocated_before_forward": before, "peak_forward_backward": peak,
                      "activations_peak": peak - before if cuda else None}
psi = out["psi"]
out["tensors"] = {"params": nbytes(model.parameters()), "grads": nbytes(p.grad for p in model.parameters()),
                  "adamw_state": nbytes(v for s in opt.state.values() for v in s.values() if v.dim() > 0)}
out["held_after_step"] = alloc()  # parameters + gradients + state, as the allocator sees them
out["formula_fp32_16psi"] = model_state_bytes(psi, 1, 0, k=8, p=4, g=4)  # 4 + 4 + 8 bytes per parameter
out["activations_formula_bf16"] = activation_bytes(cfg, B, T)
out["zero_per_gpu_GB"] = {f"N={n} stage {s}": {"fp32 (K=8)": model_state_bytes(psi, n, s, k=8, p=4, g=4) / 1e9,
                                               "mixed (K=12)": model_state_bytes(psi, n, s) / 1e9}
                          for n in (8, 64, 1024) for s in range(4)}
(__import__("pathlib").Path(os.environ["OUT"]) / "memory.json").write_text(json.dumps(out, indent=1))
held = out["held_after_step"] or sum(out["tensors"].values())
print(f"held {held / 1e9:.3f} GB vs 16 psi = {out['formula_fp32_16psi'] / 1e9:.3f} GB; bf16 activations "
      f"{(out['bf16']['activations_peak'] or 0) / 1e9:.3f} GB measured vs {out['activations_formula_bf16'] / 1e9:.3f} formula")
PY

# (e) Newton-Schulz throughput --------------------------------------------------------------
stage newton_schulz 45 python - <<'PY'
import json, os, statistics, time
import torch
from torch.optim._muon import _zeropower_via_newtonschulz as torch_ns  # torch's, the oracle
from minidist.cost_model import ns_flops
from minidist.muon import newton_schulz

dev, small = torch.device(os.environ["DEVICE"]), os.environ["SMALL"] == "1"
sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
sizes = [(64, 64), (64, 256), (128, 128)] if small else [(768, 768), (768, 3072), (4096, 4096)]

def timed(fn, reps=3 if small else 20):
    fn(), sync()  # warm up
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)

rows = []
for m, n in sizes:
    G = torch.randn(m, n, device=dev)
    t = {"ours_bf16_s": timed(lambda: newton_schulz(G)),
         "torch_bf16_s": timed(lambda: torch_ns(G, (3.4445, -4.7750, 2.0315), 5, 1e-7)),
         "ours_fp32_s": timed(lambda: newton_schulz(G, dtype=torch.float32))}
    rows.append({"m": m, "n": n, **t, **{k.replace("_s", "_TFLOPs"): ns_flops(m, n) / v / 1e12 for k, v in t.items()}})
    print(f"{m} x {n}: ours bf16 {rows[-1]['ours_bf16_TFLOPs']:.1f} TFLOP/s, torch's "
          f"{rows[-1]['torch_bf16_TFLOPs']:.1f}, ours fp32 {rows[-1]['ours_fp32_TFLOPs']:.1f}")
(__import__("pathlib").Path(os.environ["OUT"]) / "ns.json").write_text(json.dumps(rows, indent=1))
PY

# (b) the test suite, with the GPU visible, in the time that is left ----------------------
if [ "${SKIP_PYTEST:-0}" != 1 ]; then
  left=$((BUDGET_S - SECONDS))
  if [ "$left" -gt 30 ]; then
    # shellcheck disable=SC2086  # PYTEST_ARGS (e.g. a test file) splits into words on purpose
    stage pytest "$left" python -m pytest -x -q -p no:cacheprovider ${PYTEST_ARGS:-}
  else
    echo "pytest skipped: ${left}s left" | tee "$OUT/pytest.log"
  fi
fi

# summary -------------------------------------------------------------------------------
python - <<'PY' | tee "$OUT/summary.txt"
import json, os, statistics
from pathlib import Path
out = Path(os.environ["OUT"])
load = lambda p: json.loads(p.read_text()) if p.exists() else None
print("==== gpu_check summary ====")
env = (out / "env.txt").read_text().strip().splitlines() if (out / "env.txt").exists() else []
print(next((l for l in env if l.startswith("python")), "no torch line"))
print("stages (exit status, 124 = timed out):", (out / "status.txt").read_text().replace("\n", "; "))
rows = [json.loads(l) for l in (out / "train/metrics.jsonl").read_text().splitlines()] \
    if (out / "train/metrics.jsonl").exists() else []
steady = [r for r in rows if "tokens_per_s" in r and r["step"] > 1]  # step 1 pays for warm-up
if steady:
    mfu = [r["mfu"] for r in steady if r.get("mfu") is not None]
    val = (load(out / "train/summary.json") or {}).get("val_loss", float("nan"))
    print(f"train: {statistics.median(r['tokens_per_s'] for r in steady):,.0f} tokens/s (median of "
          f"{len(steady)} logs after step 1) | MFU "
          + (f"{100 * statistics.median(mfu):.1f}%" if mfu else "n/a")
          + f" | peak mem {max(r['mem_gb'] for r in steady):.2f} GB | final val loss {val:.4f}")
else:
    print("train: no metrics (see train.log)")
mem = load(out / "memory.json")
if mem:
    held = mem["held_after_step"] or sum(mem["tensors"].values())
    print(f"memory: psi {mem['psi']:,}; params+grads+AdamW held {held / 1e9:.3f} GB vs 16 psi "
          f"{mem['formula_fp32_16psi'] / 1e9:.3f} GB (ratio {held / mem['formula_fp32_16psi']:.3f})")
    act = mem["bf16"]["activations_peak"]
    if act:
        print(f"        bf16 activations, batch {mem['batch']}: {act / 1e9:.3f} GB measured vs "
              f"{mem['activations_formula_bf16'] / 1e9:.3f} GB formula")
    z = mem["zero_per_gpu_GB"]
    print("        ZeRO per GPU, mixed precision (K=12), GB: " + "; ".join(
        f"N={n}: " + "/".join(f"{z[f'N={n} stage {s}']['mixed (K=12)']:.3g}" for s in range(4)) for n in (8, 64, 1024)))
for r in load(out / "ns.json") or []:
    print(f"newton-schulz {r['m']}x{r['n']}: ours bf16 {r['ours_bf16_TFLOPs']:.1f} TFLOP/s "
          f"({1e3 * r['ours_bf16_s']:.2f} ms), torch {r['torch_bf16_TFLOPs']:.1f}, ours fp32 {r['ours_fp32_TFLOPs']:.1f}")
log = out / "pytest.log"
if log.exists():
    tail = [l for l in log.read_text().splitlines() if l.strip()]
    print("pytest:", tail[-1] if tail else "(empty)")
PY
