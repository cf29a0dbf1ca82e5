"""The default run's sampling on a CPU, rollout.py at a commit (`--before`) against the working
tree's, alternated, one thread: the same tokens and log-probs, and useful tokens per CPU second
(arith's first 8 training prompts x 4, 40 new tokens, temperature 1, each side's default loop: on a
CPU the compaction loop, systems/compaction.py since issue 54; SmolLM2 in fp32, unfused, as
train.py's fp32 sampler).

    OMP_NUM_THREADS=1 python studies/sampling-ab/ab.py > studies/sampling-ab/output.txt
    OMP_NUM_THREADS=1 python studies/sampling-ab/ab.py --before b17f244 \
        > studies/norms-rope-cpu/output.txt
    OMP_NUM_THREADS=1 python studies/sampling-ab/ab.py --before d8dea11 \
        > studies/sampling-ab/reader-edition.txt
"""
import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "studies")]
import data  # noqa: E402
import rollout as after  # noqa: E402
from systems.model import load_model, load_tokenizer, stop_token_ids  # noqa: E402
from rollout_at import rollout_at  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--before", default="33b65db", help="the commit whose rollout.py runs first")
parser.add_argument("--rounds", type=int, default=4, help="alternated rounds, each a seed")
args = parser.parse_args()

before = rollout_at(args.before)

torch.set_num_threads(1)
model = load_model("smollm2-135m", dtype=torch.float32).eval()
tokenizer = load_tokenizer("smollm2-135m")
prompts = [data.prompt_ids(tokenizer, example)
           for example in data.load_task("arith", split="train")[:8] for _ in range(4)]
eos = stop_token_ids(model, tokenizer)
results = {"before": [], "after": []}
for round_ in range(args.rounds):
    for name in (("before", "after") if round_ % 2 == 0 else ("after", "before")):
        module = before if name == "before" else after
        start = time.process_time()
        out = module.generate(model, prompts, 40, 1.0, 1.0, eos_token_id=eos,
                              generator=torch.Generator().manual_seed(round_))
        results[name].append((time.process_time() - start, out))
print(f"before: rollout.py at {args.before}; after: the working tree's")
for name, rows in results.items():
    useful = [sum(map(len, out.response_ids)) for _, out in rows]
    rate = sum(useful) / sum(seconds for seconds, _ in rows)
    print(name, [f"{seconds:.2f}s/{n}" for (seconds, _), n in zip(rows, useful)],
          f"{rate:.1f} useful tokens per CPU s")
same = [a.response_ids == b.response_ids and torch.equal(a.token_logprobs, b.token_logprobs)
        for (_, a), (_, b) in zip(results["before"], results["after"])]
print("same tokens and log-probs each round:", same)
