"""Independent check of kl_gradients' k3_loss_below_10 atom (prompt 75, seed-1 run) on the full
last decoder layer; then the code's own d on the same sequence, and the run's stored X."""
import sys, json, math, time
sys.path.insert(0, "/work/runs/kl-gradients-whole/src-771afac-order")
import torch, numpy as np
torch.set_num_threads(1)
from systems.model import load_model
T0 = time.time()
A = json.load(open("atom.json"))
pids, y = A["prompt_ids"], A["response"]
R = 10.0
pol = load_model("/work/runs/kl-gradients-whole/no-kl-seed0/step_20", torch.float32).eval()
ref = load_model("smollm2-135m", torch.float32).eval().requires_grad_(False)
for p in pol.parameters():
    p.requires_grad_(False)
layer = pol.model.layers[-1]
names = [n for n, _ in layer.named_parameters()]
params = [p for _, p in layer.named_parameters()]
for p in params:
    p.requires_grad_(True)
print("last layer params:", sum(p.numel() for p in params))

# ---------------- A. independent: plain HF forward, full-vocab softmax, autograd
ids = torch.tensor([pids + y])
Lp, T = len(pids), len(y)
lg = pol(input_ids=ids).logits[0, Lp - 1:Lp + T - 1].float()      # (T, V): predicts y_t
with torch.no_grad():
    lq = ref(input_ids=ids).logits[0, Lp - 1:Lp + T - 1].float().log_softmax(-1)
lp = lg.log_softmax(-1)
yt = torch.tensor(y)
lpy = lp[torch.arange(T), yt]
with torch.no_grad():
    P, Q = lp.exp(), lq.exp()
    r_y = (lq[torch.arange(T), yt] - lpy).exp()
    below_y = (r_y <= R).float()
    below = ((lq - lp) <= math.log(R)).float()
    W = below * (P - Q)                                             # (T, V) exact weights
    cs = (1 - r_y) * below_y                                        # sampled coefficients
def flat(gs):
    return torch.cat([g.reshape(-1) for g in gs]).double()
s_t, e_t = [], []
for t in range(T):  # per prefix, one backward each
    s_t.append(flat(torch.autograd.grad(cs[t] * lpy[t], params, retain_graph=True)))
    e_t.append(flat(torch.autograd.grad((W[t] * lp[t]).sum(), params, retain_graph=True)))
s, e = sum(s_t), sum(e_t)
d = s - e
# one-shot versions (sanity)
s1 = flat(torch.autograd.grad((cs * lpy).sum(), params, retain_graph=True))
e1 = flat(torch.autograd.grad((W * lp).sum(), params, retain_graph=True))
path_lp = float(lpy.double().sum())
print(f"A: ||s|| {s.norm():.6g}  ||e|| {e.norm():.6g}  ||d|| {d.norm():.6g}  ||d||^2 {d.norm()**2:.6g}"
      f"  (one-shot rel diff s {((s1-s)).norm()/s.norm():.2e}, e {(e1-e).norm()/e.norm():.2e})")
print(f"   pi(path) = {math.exp(path_lp):.6g}  (log {path_lp:.6g}); k1 {float(-(lq[torch.arange(T), yt]-lpy).sum()):.6f}"
      f" k3 {float((r_y - 1 - r_y.log()).sum()):.6f} (chunk k1 {A['records']['191']['k1']}, k3 {A['records']['191']['k3']})")
with torch.no_grad():
    K3all = (Q / P) - 1 - (lq - lp)
    print(f"   k3_below_10_exact {float((P*K3all*below).sum()):.6f}, tail_prob_10 {float((P*(1-below)).sum()):.6f}, KL {float((P*(lp-lq)).sum()):.6f}")
print(" t  tok   p(y)     1-p(y)    q(y)      r_y     sum_w   P(r>10) Q(r>10) ||s_t||   ||e_t||   ||d_t||")
for t in range(T):
    print(f"{t:2d} {y[t]:5d} {float(P[t, y[t]]):.6f} {1-float(P[t, y[t]]):.3e} {float(Q[t, y[t]]):.3e} {float(r_y[t]):8.3g}"
          f" {float(W[t].sum()):+.4f} {float((P[t]*(1-below[t])).sum()):.2e} {float((Q[t]*(1-below[t])).sum()):.3f}"
          f" {s_t[t].norm():.4g} {e_t[t].norm():.4g} {(s_t[t]-e_t[t]).norm():.4g}")
# brute force at 3 prefixes: the 3 largest ||e_t||
tops = sorted(range(T), key=lambda t: -float(e_t[t].norm()))[:3]
for t in tops:
    order = torch.argsort(W[t].abs(), descending=True)
    top = order[:50]
    acc, gnorm = 0, []
    for v in top.tolist():
        g = flat(torch.autograd.grad(lp[t, v], params, retain_graph=True))
        gnorm.append(float(g.norm()))
        acc = acc + float(W[t, v]) * g
    rest = float(W[t, order[50:]].abs().sum())
    # remainder bound: ||grad log p_v|| = ||J^T (e_v - p)|| <= ||J^T e_v|| + ||J^T p||; estimate by max over top-50
    print(f"brute t={t}: ||e_t|| {e_t[t].norm():.6g}, top-50 sum rel diff {(acc - e_t[t]).norm()/e_t[t].norm():.3e},"
          f" rest sum|w| {rest:.3e}, max||g_v|| top50 {max(gnorm):.4g} -> heuristic bound {rest*max(gnorm):.3e}")
torch.save({"s": s, "e": e, "d": d, "names": names}, "independent.pt")
print(f"A done {time.time()-T0:.0f} s", flush=True)

# ---------------- B. the code's functions, one group of 4 copies, full last layer
import lab.kl_gradients as KG
G = 4
prompts = [pids] * G
tokens = torch.tensor([y] * G)
mask = torch.ones(G, T)
logp, logp_all = KG.vocab_logprobs(pol, prompts, tokens, mask)
with torch.no_grad():
    ref_logp, ref_all = KG.vocab_logprobs(ref, prompts, tokens, mask)
outputs, prefix = KG.row_outputs(logp, logp_all, ref_logp, ref_all, mask, torch.zeros(G), G, (10, 100))
(t_all, neg_c_all), (t_tok, c_tok) = outputs["k3_loss_below_10"]
e_code = -flat(torch.autograd.grad(t_all, params, grad_outputs=neg_c_all, retain_graph=True))
s_code = flat(torch.autograd.grad(t_tok, params, grad_outputs=c_tok, retain_graph=True))
d_code = flat(torch.autograd.grad([t_all, t_tok], params, grad_outputs=[neg_c_all, c_tok], retain_graph=True))
rel = lambda a, b: float((a - b).norm() / b.norm())
print(f"B code: ||s|| {s_code.norm():.6g} ||e|| {e_code.norm():.6g} ||d|| {d_code.norm():.6g}; rel diff vs A: s {rel(s_code, s):.2e}"
      f" e {rel(e_code, e):.2e} d {rel(d_code, d):.2e}; d_code vs s_code-e_code {rel(s_code - e_code, d_code):.1e}")
print("   code per-seq coefficient sums: c_tok rows", c_tok.sum(1).tolist(), " c_all rows", neg_c_all.double().sum((1, 2)).tolist())
del outputs, logp, logp_all
torch.save({"s": s_code, "e": e_code, "d": d_code}, "code.pt")
print(f"B done {time.time()-T0:.0f} s", flush=True)

# ---------------- C. the run's layer view (seed 1 subsets), and the run's own packed_gradients vs the stored X
from lab.kl_coords import choose_subsets
allp, subsets, weights = choose_subsets(pol, "whole", 16384, 1)
print("weights", [round(w, 4) for w in weights])
offs, o = {}, 0
for n, p in zip(names, params):
    offs[id(p)] = (o, p.numel()); o += p.numel()
def project(vec, blocks=(0, 1)):
    out = []
    for b in blocks:
        parts = []
        for j, index in subsets[b]:
            st, n = offs[id(allp[j])]
            parts.append(vec[st:st + n][index])
        out.append(torch.cat(parts))
    return out
CH = "/work/runs/kl-gradients-whole/chunks-seed1/step_20"
part = torch.load(f"{CH}/chunk_00005.pt", weights_only=False)
rec = json.load(open(f"{CH}/chunk_00005.json"))
row = rec["rows"].index("k3_loss_below_10")
X = part["X"][31, row].double()
Xa, Xm = X[:16384], X[16384:32768]
wn = lambda a, m: weights[0] * float(a.norm()**2) + weights[1] * float(m.norm()**2)
print(f"stored X group 191 layer-view weighted ||d||^2 = {wn(Xa, Xm):.6g}")
for lab_, v in (("independent", d), ("code", d_code)):
    a, m = project(v)
    print(f"{lab_:>12}: projected weighted ||d||^2 = {wn(a, m):.6g}; rel diff to stored X: attn {rel(a, Xa):.2e} mlp {rel(m, Xm):.2e}")
    a, m = project(s if lab_ == "independent" else s_code); print(f"   s part weighted {wn(a, m):.6g}")
    a, m = project(e if lab_ == "independent" else e_code); print(f"   e part weighted {wn(a, m):.6g}")
print(f"full-layer ||d||^2: independent {float(d.norm()**2):.6g}")
# the run's exact path: packed_gradients on the whole-model subsets
for grp in (235, 481):
    c, k = divmod(grp, 32)
    Xo = torch.load(f"{CH}/chunk_{c:05d}.pt", weights_only=False)["X"][k, row].double()
    print(f"  stored X group {grp} vs 191: rel diff {rel(Xo, part['X'][31, row].double()):.2e}")
grads, *_ = KG.packed_gradients(pol, ref, prompts, tokens, mask, torch.zeros(G), G, allp, subsets, (10, 100))
Xr = grads[0, row].double()
print(f"packed_gradients rerun vs stored X (all {len(X)} coords): rel diff {rel(Xr, X):.2e}; first two blocks: {rel(Xr[:32768], X[:32768]):.2e}")
print(f"C done {time.time()-T0:.0f} s")
