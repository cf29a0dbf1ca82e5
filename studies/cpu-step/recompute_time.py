"""One micro-batch's gradient pass of the default run's shape under each --recompute choice, timed
(docs/benchmarks.md, "The default step on a 2-core AVX2 CPU"): SmolLM2-135M in fp32, two groups of 4
rows (prompts of 172 tokens, responses of 23 tokens in a 40-token mask), logprobs.token_logprobs
forward then backward, three repeats each.

    PYTHONPATH=. python studies/cpu-step/recompute_time.py full    # then selective, none
"""
import sys
import time

import torch

import logprobs
from systems import runtime
from systems.model import load_model

choice = sys.argv[1]
model = load_model("smollm2-135m", torch.float32, False)
runtime.checkpoint_activations(model, choice)
torch.manual_seed(0)
prompts = [[1] + [5] * 171] * 4 + [[1] + [6] * 171] * 4
responses = torch.randint(0, 49000, (8, 40))
mask = torch.ones(8, 40)
mask[:, 23:] = 0
for _ in range(3):
    start = time.perf_counter()
    logp, _ = logprobs.token_logprobs(model, prompts, responses, mask, 1.0, torch.float32)
    middle = time.perf_counter()
    logp.sum().backward()
    end = time.perf_counter()
    model.zero_grad(set_to_none=True)
    print(f"{choice}: forward {middle - start:.2f} s, backward {end - middle:.2f} s")
