#!/bin/bash
# The next GPU slot, call 1 of 2 (issue 34): random weights only. From the repository's root, carrying
# .gpu/a (the GGUF's first half, kept in /tmp for call 2) and .gpu/w (wheels, these scripts, commit.txt).
# Each decode command writes its JSON after every timed repeat: a timeout keeps what finished.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/w/*.whl || exit 1
export PYTHONPATH=/tmp/site
mkdir -p /tmp/keep && cp .gpu/a/gguf.part00 /tmp/keep/ && echo "part00 kept"
T0=$SECONDS
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import sys,torch,transformers;print(sys.version.split()[0], torch.__version__, torch.version.cuda, transformers.__version__, torch.cuda.get_device_name())"
  cat .gpu/w/commit.txt; nproc; } 2>&1 | tee $OUT/machine.txt
# 1. does torch.compile's fusion close the gap? SmolLM2's shape at batch 64: ours compiled (one compile,
#    symbolic shapes), model.generate's static cache + compile, beside the eager and graphed loops
timeout 190 python3 -m lab.bench_rollout --decode --models smollm2-135m --batches 64 --eos-tokens 0 \
    --budget 140 --out $OUT/decode_compiled.json 2>&1 | grep -v "Loading weights" \
    | tee $OUT/decode_compiled.log
echo "== compiled done at $((SECONDS-T0)) s" | tee -a $OUT/decode_compiled.log
# 2. target 2's shape, the 7B at batch 256 (11.9 ms graphed, 33.9% of the floor): ours compiled, then
#    where its step's time goes (a profile, graphed and eager)
timeout 210 python3 -m lab.bench_rollout --decode --models qwen2.5-7b --batches 256 --eos-tokens 0 \
    --ours-compiled qwen2.5-7b:256 --hf-compiled --profile qwen2.5-7b:256 --budget 150 \
    --out $OUT/decode_7b.json 2>&1 | grep -v "Loading weights" | tee $OUT/decode_7b.log
echo "== 7B done at $((SECONDS-T0)) s" | tee -a $OUT/decode_7b.log
