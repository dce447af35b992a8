#!/bin/bash
# FP8 dense on one GPU, compiled, both engines: Llama 3.2 1B and 4 layers of Llama 3.1 8B at seq 4096 x 2,
# bf16 against kernels.fp8=rowwise / tensorwise (every linear in FP8: what core's rule decides from is measured here).
#   bash benchmarks/fp8_dense_probe.sh OUTDIR
out=${1:?out dir}; mkdir -p "$out"
run() {  # name preset overrides...
  local name=$1 preset=$2; shift 2
  timeout 150 python3 -m primus.core.cli train "$preset" train.seq_len=4096 train.micro_batch_size=2 train.steps=12 \
    data.source=mock checkpoint.enabled=false logging.interval=1 logging.tensorboard=false logging.progress=false \
    train.precision=bf16 train.compile=true "$@" "logging.output_dir=$out/$name" > "$out/$name.log" 2>&1
  echo "$name rc=$? $(python3 -c "import json,statistics,sys; r=[json.loads(l) for l in open('$out/$name/metrics.jsonl')]; s=[x for x in r if x['step']>4]; print(round(statistics.median(x['tokens_per_s_per_device'] for x in s)), 'tok/s', [round(x['loss'],4) for x in r][-3:], 'peak', max(x['memory_gib'] for x in r))" 2>&1 | tail -1)"
}
for engine in ${ENGINES:-torchtitan megatron}; do
  for m in "1b llama3.2-1b" "8b4l llama3.1-8b model.num_layers=4"; do
    set -- $m; tag=$1; shift
    run "$engine-$tag-bf16" "$@" backend.name=$engine
    run "$engine-$tag-fp8row" "$@" backend.name=$engine kernels.fp8=rowwise
    run "$engine-$tag-fp8tw" "$@" backend.name=$engine kernels.fp8=tensorwise
  done
done
