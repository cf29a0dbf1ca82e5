#!/bin/bash
# The next GPU slot, call 2 of 2 (issue 55): the trainer's rules and targets at the 1.5B shape, then the
# checks registered before. Random weights; carrying .gpu/w (wheels, these scripts, commit.txt, the
# embedded model's config and tokenizer in .gpu/w/smollm2). run's timeout_s: 320.
# Budgets from the 2026-11-28 slot (docs/gpu-runs/README.md, "next"): pytest's start and CUDA ~15 s;
# --parts attention at 1.5B 47 s, --parts precision (two passes) 28 s, lab.memory_plan --measure 68 s.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/w/*.whl || exit 1
export PYTHONPATH=/tmp/site
T0=$SECONDS
# 1. the GPU tests the rules and registered checks read (budget 75 s): the compiled sampler compiles
#    once in a train.py-shaped run (Inductor, graphs), flex decode follows the model and never
#    syncs, the step's norms run the fused kernel, a second generate holds no more memory
timeout 75 python3 -m pytest -q -m gpu tests/test_gpu.py \
    -k "compiles_once or flex or fused_kernel or second_generate" 2>&1 | tail -15 | tee $OUT/gpu_tests.log
echo "== 1 done at $((SECONDS-T0)) s" | tee -a $OUT/gpu_tests.log
# 2. one training step's phases at the 1.5B shape (targets 1 and 3), attention by sequences against
#    the block mask in both passes (its rule), the gradient pass under --recompute full, selective
#    and none (its rule); the JSON keeps each finished part (budget 170 s: train ~60, attention 47,
#    recompute ~45 by the 2026-11-27/28 pass times)
timeout 170 python3 -m lab.bench_train --parts train attention recompute --shapes 1.5B \
    --out $OUT/bench_train.json 2>&1 | tee $OUT/bench_train.log
echo "== 2 done at $((SECONDS-T0)) s" | tee -a $OUT/bench_train.log
# 3. with what is left: the memory plan against train.py's CUDA peaks (docs/gpu.md's registered
#    check of cuBLAS's workspaces), on random weights of SmolLM2's shape
LEFT=$((300 - (SECONDS - T0)))
if [ $LEFT -ge 60 ]; then
  timeout 30 python3 -c "
import transformers as t
config = t.AutoConfig.from_pretrained('.gpu/w/smollm2')
t.AutoModelForCausalLM.from_config(config).save_pretrained('/tmp/smollm2-random')" \
      && cp .gpu/w/smollm2/* /tmp/smollm2-random/
  GPU_GB=$(python3 -c "import torch; print(torch.cuda.get_device_properties(0).total_memory / 1e9)")
  timeout $((LEFT - 20)) python3 -m lab.memory_plan --measure --gpu-gb "$GPU_GB" \
      --json $OUT/memory_plan.json -- --model /tmp/smollm2-random --kl k1 --place reward \
      --max-new-tokens 512 --prompts-per-step 16 --logprob-dtype float32 2>&1 \
      | grep -v "Loading weights\|Writing model" | tee $OUT/memory_plan.log
else
  echo "memory plan skipped: $LEFT s left" | tee $OUT/memory_plan.log
fi
echo "== done at $((SECONDS-T0)) s" | tee -a $OUT/bench_train.log
