#!/bin/bash
# The slot of 2026-11-28, call 3 (issue 34), on a fresh machine: "ours compiled" again. In calls 1 and 2
# Inductor failed on the sampler's cumsum fused with its softmax (pytorch#180221); rollout.compiled_step
# now compiles the model's part only and leaves sampling eager. Random weights (SmolLM2's shape without
# its file); only ours graphed and ours compiled (--samplers), 7B first (target 2's shape).
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/w/*.whl || exit 1
export PYTHONPATH=/tmp/site
T0=$SECONDS
cat .gpu/w/commit.txt | tee $OUT/machine3.txt
timeout 135 python3 -m lab.bench_rollout --decode --models qwen2.5-7b --batches 256 --eos-tokens 0 \
    --ours-compiled qwen2.5-7b:256 --hf-compiled --samplers "ours graphed" "ours compiled" --budget 110 \
    --out $OUT/decode_7b_compiled.json 2>&1 | grep -v "Loading weights" | tee $OUT/decode_compiled3.log
echo "== 7B done at $((SECONDS-T0)) s" | tee -a $OUT/decode_compiled3.log
LEFT=$((185 - (SECONDS - T0)))
[ $LEFT -ge 40 ] && timeout $LEFT python3 -m lab.bench_rollout --decode --models smollm2-135m --batches 64 \
    --eos-tokens 0 --ours-compiled smollm2-135m:64 --hf-compiled --samplers "ours graphed" "ours compiled" \
    --budget $((LEFT - 30)) --out $OUT/decode_smollm2_compiled.json 2>&1 | grep -v "Loading weights" \
    | tee -a $OUT/decode_compiled3.log
echo "== done at $((SECONDS-T0)) s" | tee -a $OUT/decode_compiled3.log
