"""A decode step and a prefill timed apart, rollout.py at b17f244 against the working tree's,
alternated, one thread, SmolLM2 in fp32 (the compaction loop's `decode` and `prefilled`, as a CPU
samples):

    OMP_NUM_THREADS=1 python studies/norms-rope-cpu/steps.py > studies/norms-rope-cpu/steps.txt
"""
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "studies")]
from systems.model import load_model  # noqa: E402
from rollout_at import rollout_at  # noqa: E402

before = rollout_at("b17f244")
# the change as its review reran it: the working tree's rollout.py has since become the reader's
# (one loop; the step's fewer kernels moved to systems/cuda_decode.py, issue 54)
after = rollout_at("333a2b0")

torch.set_num_threads(1)
model = load_model("smollm2-135m", dtype=torch.float32).eval()
prompts = [[1 + (row * 7 + j) % 400 for j in range(150 + row)] for row in range(32)]
steps, prefills = {"before": [], "after": []}, {"before": [], "after": []}
with torch.no_grad():
    for round_ in range(6):
        for name in (("before", "after") if round_ % 2 == 0 else ("after", "before")):
            module = before if name == "before" else after
            start = time.process_time()
            module.prefilled(model, prompts[::4], 40)  # 8 prompts of 150 to 178 tokens
            prefills[name].append(time.process_time() - start)
            cache, logits, _ = module.prefilled(model, prompts, 40)
            tokens = logits.argmax(-1)
            start = time.process_time()
            for _ in range(20):
                tokens = module.decode(model, tokens, cache).argmax(-1)
            steps[name].append((time.process_time() - start) / 20)
for name in ("before", "after"):
    step_ms = " ".join(f"{1e3 * s:.1f}" for s in steps[name])
    print(f"{name}: a decode step of 32 rows (ms) {step_ms},"
          f" median {1e3 * statistics.median(steps[name]):.1f}; a prefill of 8 prompts (s) "
          f"{' '.join(f'{s:.2f}' for s in prefills[name])}, median "
          f"{statistics.median(prefills[name]):.2f}")
