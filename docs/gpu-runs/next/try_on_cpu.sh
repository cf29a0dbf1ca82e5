#!/bin/bash
# Try one of this folder's calls on a CPU at tiny shapes before the slot (issue 55, item 4):
#   bash docs/gpu-runs/next/try_on_cpu.sh docs/gpu-runs/next/call1.sh /tmp/try1
# run from the repository's root. The call's models become the tiny shape at batch 4 (SmolLM2's
# config and tokenizer from the embedded model's cache), its commands get --allow-cpu, the samplers
# a CPU has no graph for their CPU stand-ins ("ours graphed" -> "ours eager", "ours unfused" ->
# "ours plain"); the wheels' install and nvidia-smi are left out. Each command keeps its timeout,
# so a command that overruns here shows as a cut log; the "== N done at" lines give the seconds.
set -u
call=$1
export OUT=${2:-/tmp/gpu-try}
rm -rf "$OUT" && mkdir -p "$OUT" .gpu/w
git rev-parse --short HEAD > .gpu/w/commit.txt
mkdir -p .gpu/w/smollm2 && (cd "$(python -c 'from systems import model; print(model.cache_dir())')/smollm2-135m-instruct" \
    && cp chat_template.jinja config.json generation_config.json tokenizer*.json "$OLDPWD/.gpu/w/smollm2/")
sed -e '/pip install/d; /^export PYTHONPATH/d; s/^{ nvidia-smi.*$/{ true/' \
    -e 's/python3/python/g' \
    -e 's/--models smollm2-135m/--models tiny/g; s/--models qwen2\.5-7b/--models tiny/g' \
    -e 's/\(smollm2-135m\|qwen2\.5-7b\):[0-9]*/tiny:4/g; s/--batches [0-9]*/--batches 4/g' \
    -e 's/--decode /--decode --allow-cpu /; s/--measure-bandwidth/--measure-bandwidth --allow-cpu/' \
    -e 's/"ours graphed"/"ours eager"/g; s/"ours unfused"/"ours plain"/g' \
    -e 's/--shapes 1\.5B/--shapes tiny --allow-cpu --prompts 4 --response-tokens 256/' \
    -e 's/tests\/test_gpu.py/tests\/test_gpu.py -rs/' \
    -e 's/--gpu-gb "$GPU_GB"/--gpu-gb 80/; s/^  GPU_GB=.*$//' \
    -e 's/--max-new-tokens 512 --prompts-per-step 16/--max-new-tokens 8 --prompts-per-step 2/' \
    "$call" > "$OUT/call-on-cpu.sh"
time bash "$OUT/call-on-cpu.sh"
