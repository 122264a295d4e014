#!/usr/bin/env bash
# GPU path: the real torch model (resnet_tiny) on KIND_GPU instances, NVML signals, a short bench.
#   scripts/gpu_bench.sh [OUT_DIR]      (default results/gpu; under 10 minutes)
#
# NOT RUN IN THIS PROJECT'S CI OR ON ITS DEVELOPMENT MACHINE: they have no GPU. Written to be run on a
# Linux host with an NVIDIA GPU and driver, a Python environment with this package installed
# (`pip install -e .`, a CUDA build of torch, nvidia-pytriton or a `tritonserver` on PATH, e.g. inside the
# NGC container), and nothing else listening on the chosen ports (they are picked free at run time).
#
# Steps:
#  1. copy the model repository to a temporary folder and pin resnet_tiny's instances to KIND_GPU
#     (the shipped config leaves `kind` out, which Triton already turns into KIND_GPU on a GPU host;
#     pinning it makes a silent CPU fallback impossible: the load fails instead);
#  2. check NVML sees a device (the controller runs with `gpu: nvml`, so no NVML = no bench);
#  3. sweep instances 1,2,4 x max_queue_delay_us 0,2000 at the scenario's levels (about 1.5 minutes);
#  4. bench default / best_static / oracle / adaptive over scripts/scenarios/gpu_short.yaml (80 s of
#     traffic per arm, about 6-7 minutes with server starts) and print the same summary table
#     (on one H200 with 16 cores, steps 2-4 took 486 s: docs/bench/gpu_h200/);
#  5. only where NVML sees 2 or more GPUs (TWO_GPUS=0 skips it): the adaptive arm again with resnet_tiny on
#     GPUs 0 and 1 (`{ count: 1, kind: KIND_GPU, gpus: [ 0, 1 ] }`: one instance on each), up to 6 instances,
#     into OUT_DIR/two_gpus, then print where the instances went (the decision log's per-device placement;
#     about 2 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${1:-results/gpu}
SCENARIO=scripts/scenarios/gpu_short.yaml
SLA_MS=${SLA_MS:-40}

command -v nvidia-smi >/dev/null || { echo "gpu_bench.sh: nvidia-smi not found: this script needs an NVIDIA GPU host" >&2; exit 2; }
"$PY" - <<'PYEOF' || { echo "gpu_bench.sh: NVML cannot see a GPU (pip install nvidia-ml-py; check the driver)" >&2; exit 2; }
import pynvml
pynvml.nvmlInit()
n = pynvml.nvmlDeviceGetCount()
assert n > 0
h = pynvml.nvmlDeviceGetHandleByIndex(0)
name = pynvml.nvmlDeviceGetName(h)
try:
    driver = pynvml.nvmlSystemGetDriverVersion()
except pynvml.NVMLError as e:   # shown only: not a reason to stop
    driver = f"unknown ({e})"
print(f"NVML: {n} device(s); device 0 is {name.decode() if isinstance(name, bytes) else name}, "
      f"driver {driver.decode() if isinstance(driver, bytes) else driver}")
PYEOF
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { echo "gpu_bench.sh: torch has no CUDA here; install a CUDA build of torch" >&2; exit 2; }
"$PY" -c "import sys, torch; print(f'python {sys.version.split()[0]}, torch {torch.__version__}, {torch.cuda.get_device_name(0)}')"

REPO=$(mktemp -d /tmp/gpu-bench-repo.XXXXXX)
trap 'rm -rf "$REPO"' EXIT
cp -r model_repository/resnet_tiny "$REPO/"
rm -rf "$REPO"/resnet_tiny/1/__pycache__
# `{ count: 1 }` -> `{ count: 1, kind: KIND_GPU }` (fail loudly if the shipped config changed shape)
sed -i 's/{ count: 1 }/{ count: 1, kind: KIND_GPU }/' "$REPO/resnet_tiny/config.pbtxt"
grep -q "KIND_GPU" "$REPO/resnet_tiny/config.pbtxt" \
    || { echo "gpu_bench.sh: could not set KIND_GPU in resnet_tiny's config.pbtxt (instance_group changed?)" >&2; exit 1; }

mkdir -p "$OUT"
"$PY" -m controller sweep --model resnet_tiny --repository "$REPO" --scenario "$SCENARIO" \
    --instances 1,2,4 --delays-us 0,2000 --seconds 3 --sla-ms "$SLA_MS" --out "$OUT"
"$PY" -m controller bench --model resnet_tiny --repository "$REPO" --scenario "$SCENARIO" \
    --sweep "$OUT/sweep.json" --sla-ms "$SLA_MS" --controller-gpu nvml --max-instances 4 --out "$OUT"

NGPU=$("$PY" -c "import pynvml; pynvml.nvmlInit(); print(pynvml.nvmlDeviceGetCount())")
if [ "${TWO_GPUS:-1}" != "0" ] && [ "$NGPU" -ge 2 ]; then
    REPO2=$(mktemp -d /tmp/gpu-bench-repo2.XXXXXX)
    trap 'rm -rf "$REPO" "$REPO2"' EXIT
    cp -r "$REPO/resnet_tiny" "$REPO2/"
    sed -i 's/{ count: 1, kind: KIND_GPU }/{ count: 1, kind: KIND_GPU, gpus: [ 0, 1 ] }/' "$REPO2/resnet_tiny/config.pbtxt"
    grep -q "gpus: \[ 0, 1 \]" "$REPO2/resnet_tiny/config.pbtxt" \
        || { echo "gpu_bench.sh: could not place resnet_tiny on GPUs 0 and 1" >&2; exit 1; }
    "$PY" -m controller bench --model resnet_tiny --repository "$REPO2" --scenario "$SCENARIO" --arms adaptive \
        --sweep "$OUT/sweep.json" --sla-ms "$SLA_MS" --controller-gpu nvml --max-instances 6 --out "$OUT/two_gpus"
    "$PY" - "$OUT/two_gpus" <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
records = [json.loads(line) for line in (out / "adaptive_decisions.jsonl").read_text().splitlines() if line.strip()]
placed = [r["per_device"] for r in records if r.get("per_device")]
applied = [(r["reason"], r["target"]) for r in records if r["action"] == "applied"]
print(f"two GPUs: {len(applied)} change(s) applied: {applied}")
print(f"two GPUs: placements seen: {sorted({json.dumps(p, sort_keys=True) for p in placed})}")
print(f"two GPUs: last placement {placed[-1] if placed else 'none recorded'}")
PYEOF
else
    echo "gpu_bench.sh: $NGPU GPU(s): the two-GPU part is skipped"
fi
