#!/usr/bin/env bash
# Regenerate reports/reference: the reference comparison sweep, its findings and the published copy.
#
#   bash tools/reference_sweep.sh [SWEEP_DIR]        (default runs/reference; resumable: run it again)
#
# One sweep directory grown by three invocations (a sweep directory's axes may grow; the shared
# flags below must stay equal):
#   1. all 10 placement x norm combinations x learning rates 1e-3 and 3e-3, 3 seeds, warm-up 30
#      (60 cells): each placement is compared at its own best rate, chosen on held-out seeds
#   2. the warm-up axis: post and pre, both norms, warm-up 0, 3 seeds, at both rates   (24 cells)
#   3. the depth axis: post, pre and deepnorm (LayerNorm), 8 blocks, 3 seeds, both rates (18 cells)
# Both rates on the two axes: post and deepnorm train only at 1e-3 (their best; at 3e-3 they
# collapse with warm-up too), pre at 3e-3, so each placement's best rate has trained cells in both
# arms of claims 1 (warm-up) and 8 (depth), and each arm is compared at one rate, paired on the seed.
# Default model size (4 blocks, d_model 128, 4 heads, context 128, batch 32); 150 training steps
# instead of 400. Recipes: four W8A8 (static MinMax, ORT dynamic, per-token, per-token after the
# online rotation: claim 13) and weight-only MatMulNBits int8 and int4 at accuracy_level 0 and 4
# (claim 14). Every cell generates (--generation): greedy tokens against FP32's per recipe
# (claims 14 and 15, the generation section), decode speed at batch 1.
set -euo pipefail
out="${1:-runs/reference}"
shared=(--steps 150
        --recipes static-minmax-matmul,dynamic,pertoken-fused,online-rotated-pertoken-fused,wo-int8-b32,wo-int8-b32-acc4,wo-int4-b32,wo-int4-b32-acc4
        --generation --gen-batches 1 --agreement 16,64
        --iters 10 --jobs 2 --out "$out")
quantnorm sweep --seeds 3 --warmups 30 --lrs 0.001,0.003 "${shared[@]}"
quantnorm sweep --placements post,pre --seeds 3 --warmups 0 --lrs 0.001,0.003 "${shared[@]}"
quantnorm sweep --placements post,pre,deepnorm --norms layer --depths 8 --seeds 3 --warmups 30 --lrs 0.001,0.003 "${shared[@]}"
quantnorm findings "$out"
python tools/publish_sweep.py "$out" reports/reference
