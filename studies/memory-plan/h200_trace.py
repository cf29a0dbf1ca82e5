"""The plan's traced passes beside the peaks an H200 measured (docs/gpu-runs/h200-2026-11-27,
bench_train.json, the 0.5B part: the first in its process, so no earlier part's leftovers).

It traces the code that ran there (train.py of commit 18d3475, read with `git show`: plain slices
of 8 rows, the logits kept beside their log-softmax) at bench_train's shapes: Qwen2.5-0.5B's config,
16 prompts of 160 tokens x 5 responses of 1,024, micro-batches of 8 rows (the first: 5 rows of one
prompt and 3 of the next, up to 3 prompts' packs in one), each pass's peak the largest over them.
Run from the repository's root: python studies/memory-plan/h200_trace.py
"""
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from lab import memory_plan  # noqa: E402
from lab.bench_train import SHAPES  # noqa: E402

with tempfile.NamedTemporaryFile("w", suffix=".py") as file:
    file.write(subprocess.run(["git", "show", "18d3475:train.py"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout)
    file.flush()
    spec = importlib.util.spec_from_file_location("train_18d3475", file.name)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
memory_plan.logprobs = old  # traced_passes and real_layout read token_logprobs, pack_layout

from transformers import Qwen2Config  # noqa: E402

config = Qwen2Config(**SHAPES["0.5B"], max_position_embeddings=32768, rope_theta=1e6)
batch = [[g + 1] * 160 for g in range(16) for _ in range(5)]  # 16 prompts x 5, groups contiguous
responses, mask = torch.zeros(8, 1024, dtype=torch.long), torch.ones(8, 1024)
peaks = []  # each pass's peak over the micro-batches (plain slices of 8 rows)
for start in range(0, 40, 8):  # the slices' pattern repeats every 40 rows (8 prompts)
    prompts = batch[start:start + 8]
    with memory_plan.real_layout(), FakeTensorMode(allow_non_fake_inputs=True):
        model = memory_plan.fake_model(config, torch.float32)
        with torch.no_grad():
            no_entropy = memory_plan.traced(lambda: old.token_logprobs(
                model, prompts, responses, mask, 1.0, torch.float32))
    nograd, checkpointed = memory_plan.traced_passes(config, prompts, 1024, torch.bfloat16, True)
    _, plain = memory_plan.traced_passes(config, prompts, 1024, torch.bfloat16, False)
    peaks.append((nograd, no_entropy, checkpointed, plain))
nograd, no_entropy, checkpointed, plain = (max(column) for column in zip(*peaks))

# measured: each peak minus the tensors held besides the pass (fp32 weights: 4 B a parameter)
h200 = json.loads((ROOT / "docs/gpu-runs/h200-2026-11-27/bench_train.json").read_text())
part = h200["parts"]["train/0.5B"]
weights = 4 * part["params"]
rows = [("policy's no-grad pass, with the entropy", nograd, part["policy_nograd"]["peak_bytes"],
         2 * weights, "policy and reference"),
        ("reference's no-grad pass", no_entropy, part["reference_nograd"]["peak_bytes"],
         2 * weights, "policy and reference"),
        ("gradient pass, checkpointing on", checkpointed,
         part["update_checkpointing_True"]["peak_bytes"], 2 * weights, "policy and its gradients"),
        ("gradient pass, checkpointing off", plain,
         part["update_checkpointing_False"]["peak_bytes"], 4 * weights,
         "policy, gradients and AdamW's two moments")]
print("| pass (0.5B shape, micro-batches of 8 rows x 1,024 tokens) | traced, GB | H200 peak minus "
      "the weights it held, GB | traced / measured |")
print("|---|---|---|---|")
for name, traced, peak, held, what in rows:
    print(f"| {name} | {traced / 1e9:.2f} | {(peak - held) / 1e9:.2f} ({peak / 1e9:.2f} - {what} "
          f"{held / 1e9:.2f}) | {traced / (peak - held):.2f} |")
