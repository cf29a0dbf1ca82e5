#!/bin/bash
# GPU slot, call 1 of 2: machine, the graph tests, bench_train (precision first). Run from the repo root.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/w/*.whl || exit 1
export PYTHONPATH=/tmp/site
mkdir -p /tmp/keep && cp .gpu/a/gguf.part00 /tmp/keep/ && echo "part00 kept"
T0=$SECONDS
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import sys,torch,transformers;print(sys.version.split()[0], torch.__version__, torch.version.cuda, transformers.__version__, torch.cuda.get_device_name())"
  nproc; } 2>&1 | tee $OUT/machine.txt
timeout 100 python3 -m pytest -q -m gpu tests/test_gpu.py -k "graphed or never_syncs or greedy" 2>&1 | tee $OUT/pytest.log
echo "== pytest done at $((SECONDS-T0)) s"
timeout 60 python3 -m lab.bench_train --parts precision --shapes 1.5B --out $OUT/bench_precision.json 2>&1 | tee $OUT/bench_train.log
echo "== precision done at $((SECONDS-T0)) s" | tee -a $OUT/bench_train.log
timeout 170 python3 -m lab.bench_train --parts train nograd --out $OUT/bench_train.json 2>&1 | tee -a $OUT/bench_train.log
echo "== bench_train done at $((SECONDS-T0)) s" | tee -a $OUT/bench_train.log
