"""train.py's passes at the default run's shapes on a CPU: attention by sequences
(systems/segment_attention.py: each response with its prompt, batched, plain causal SDPA) against the block
mask (train.py's), and against the 4-D segments it replaced (systems/segment_attention.py at a71dc3a: a
boolean mask a response).

    OMP_NUM_THREADS=1 python studies/sequences-cpu/bench.py > studies/sequences-cpu/output.txt

SmolLM2-135M-Instruct (the embedded model, fp32), 8 arith training prompts x 4 rows, random
40-token responses of which every third ends early, micro-batches of 8 (as segments-cpu/bench.py).
Two passes: the policy's no-grad pass (with the entropy), and the gradient pass (each micro-batch's
log-probs and their backward, activation checkpointing on as in train.py). Process CPU seconds, 6
rounds, the variants' order rotated each round; each round's time over the block mask's in the same
round, their geometric mean and 95% interval (t over the rounds), and the largest log-prob
difference."""
import contextlib
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import data  # noqa: E402
import logprobs  # noqa: E402
from systems import segment_attention  # noqa: E402
from lab.bench_train import micro_batch_starts, set_checkpointing  # noqa: E402
from systems.model import load_model, load_tokenizer  # noqa: E402
from rollout_at import module_at  # noqa: E402

ROUNDS, T_975 = 6, 2.571  # Student's t, 97.5% quantile, 5 degrees of freedom
OLD = module_at("a71dc3a", "segment_attention")
SEQUENCES = (segment_attention.layout, segment_attention.segment_attention)
SEGMENTS = (lambda packs, P, L, device: OLD.layout(packs, P), OLD.segment_attention)
VARIANTS = {"block mask": (False, SEQUENCES), "by sequences": (True, SEQUENCES),
            "by segments, 4-D": (True, SEGMENTS)}


def no_grad_pass(by_segments):
    return logprobs.no_grad_logprobs(model, prompts, responses, mask, 1.0, torch.float32, 8,
                                     entropy=True, by_segments=by_segments)[0]


def gradient_pass(by_segments):
    # by segments around the backward too: activation checkpointing recomputes the forward there
    with segment_attention.attention(model) if by_segments else contextlib.nullcontext():
        for start, size in zip(starts, sizes):
            rows = slice(start, start + size)
            logp, _ = logprobs.token_logprobs(model, prompts[rows], responses[rows], mask[rows],
                                              1.0, torch.float32, by_segments=by_segments)
            logp.sum().backward()
    model.zero_grad(set_to_none=True)

torch.set_num_threads(1)
model = load_model("smollm2-135m", dtype=torch.float32)
set_checkpointing(model, True)
tokenizer = load_tokenizer("smollm2-135m")
prompts = [data.prompt_ids(tokenizer, example)
           for example in data.load_task("arith", split="train")[:8] for _ in range(4)]
responses = torch.randint(10, 40000, (len(prompts), 40), generator=torch.Generator().manual_seed(0))
mask = torch.ones(len(prompts), 40)
for row in range(0, len(prompts), 3):
    mask[row, 20 + row % 17:] = 0
responses = responses * mask.long()
starts, sizes = micro_batch_starts(prompts, 8)
print(f"{len(prompts)} rows, prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
      f"{int(mask.sum())} response tokens, torch {torch.__version__}, {ROUNDS} rounds")
seconds = {(name, part): [] for name in VARIANTS for part in ("no-grad", "gradient")}
logp = {}
for round_ in range(ROUNDS):
    names = list(VARIANTS)[round_ % 3:] + list(VARIANTS)[:round_ % 3]
    for name in names:
        by_segments, functions = VARIANTS[name]
        segment_attention.layout, segment_attention.segment_attention = functions
        started = time.process_time()
        logp[name] = no_grad_pass(by_segments)
        seconds[name, "no-grad"].append(time.process_time() - started)
        started = time.process_time()
        gradient_pass(by_segments)
        seconds[name, "gradient"].append(time.process_time() - started)
    print(f"round {round_ + 1}: " + "; ".join(f"{name} {seconds[name, 'no-grad'][-1]:.2f} + "
                                               f"{seconds[name, 'gradient'][-1]:.2f} s"
                                               for name in VARIANTS), flush=True)

for part in ("no-grad", "gradient"):
    block = seconds["block mask", part]
    for name in VARIANTS:
        logs = [math.log(a / b) for a, b in zip(seconds[name, part], block)]
        mean, error = statistics.mean(logs), statistics.stdev(logs) / math.sqrt(len(logs))
        median = statistics.median(seconds[name, part])
        print(f"{part:8s} pass, {name:17s}: CPU s median {median:.2f}; over the block mask "
              f"{math.exp(mean):.3f}, 95% interval {math.exp(mean - T_975 * error):.3f} to "
              f"{math.exp(mean + T_975 * error):.3f}")
for name in VARIANTS:
    print(f"{name}: largest |log-prob difference| from the block mask "
          f"{(logp[name] - logp['block mask']).abs().max():.1e}")
