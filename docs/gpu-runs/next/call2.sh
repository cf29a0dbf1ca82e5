#!/bin/bash
# The next GPU slot, call 2 of 2 (issue 35). First the registered check of docs/gpu.md's cuBLAS
# workspaces (2026-11-28): the GPU test that a second generate holds no more memory (and that the
# step's norms run the fused RMSNorm kernel, registered in docs/benchmarks.md), then the memory
# plan beside train.py's CUDA peaks, the run of 33b65db again (its flags, its prompts, fp32 no-grad
# passes) on random weights of SmolLM2's shape (the embedded model's config and tokenizer, carried
# in .gpu/w/smollm2). Then one training step's phases at the 1.5B and 0.5B shapes as train.py now runs
# them (no-grad passes in bf16x6), for the targets' MFU and share; where one group's gradient pass and
# no-grad pass spend their time at 1.5B (the first profile of the trainer on a GPU: why 12.8% MFU); and
# attention by segments against the block mask, each response now its own causal sequence (SDPA's
# flash kernel in bf16, no mask; the H200 ran 3-D segments on its math kernels), in both passes: the
# rule registered in docs/benchmarks.md decides train.py's attention on CUDA. Carrying .gpu/w.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/w/*.whl || exit 1
export PYTHONPATH=/tmp/site
T0=$SECONDS
# 1. the workspaces: the GPU test, then the plan against the measured peaks
timeout 40 python3 -m pytest -q -m gpu tests/test_gpu.py -k "second_generate or fused_kernel" 2>&1 | tail -3 \
    | tee $OUT/memory_plan.log
timeout 30 python3 -c "
import transformers as t
config = t.AutoConfig.from_pretrained('.gpu/w/smollm2')
t.AutoModelForCausalLM.from_config(config).save_pretrained('/tmp/smollm2-random')" \
    && cp .gpu/w/smollm2/* /tmp/smollm2-random/
GPU_GB=$(python3 -c "import torch; print(torch.cuda.get_device_properties(0).total_memory / 1e9)")
timeout 100 python3 -m lab.memory_plan --measure --gpu-gb "$GPU_GB" --json $OUT/memory_plan.json -- \
    --model /tmp/smollm2-random --kl k1 --place reward --max-new-tokens 512 --prompts-per-step 16 \
    --logprob-dtype float32 2>&1 | grep -v "Loading weights\|Writing model" | tee -a $OUT/memory_plan.log
echo "== memory done at $((SECONDS-T0)) s" | tee -a $OUT/memory_plan.log
# 2. the trainer's phases, its profile, attention by segments (random weights)
timeout 250 python3 -m lab.bench_train --parts train profile attention --shapes 0.5B 1.5B \
    --out $OUT/bench_train.json 2>&1 | tee $OUT/bench_train.log
echo "== done at $((SECONDS-T0)) s" | tee -a $OUT/bench_train.log
