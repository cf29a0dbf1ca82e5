"""The default run's sampling on a CPU with the projections joined (cuda_decode.fuse_projections)
and separate, alternated, one thread: the same tokens, and useful tokens per CPU second.
`OMP_NUM_THREADS=1 python studies/fused-cpu/ab.py > studies/fused-cpu/output.txt`
(arith's first 8 training prompts x 4, 40 new tokens, temperature 1; SmolLM2 in fp32). Since issue
54 the joined weights are read only by systems/cuda_decode.py's step, so both sides run it
(generate(fast=True), eagerly on the CPU); the recorded outputs ran the compaction loop of the
time."""
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import data  # noqa: E402
import rollout  # noqa: E402
from systems import cuda_decode  # noqa: E402
from systems.model import load_model, load_tokenizer, stop_token_ids  # noqa: E402

torch.set_num_threads(1)
separate = load_model("smollm2-135m", dtype=torch.float32).eval()
joined = copy.deepcopy(separate)
cuda_decode.fuse_projections(joined)
tokenizer = load_tokenizer("smollm2-135m")
prompts = [data.prompt_ids(tokenizer, example)
           for example in data.load_task("arith", split="train")[:8] for _ in range(4)]
eos = stop_token_ids(separate, tokenizer)
results = {"separate": [], "joined": []}
for round_ in range(4):
    for name in (("separate", "joined") if round_ % 2 == 0 else ("joined", "separate")):
        model = separate if name == "separate" else joined
        start = time.process_time()
        out = rollout.generate(model, prompts, 40, 1.0, 1.0, eos_token_id=eos, fast=True,
                               generator=torch.Generator().manual_seed(round_))
        results[name].append((time.process_time() - start, out))
for name, rows in results.items():
    useful = [sum(map(len, out.response_ids)) for _, out in rows]
    rate = sum(useful) / sum(seconds for seconds, _ in rows)
    print(name, [f"{seconds:.2f}s/{n}" for (seconds, _), n in zip(rows, useful)],
          f"{rate:.1f} useful tokens per CPU s")
same = [a.response_ids == b.response_ids for (_, a), (_, b) in zip(results["separate"],
                                                                    results["joined"])]
print("same tokens each round:", same)
