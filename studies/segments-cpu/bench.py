"""train.py's no-grad pass at the default run's shapes on a CPU: attention by segments (4-D, as
systems/segment_attention.py had it at a71dc3a; and 3-D, as it was when the H200 measured it) against the
block mask.

    OMP_NUM_THREADS=1 python studies/segments-cpu/bench.py > studies/segments-cpu/output.txt

SmolLM2-135M-Instruct (the embedded model, fp32), 8 arith training prompts x 4 rows, random
40-token responses of which every third ends early, micro-batches of 8, with the entropy (the
policy's pass); process CPU seconds of each pass, 4 rounds, the variants' order rotated each round,
and their median (the mean of the middle two)."""
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import data  # noqa: E402
import logprobs  # noqa: E402
from systems import segment_attention  # noqa: E402
from systems.model import load_model, load_tokenizer  # noqa: E402
from rollout_at import module_at  # noqa: E402

# the 4-D segments this study measured (systems/segment_attention.py batches sequences since)
FOUR_D_MODULE = module_at("a71dc3a", "segment_attention")
FOUR_D = FOUR_D_MODULE.segment_attention
segment_attention.layout = lambda packs, P, L, device: FOUR_D_MODULE.layout(packs, P)


def three_d(module, query, key, value, attention_mask, scaling=None, dropout=0.0, segments=(),
            **kwargs):
    """segment_attention as the H200 ran it: each segment a 3-D (heads, n, d) tensor."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    packs = []
    for j, (start, P, responses) in enumerate(segments):
        q, k, v = query[j], key[j], value[j]
        parts = [v[:, :start], F.scaled_dot_product_attention(
            q[:, start:P], k[:, start:P], v[:, start:P], is_causal=True, scale=scaling)]
        for first, end in responses:
            keys = torch.cat([k[:, start:P], k[:, first:end]], 1)
            values = torch.cat([v[:, start:P], v[:, first:end]], 1)
            mask = torch.ones(end - first, keys.shape[1], dtype=torch.bool).tril(
                keys.shape[1] - (end - first))
            parts.append(F.scaled_dot_product_attention(q[:, first:end], keys, values,
                                                        attn_mask=mask, scale=scaling))
        last = responses[-1][1] if responses else P
        parts.append(v[:, last:])
        packs.append(torch.cat(parts, 1))
    return torch.stack(packs).transpose(1, 2).contiguous(), None


torch.set_num_threads(1)
model = load_model("smollm2-135m", dtype=torch.float32).eval()
tokenizer = load_tokenizer("smollm2-135m")
prompts = [data.prompt_ids(tokenizer, example)
           for example in data.load_task("arith", split="train")[:8] for _ in range(4)]
responses = torch.randint(10, 40000, (len(prompts), 40), generator=torch.Generator().manual_seed(0))
mask = torch.ones(len(prompts), 40)
for row in range(0, len(prompts), 3):
    mask[row, 20 + row % 17:] = 0
responses = responses * mask.long()
print(f"{len(prompts)} rows, prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
      f"{int(mask.sum())} response tokens, torch {torch.__version__}")
variants = {"block mask": (False, FOUR_D), "by segments, 4-D": (True, FOUR_D),
            "by segments, 3-D": (True, three_d)}
seconds, logp = {name: [] for name in variants}, {}
for round_ in range(4):
    names = list(variants)[round_ % 3:] + list(variants)[:round_ % 3]
    for name in names:
        by_segments, function = variants[name]
        segment_attention.segment_attention = function
        started = time.process_time()
        logp[name] = logprobs.no_grad_logprobs(model, prompts, responses, mask, 1.0, torch.float32,
                                               8, entropy=True, by_segments=by_segments)[0]
        seconds[name].append(time.process_time() - started)


def median(times):
    ordered = sorted(times)
    return (ordered[1] + ordered[2]) / 2  # of 4


block = median(seconds["block mask"])
for name, times in seconds.items():
    print(f"{name:17s} CPU s {', '.join(f'{t:.2f}' for t in times)}; median {median(times):.2f} = "
          f"{median(times) / block:.3f} of the block mask's; largest |log-prob difference| "
          f"{(logp[name] - logp['block mask']).abs().max():.1e}")
