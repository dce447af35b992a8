#!/bin/bash
# One call on the lent H200: install the carried wheels (.whl, see ../README.md "GPU benchmarks"), then run the
# engine-overhead benchmarks, each comparing Primus with the plain engine side by side in one process.
# Results and logs land in $OUT (the device tool brings them back) and are committed under benchmarks/results/.
set -uo pipefail
source benchmarks/gpu/install.sh || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
for which in "${@:-torchtitan megatron}"; do
  for w in $which; do
    python3 "benchmarks/${w}_vs_primus.py" --out "$OUT/${w}_overhead.json" 2>&1 | tee "$OUT/${w}.log"
  done
done
