"""The default run's sampling on a CPU, rollout.py before (33b65db) and after this session's change
(compiled_step and decode's span), alternated, one thread: the same tokens, and useful tokens per
CPU second. `OMP_NUM_THREADS=1 python studies/sampling-ab/ab.py > studies/sampling-ab/output.txt`
(arith's first 8 training prompts x 4, 40 new tokens, temperature 1, the compaction loop)."""
import importlib.util, subprocess, sys, time, torch
sys.path.insert(0, '/work/main')
old_src = subprocess.run(['git', '-C', '/work/main', 'show', '33b65db:rollout.py'],
                         capture_output=True, text=True, check=True).stdout
open('/tmp/rollout_33b65db.py', 'w').write(old_src)
spec = importlib.util.spec_from_file_location('rollout_old', '/tmp/rollout_33b65db.py')
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
import rollout as new, data
from model import load_model, load_tokenizer, stop_token_ids
torch.set_num_threads(1)
model = load_model("smollm2-135m", dtype=torch.float32).eval()
tok = load_tokenizer("smollm2-135m")
prompts = [data.prompt_ids(tok, e) for e in data.load_task("arith", split="train")[:8] for _ in range(4)]
eos = stop_token_ids(model, tok)
res = {"before": [], "after": []}
for r in range(4):
    for name in (("before", "after") if r % 2 == 0 else ("after", "before")):
        mod = old if name == "before" else new
        t = time.process_time()
        out = mod.generate(model, prompts, 40, 1.0, 1.0, eos_token_id=eos,
                           generator=torch.Generator().manual_seed(r))
        res[name].append((time.process_time() - t, sum(map(len, out.response_ids))))
for name, rows in res.items():
    rate = sum(n for _, n in rows) / sum(s for s, _ in rows)
    print(name, [f"{s:.2f}s/{n}" for s, n in rows], f"{rate:.1f} useful tokens per CPU s")
