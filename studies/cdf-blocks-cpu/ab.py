"""The default run's sampling on a CPU with rollout.inverse_cdf (block sums, then a cumsum inside
one block) against one float64 cumsum over the vocabulary (rollout.py at 96575b5), alternated, one
thread: the same tokens, and useful tokens per CPU second.
`OMP_NUM_THREADS=1 python studies/cdf-blocks-cpu/ab.py > studies/cdf-blocks-cpu/output.txt`
(arith's first 8 training prompts x 4, 40 new tokens, temperature 1, the compaction loop; SmolLM2,
fp32, unfused as train.py's fp32 sampler)."""
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import data  # noqa: E402
import rollout as new  # noqa: E402
from model import load_model, load_tokenizer, stop_token_ids  # noqa: E402

source = subprocess.run(["git", "-C", str(ROOT), "show", "96575b5:rollout.py"],
                        capture_output=True, text=True, check=True).stdout
Path("/tmp/rollout_96575b5.py").write_text(source)
spec = importlib.util.spec_from_file_location("rollout_old", "/tmp/rollout_96575b5.py")
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
torch.set_num_threads(1)
model = load_model("smollm2-135m", dtype=torch.float32).eval()
tokenizer = load_tokenizer("smollm2-135m")
prompts = [data.prompt_ids(tokenizer, example)
           for example in data.load_task("arith", split="train")[:8] for _ in range(4)]
eos = stop_token_ids(model, tokenizer)
results = {"one cumsum": [], "blocks": []}
for round_ in range(4):
    for name in (("one cumsum", "blocks") if round_ % 2 == 0 else ("blocks", "one cumsum")):
        module = old if name == "one cumsum" else new
        start = time.process_time()
        out = module.generate(model, prompts, 40, 1.0, 1.0, eos_token_id=eos,
                              generator=torch.Generator().manual_seed(round_))
        results[name].append((time.process_time() - start, out))
for name, rows in results.items():
    useful = [sum(map(len, out.response_ids)) for _, out in rows]
    rate = sum(useful) / sum(seconds for seconds, _ in rows)
    print(name, [f"{seconds:.2f}s/{n}" for (seconds, _), n in zip(rows, useful)],
          f"{rate:.1f} useful tokens per CPU s")
same = [a.response_ids == b.response_ids and torch.equal(a.token_logprobs, b.token_logprobs)
        for (_, a), (_, b) in zip(results["one cumsum"], results["blocks"])]
print("same tokens and log-probs each round:", same)
