#!/bin/bash
# The next GPU slot, call 1 of 2 (issue 34): our step compiled (cuda_decode.compiled_step: the model's part,
# sampling eager), timed beside the graphed step at target 2's shape (the 7B at batch 256: 106.5 s of
# compile and capture on an H200 on 2026-11-28, then cut by its timeout) and at SmolLM2's shape, batch 64;
# and the graphed step with its projections joined (cuda_decode.fuse_projections, as train.py's sampler has
# them since 2026-11-28) beside the same step unfused: the registered rule of docs/benchmarks.md decides
# whether the sampler keeps them joined; the profile reads the registered predictions for sampling by
# blocks and for the norms and rope in fewer kernels; compiled against graphed decides train.py's
# --compile-sampler default (the rule registered there). Random weights only; carrying .gpu/w (wheels,
# these scripts, commit.txt). Each decode command writes its JSON after every timed repeat: a timeout
# keeps what finished.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/w/*.whl || exit 1
export PYTHONPATH=/tmp/site
T0=$SECONDS
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import sys,torch,transformers;print(sys.version.split()[0], torch.__version__, torch.version.cuda, transformers.__version__, torch.cuda.get_device_name())"
  cat .gpu/w/commit.txt; nproc; } 2>&1 | tee $OUT/machine.txt
timeout 230 python3 -m lab.bench_rollout --decode --models qwen2.5-7b --batches 256 --eos-tokens 0 \
    --ours-compiled qwen2.5-7b:256 --hf-compiled \
    --samplers "ours graphed" "ours unfused" "ours compiled" \
    --profile qwen2.5-7b:256 --budget 200 --out $OUT/decode_7b_compiled.json 2>&1 \
    | grep -v "Loading weights" | tee $OUT/decode_compiled.log
echo "== 7B done at $((SECONDS-T0)) s" | tee -a $OUT/decode_compiled.log
timeout 110 python3 -m lab.bench_rollout --decode --models smollm2-135m --batches 64 --eos-tokens 0 \
    --ours-compiled smollm2-135m:64 --hf-compiled \
    --samplers "ours graphed" "ours unfused" "ours compiled" \
    --budget 85 --out $OUT/decode_smollm2_compiled.json 2>&1 | grep -v "Loading weights" \
    | tee -a $OUT/decode_compiled.log
echo "== done at $((SECONDS-T0)) s" | tee -a $OUT/decode_compiled.log
