#!/bin/bash
# The next GPU slot, call 2 of 2 (issue 35): one training step's phases at the 1.5B and 0.5B shapes as
# train.py now runs them (no-grad passes in bf16x6, CUDA's default since 2026-11-28), for the targets'
# MFU and share; then where one group's gradient pass and no-grad pass spend their time at 1.5B (the
# first profile of the trainer on a GPU: why 16% MFU); then attention by segments against the block
# mask again, its segments now 4-D (a fused SDPA kernel, where the H200 ran 3-D ones on its math
# kernels), in both passes. Random weights; carrying .gpu/w.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/w/*.whl || exit 1
export PYTHONPATH=/tmp/site
T0=$SECONDS
timeout 250 python3 -m lab.bench_train --parts train profile attention --shapes 0.5B 1.5B \
    --out $OUT/bench_train.json 2>&1 | tee $OUT/bench_train.log
echo "== done at $((SECONDS-T0)) s" | tee -a $OUT/bench_train.log
