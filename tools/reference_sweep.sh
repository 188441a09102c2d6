#!/usr/bin/env bash
# Regenerate reports/reference: the reference comparison sweep, its findings and the published copy.
#
#   bash tools/reference_sweep.sh [SWEEP_DIR]        (default runs/reference; resumable: run it again)
#
# One sweep directory grown by three invocations (a sweep directory's axes may grow; the shared
# flags below must stay equal):
#   1. all 10 placement x norm combinations x learning rates 1e-3 and 3e-3, 3 seeds, warm-up 30
#      (60 cells): each placement is compared at its own best rate, chosen on held-out seeds
#   2. the warm-up axis: post and pre, both norms, lr 3e-3, 3 seeds, warm-up 0            (12 cells)
#   3. the depth axis: post, pre and deepnorm (LayerNorm), lr 3e-3, 3 seeds, 8 blocks       (9 cells)
# Default model size (4 blocks, d_model 128, 4 heads, context 128, batch 32); 150 training steps
# instead of 400 and four INT8 recipes (static MinMax, ORT dynamic, per-token, per-token after the
# online rotation: claim 13), so that the 81 cells fit about 90-100 minutes of a 2-core machine
# (two cells at a time, one thread each).
set -euo pipefail
out="${1:-runs/reference}"
shared=(--steps 150 --recipes static-minmax-matmul,dynamic,pertoken-fused,online-rotated-pertoken-fused
        --iters 10 --jobs 2 --out "$out")
quantnorm sweep --seeds 3 --warmups 30 --lrs 0.001,0.003 "${shared[@]}"
quantnorm sweep --placements post,pre --seeds 3 --warmups 0 --lrs 0.003 "${shared[@]}"
quantnorm sweep --placements post,pre,deepnorm --norms layer --depths 8 --seeds 3 --warmups 30 --lrs 0.003 "${shared[@]}"
quantnorm findings "$out"
python tools/publish_sweep.py "$out" reports/reference
