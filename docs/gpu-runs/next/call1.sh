#!/bin/bash
# The next GPU slot, call 1 of 2 (issue 55): the sampler's decode step, every registered rule's rows.
# Random weights only; carrying .gpu/w (wheels, these scripts, commit.txt). run's timeout_s: 330.
# Each command's budget (`timeout`) is from the 2026-11-28 slot's timings (docs/gpu-runs/README.md,
# "next"): imports and CUDA's start ~18 s a python process; a random 7B built on the card ~10 s; one
# timed repeat of a 7B sampler (16 and 96 new tokens, batch 256) ~2 s; a graph's warm-up 3-4 s.
# The order keeps what every rule reads first: no compile before the rows of the samplers that need
# none; each command writes its JSON after every timed repeat, so a timeout keeps what finished.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/w/*.whl || exit 1
export PYTHONPATH=/tmp/site
T0=$SECONDS
log() { grep -v "Loading weights" | tee -a $OUT/decode.log; }
# 0. the machine, and the read bandwidth once: every row's HBM floor divides by this one figure
#    (budget 25 s: one import, 7 sums of 2 GB)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import sys,torch,transformers;print(sys.version.split()[0], torch.__version__, torch.version.cuda, transformers.__version__, torch.cuda.get_device_name())"
  cat .gpu/w/commit.txt; nproc; } 2>&1 | tee $OUT/machine.txt
BW=$(timeout 25 python3 -m lab.bench_rollout --measure-bandwidth)
echo "read bandwidth: ${BW:-not measured, each command measures its own}${BW:+ GB/s}" | tee -a $OUT/machine.txt
DECODE="python3 -m lab.bench_rollout --decode --eos-tokens 0 ${BW:+--bandwidth $BW}"
# 1. SmolLM2's shape, batch 64: graphed and unfused, nothing compiled (the projections' rule);
#    budget 60 s (2026-11-28: ~3 s of warm-up a sampler, 4 ms steps; the rest the import)
timeout 60 $DECODE --models smollm2-135m --batches 64 --samplers "ours graphed" "ours unfused" \
    --out $OUT/decode_smollm2.json 2>&1 | log
echo "== 1 done at $((SECONDS-T0)) s" | tee -a $OUT/decode.log
# 2. the 7B shape, batch 256: graphed and unfused, then the graphed step's profile (the predictions
#    for sampling by blocks, the norms and rope in fewer kernels); no sync check (a model load more);
#    budget 110 s (2026-11-28: 192 s for four samplers, a failed compile and two profiles)
timeout 110 $DECODE --models qwen2.5-7b --batches 256 --samplers "ours graphed" "ours unfused" \
    --profile qwen2.5-7b:256 --no-sync-check --out $OUT/decode_7b.json 2>&1 | log
echo "== 2 done at $((SECONDS-T0)) s" | tee -a $OUT/decode.log
# 3. the levers that compile, beside the graphed step in the same run (their rules): the regional
#    compiled step (a layer's two regions around attention compiled, reused by every layer) and
#    decode attention over each row's live slots (FlexAttention); the 7B shape first, then
#    SmolLM2's with what is left
#    (budget 120 s; a regional compile is predicted at seconds, not 2026-11-28's 106.5 s)
timeout 120 $DECODE --models qwen2.5-7b --batches 256 --ours-compiled qwen2.5-7b:256 \
    --samplers "ours graphed" "ours compiled" "ours flex" --no-sync-check \
    --out $OUT/decode_7b_levers.json 2>&1 | log
echo "== 3 done at $((SECONDS-T0)) s" | tee -a $OUT/decode.log
LEFT=$((300 - (SECONDS - T0)))
[ $LEFT -ge 45 ] && timeout $LEFT $DECODE --models smollm2-135m --batches 64 \
    --ours-compiled smollm2-135m:64 --samplers "ours graphed" "ours compiled" "ours flex" \
    --out $OUT/decode_smollm2_levers.json 2>&1 | log
echo "== done at $((SECONDS-T0)) s" | tee -a $OUT/decode.log
