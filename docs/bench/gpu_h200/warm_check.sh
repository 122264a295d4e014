#!/usr/bin/env bash
# Device check (not part of the project): cold vs warmed-up resnet_tiny instances on the GPU.
set -u
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p /tmp/site /tmp/dev && tar -xJf .devrun/bundle.tar.xz -C /tmp/dev && cp -r /tmp/dev/site/. /tmp/site/ || exit 3
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .devrun/whl/*.whl || exit 3
export PYTHONPATH=/tmp/site
el "unpacked"
python3 - <<'PY'
import sys, time, torch, numpy as np
sys.path.insert(0, "model_repository/resnet_tiny/1")
import network
t = time.perf_counter(); net = network.build(0, "model_repository/resnet_tiny/1/weights.pt").to("cuda"); torch.cuda.synchronize()
print(f"cold process: build+to(cuda) {1e3*(time.perf_counter()-t):.0f} ms")
for rnd in ("first", "second"):
    out = []
    for b in (1, 2, 4, 8, 16, 32, 3, 5):
        t = time.perf_counter()
        with torch.inference_mode():
            net(torch.from_numpy(np.zeros((b, 3, 32, 32), np.float32)).to("cuda")).float().cpu()
        out.append(f"b{b} {1e3*(time.perf_counter()-t):.1f}")
    print(f"{rnd} pass per batch size (ms): " + ", ".join(out))
PY
for v in off on; do
  rm -rf /tmp/r$v && mkdir -p /tmp/r$v && cp -r model_repository/resnet_tiny /tmp/r$v/ && rm -rf /tmp/r$v/resnet_tiny/1/__pycache__
  sed -i 's/{ count: 1 }/{ count: 1, kind: KIND_GPU }/' /tmp/r$v/resnet_tiny/config.pbtxt
done
echo 'parameters: { key: "warmup_batch_sizes", value: { string_value: "0" } }' >> /tmp/roff/resnet_tiny/config.pbtxt
tail -3 /tmp/roff/resnet_tiny/config.pbtxt
for rep in 1 2; do
  for v in off on; do
    el "rep $rep warm-up $v"
    timeout 80 python3 -m controller sweep --model resnet_tiny --repository /tmp/r$v --scenario scripts/scenarios/gpu_short.yaml \
      --instances 1,4 --delays-us 0 --seconds 3 --warmup-s 0 --sla-ms 40 --out /tmp/sw_${v}_$rep 2>&1 | grep -E "^ +[0-9]+ +0 |wrote|rror"
    cp /tmp/sw_${v}_$rep/sweep.json "${OUT:-/tmp}/sweep_${v}_$rep.json" 2>/dev/null
  done
done
el "done"
