import sys, json, random, time
sys.path.insert(0, "/work/runs/kl-gradients-whole/src-771afac-order")
import torch, numpy as np
torch.set_num_threads(1)
import data, rollout
from systems.model import load_model, load_tokenizer, stop_token_ids
CH = "/work/runs/kl-gradients-whole/chunks-seed1/step_20"
examples = data.load_task("arith", split="test")
ex = examples[75]
print("example 75:", ex)
groups = [191, 235, 240, 252, 481]
recs = {}
for g in groups:
    c, k = divmod(g, 32)
    rec = json.loads(open(f"{CH}/chunk_{c:05d}.json").read())
    rng = random.Random(rec["seed"])
    ids = {id(e): i for i, e in enumerate(examples)}
    P = [ids[id(rng.choice(examples))] for _ in range(32)]
    part = torch.load(f"{CH}/chunk_{c:05d}.pt", weights_only=False)
    s = part["seqs"]
    sl = slice(4 * k, 4 * k + 4)
    recs[g] = {key: s[key][sl].tolist() for key in ("length", "score", "k1", "k3", "kl", "k3_below_10", "k3_below_10_exact", "tail_prob_10", "chi2_max")}
    print(g, "prompt", P[k], {kk: np.round(v, 6).tolist() for kk, v in recs[g].items()})
tok = load_tokenizer("smollm2-135m")
pids = data.prompt_ids(tok, ex)
print("prompt text:", repr(tok.decode(pids)))
pol = load_model("/work/runs/kl-gradients-whole/no-kl-seed0/step_20", torch.float32).eval()
stop = stop_token_ids(pol, tok)
outs = {}
with torch.no_grad():
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        out = rollout.generate(pol, [pids] * 8, 40, 1.0, 1.0, stop, gen)
        for r in range(8):
            t = out.tokens[r][out.response_mask[r] > 0].tolist()
            outs[tuple(t)] = outs.get(tuple(t), 0) + 1
    out = rollout.generate(pol, [pids], 40, 0.0, 1.0, stop, None)
    greedy = out.tokens[0][out.response_mask[0] > 0].tolist()
for t, n in sorted(outs.items(), key=lambda x: -x[1]):
    print(n, len(t), t, repr(tok.decode(list(t))))
print("greedy", len(greedy), greedy, repr(tok.decode(greedy)))
top = max(outs, key=outs.get)
json.dump({"prompt_ids": pids, "response": list(top), "greedy": greedy, "example": str(ex), "records": recs}, open("atom.json", "w"))
