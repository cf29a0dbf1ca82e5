"""The same samples: the fixed-shape loop of rollout.py at a commit (`--before`, main's
`generate(static=True)`) against the working tree's `generate`, on the embedded SmolLM2 in fp32 on
a CPU: tokens, log-probs and response masks compared bit for bit (torch.equal), for a few seeds,
temperatures, top-p values and prompt sets (arith's training prompts x 4, and a mixed set of 6
prompts of different lengths, one a duplicate).

    OMP_NUM_THREADS=1 python studies/one-loop-cpu/same_samples.py \
        > studies/one-loop-cpu/same-samples.txt
    (--record FILE saves the before side's samples; --against FILE compares with a saved record)
"""
import argparse
import inspect
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "studies")]
import data  # noqa: E402
from systems.model import load_model, load_tokenizer, stop_token_ids  # noqa: E402
from rollout_at import rollout_at  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--before", default="e65e46a",
                    help="the commit whose static loop is the reference")
parser.add_argument("--record", default=None, help="only save the before side's samples here")
parser.add_argument("--against", default=None, help="compare with samples saved by --record")
args = parser.parse_args()

torch.set_num_threads(1)
model = load_model("smollm2-135m", dtype=torch.float32).eval()
tokenizer = load_tokenizer("smollm2-135m")
eos = stop_token_ids(model, tokenizer)
arith = [data.prompt_ids(tokenizer, example)
         for example in data.load_task("arith", split="train")[:4] for _ in range(4)]
mixed = [tokenizer.encode(text) for text in
         ("The capital of France is", "1, 2, 3,", "Once upon a time, in a land far away, there "
          "lived a", "def fib(n):", "1, 2, 3,", "Q: What is 7 * 8? A:")]
CASES = [  # (name, prompts, max_new_tokens, temperature, top_p, seed)
    ("arith t=1", arith, 40, 1.0, 1.0, 0),
    ("arith t=1 seed 1", arith, 40, 1.0, 1.0, 1),
    ("arith t=0.7 top-p 0.9", arith, 40, 0.7, 0.9, 2),
    ("mixed t=1", mixed, 24, 1.0, 1.0, 3),
    ("mixed greedy", mixed, 24, 0.0, 1.0, 4),
    ("mixed t=1.3 top-p 0.8, max_rows 4", mixed, 24, 1.3, 0.8, 5),
]


def run(module, static_kwarg, fast=None):
    samples = {}
    for name, prompts, T, temperature, top_p, seed in CASES:
        generator = torch.Generator().manual_seed(seed)
        kwargs = {"static": True} if static_kwarg else {"fast": fast}
        out = module.generate(model, prompts, T, temperature, top_p, eos, generator,
                              max_rows=4 if "max_rows" in name else None, **kwargs)
        samples[name] = (out.tokens, out.token_logprobs, out.response_mask)
    return samples


if args.against is None or args.record is not None:
    before = run(rollout_at(args.before), static_kwarg=True)
else:
    before = torch.load(args.against)
if args.record is not None:
    torch.save(before, args.record)
    print(f"saved {len(before)} cases of {args.before}'s generate(static=True) to {args.record}")
    sys.exit()
import rollout  # noqa: E402

# the reader's step (rollout.decode_step), and the GPU's (systems/cuda_decode.fast) run eagerly
# on this CPU: the same forward in fewer kernels, and inverse_cdf by blocks as the before side's
for fast in (False, True):
    after = run(rollout, "static" in inspect.signature(rollout.generate).parameters, fast=fast)
    print(f"# {'cuda_decode.fast (eager, on the CPU)' if fast else 'rollout.decode_step'}")
    for name in before:
        same = [torch.equal(b, a) for b, a in zip(before[name], after[name])]
        rows, width = before[name][0].shape
        worst = (before[name][1] - after[name][1]).abs().max().item()
        print(f"{name}: {rows} rows, {width} tokens: tokens {'same' if same[0] else 'DIFFER'}, "
              f"log-probs {'same' if same[1] else f'DIFFER (at most {worst:.2g})'}, masks "
              f"{'same' if same[2] else 'DIFFER'}")
    print("bit for bit" if all(torch.equal(b, a) for name in before
                               for b, a in zip(before[name], after[name])) else "NOT bit for bit")
