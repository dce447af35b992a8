#!/bin/bash
# Does `kernels.fp8=rowwise` change a megatron MoE run whose FP8 rules put nothing in FP8 (Qwen3-30B-A3B's linears
# are under core's bound, its experts stay bf16)? Two bf16 runs (the engine's own run-to-run spread) and one FP8 run,
# 3 steps each from the same seed: losses and gradient norms at full precision, and the logs' differences.
#   bash benchmarks/fp8_auto_vs_bf16_losses.sh OUT_DIR [LAYERS]
out=${1:?out dir}; layers=${2:-2}
mkdir -p "$out"
for case in bf16_a bf16_b fp8_auto; do
  extra=(); [ "$case" = fp8_auto ] && extra=(kernels.fp8=rowwise)
  python3 -m primus.core.cli.app train qwen3-30b-a3b model.num_layers="$layers" backend.name=megatron \
    model.moe.balancing=none train.init=engine train.precision=bf16 train.seq_len=4096 train.micro_batch_size=1 \
    train.steps=3 data.source=mock checkpoint.enabled=false logging.interval=1 logging.tensorboard=false \
    logging.progress=false logging.output_dir="$out/$case" "${extra[@]}" > "$out/$case.log" 2>&1
  python3 -c "import json,sys; rows=[json.loads(l) for l in open(sys.argv[1])]; print(sys.argv[2], [(r['loss'], r.get('grad_norm')) for r in rows])" "$out/$case/metrics.jsonl" "$case"
done
diff <(grep -v "tok/s\|step \|INFO.*took\|->" "$out/bf16_a.log") <(grep -v "tok/s\|step \|INFO.*took\|->" "$out/fp8_auto.log") | head -40
