"""The memory figures the registration of less recomputation quotes (docs/benchmarks.md, 2026-11-29):
lab/memory_plan.py's trace of the gradient pass at lab/bench_train.py's 1.5B shape (bf16 autocast, its
largest micro-batch: one group of 5 rows of 160 + 1,024 tokens) under each --recompute choice, and the
peak it implies beside the fp32 weights, AdamW's two moments and the gradients, which --parts recompute
holds; and the H200's measured pass of 2026-11-28. Fake tensors: seconds on a CPU.

    python docs/gpu-runs/next/planned_passes.py
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository

import torch  # noqa: E402
from transformers import Qwen2Config  # noqa: E402

import logprobs  # noqa: E402
from lab import memory_plan  # noqa: E402
from lab.bench_train import SHAPES  # noqa: E402
from systems.recompute import CHOICES  # noqa: E402

config = Qwen2Config(**SHAPES["1.5B"], max_position_embeddings=32768, rope_theta=1e6)
prompts = [[10 + p] * 160 for p in range(16) for _ in range(5)]  # bench_train's 16 x 5 rows
largest = max(logprobs.micro_batch_sizes(prompts, 8))  # --micro-batch 8 keeps a group whole
with torch.device("meta"):
    params = sum(p.numel() for p in memory_plan.fake_model(config, torch.float32).parameters())
held = 4 * params * (1 + 2 + 1)  # fp32 weights, AdamW's two moments, the gradients
print(f"{params / 1e9:.3f}B parameters; micro-batch of {largest} rows; held {held / 1e9:.2f} GB")
for choice in CHOICES:
    traced = memory_plan.traced_gradient_pass(config, prompts[:largest], 1024, torch.bfloat16,
                                              choice)
    print(f"{choice:9s} pass {traced / 1e9:6.2f} GB, peak {(held + traced) / 1e9:6.2f} GB")
# the H200's measured pass (2026-11-28): --parts attention's block-mask gradient pass, full recompute,
# its peak less the fp32 weights and gradients it held (no AdamW moments in that part)
measured = json.loads((Path(__file__).resolve().parents[1] / "h200-2026-11-28"
                       / "bench_attention.json").read_text())
peak = measured["parts"]["attention/1.5B"]["block_mask"]["gradient_peak_bytes"]
print(f"H200, 2026-11-28, full: pass {(peak - 4 * params * 2) / 1e9:.2f} GB measured")
