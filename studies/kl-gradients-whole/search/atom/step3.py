"""At the dominant prefix t=9 ('25 + 13 = 4|0'): each likely token's sampled d_v and the compensation."""
import sys, json, math
sys.path.insert(0, "/work/runs/kl-gradients-whole/src-771afac-order")
import torch
torch.set_num_threads(1)
from systems.model import load_model, load_tokenizer
import data
print("held-out arith examples:", len(data.load_task("arith", split="test")))
A = json.load(open("atom.json")); pids, y = A["prompt_ids"], A["response"]
tok = load_tokenizer("smollm2-135m")
pol = load_model("/work/runs/kl-gradients-whole/no-kl-seed0/step_20", torch.float32).eval()
ref = load_model("smollm2-135m", torch.float32).eval().requires_grad_(False)
for p in pol.parameters(): p.requires_grad_(False)
params = list(pol.model.layers[-1].parameters())
for p in params: p.requires_grad_(True)
t = 9
ids = torch.tensor([pids + y[:t]])
lp = pol(input_ids=ids).logits[0, -1].float().log_softmax(-1)
with torch.no_grad(): lq = ref(input_ids=ids).logits[0, -1].float().log_softmax(-1)
P, Q = lp.detach().exp(), lq.exp()
r = Q / P; below = (r <= 10).float(); W = below * (P - Q)
flat = lambda gs: torch.cat([g.reshape(-1) for g in gs]).double()
e = flat(torch.autograd.grad((W * lp).sum(), params, retain_graph=True))
acc, mass = 0, 0
print(" v   text   p_v      q_v      r_v    coef(1-r)1[r<=10]  ||g_v||  ||d_v||  cos(d_v, d_y)")
dy = None
for v in torch.argsort(P, descending=True)[:8].tolist():
    g = flat(torch.autograd.grad(lp[v], params, retain_graph=True))
    c = float((1 - r[v]) * below[v]); dv = c * g - e
    if v == y[t]: dy = dv
    acc = acc + float(P[v]) * dv; mass += float(P[v])
    print(f"{v:5d} {tok.decode([v])!r:6} {float(P[v]):.5f} {float(Q[v]):.5f} {float(r[v]):7.3f} {c:+8.3f} {g.norm():8.3f} {dv.norm():8.3f} {float(dv @ dy / dv.norm() / dy.norm()) if dy is not None else float('nan'):+.4f}")
print(f"sum over top-8 (mass {mass:.6f}) of p_v d_v: norm {acc.norm():.4g} (vs ||d_y|| {dy.norm():.4g}; p_y ||d_y|| = {float(P[y[t]])*dy.norm():.4g})")
py = float(P[y[t]])
print(f"required off-path mean at t=9: -{py:.4f}/{1-py:.4f} d_y = {py/(1-py):.3f} x ||d_y||")
