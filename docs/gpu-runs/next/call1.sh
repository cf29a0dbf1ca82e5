#!/bin/bash
# The next GPU slot, call 1 of 2 (issue 34): random weights only. From the repository's root, carrying
# .gpu/a (the GGUF's first half, kept in /tmp for call 2) and .gpu/w (wheels, these scripts).
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/w/*.whl || exit 1
export PYTHONPATH=/tmp/site
mkdir -p /tmp/keep && cp .gpu/a/gguf.part00 /tmp/keep/ && echo "part00 kept"
T0=$SECONDS
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import sys,torch,transformers;print(sys.version.split()[0], torch.__version__, torch.version.cuda, transformers.__version__, torch.cuda.get_device_name())"
  git log -1 --format=%h; nproc; } 2>&1 | tee $OUT/machine.txt
# 1. does torch.compile's fusion close the gap? SmolLM2's shape at batch 64: ours compiled, hf static+compile
timeout 150 python3 -m lab.bench_rollout --decode --models smollm2-135m --batches 64 --budget 110 \
    --out $OUT/decode_compiled.json 2>&1 | grep -v "Loading weights" | tee $OUT/decode_compiled.log
echo "== compiled done at $((SECONDS-T0)) s" | tee -a $OUT/decode_compiled.log
# 2. the 7B row at batch 64 (not compiled), then where the 7B step's 11.9 ms at batch 256 go (a profile)
timeout 110 python3 -m lab.bench_rollout --decode --models qwen2.5-7b --batches 64 --hf-compiled \
    --ours-compiled --profile qwen2.5-7b:256 --budget 70 --out $OUT/decode_7b.json 2>&1 \
    | grep -v "Loading weights" | tee $OUT/decode_7b.log
echo "== 7B done at $((SECONDS-T0)) s" | tee -a $OUT/decode_7b.log
