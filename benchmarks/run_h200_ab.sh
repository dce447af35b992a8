#!/bin/bash
# The engine-overhead pair (run_h200.sh's benchmarks) for this tree and for an earlier revision's Primus packages,
# one after the other in one call on the lent H200, so a change's effect on the ratios is read side by side.
# Build the earlier revision's wheels here first (pure Python):
#   git worktree add /tmp/old REV && for d in /tmp/old/packages/*/; do pip wheel --no-deps -w .whl_old "$d"; done
# then carry .whl and .whl_old (both ignored by git). Results: $OUT/{new,old}_{torchtitan,megatron}_overhead.json.
set -uo pipefail
source benchmarks/gpu/install.sh || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_old .whl_old/*.whl || exit 1
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
for w in ${@:-torchtitan megatron}; do
  for side in new old; do
    if [ "$side" = old ]; then pp=/tmp/site_old:$PYTHONPATH; else pp=$PYTHONPATH; fi
    PYTHONPATH=$pp python3 "benchmarks/${w}_vs_primus.py" --out "$OUT/${side}_${w}_overhead.json" >"$OUT/${side}_${w}.log" 2>&1
    tail -1 "$OUT/${side}_${w}.log"
  done
done
