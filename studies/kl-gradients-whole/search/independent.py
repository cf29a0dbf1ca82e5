"""The registered test "Registered now, before it runs: the rows against an independent
implementation." (docs/kl_gradients.md): K3-in-loss's sampled term s and exact term e, whole
(R = inf) and truncated at R = 10 and 100, on 16 fresh groups (64 sequences) of the fp32 pi at step
20, computed (a) by the run's own code and (b) by plain autograd through the HF model, one sequence
alone, on the `layer` and `model` views' coordinates of seed 2. Prediction: every a within 1e-3 of
b's norm (the views' weighted norms).

(a) The run's code (src-771afac-order, the copy that produced the runs): kl_gradients.packed_gradients
    on each group exactly as measure_chunk calls it (--layers whole --grad-tail 10,100), giving the
    group rows k3_loss (s), p3 (e), k3_loss_below_R (s_R - e_R). To separate s_R from e_R, and to get
    every sequence alone, the same functions (vocab_logprobs, row_outputs, kl_coords.entry_gradients)
    with row_outputs' two parts of each row as rows of their own and each sequence's coefficients
    alone (the others zeroed). The code's rows carry 1/G (num_tokens = G, docstring item 4): a
    sequence's vector is G times its part; a group's row is the mean of its sequences'.
(b) Independent: policy(prompt + response) alone, fp32 full-vocabulary log_softmax, weights from
    the definitions, s_R = sum_t (1 - r_t) 1[r_t <= R] grad log p(y_t), e_R = sum_t sum_v 1[r_v <= R]
    (p_v - q_v) grad log p_v (one backward each, weights detached), the full parameter gradient
    (torch.autograd.grad) indexed at the coordinates. s_R = s where no sampled r_t exceeds R (same
    weights, the backward is reused).
Brute force: e_t (R = 10 weights) at three prefixes (the largest ||e_t|| in the sequence of largest
||e||, and two random) as the sum over the 50 tokens of largest |weight| of w_v grad log p_v, one
backward each, against the one-backward e_t; the rest bounded by sum|w| outside x max ||grad log p_v||.

    cd /work/main && OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 nice -n 5 python \\
        studies/kl-gradients-whole/search/independent.py | tee studies/kl-gradients-whole/search/independent.txt

Prints the sample, then per group and row (s, e, d = s - e for R = inf, 10, 100) and view the
relative differences ||a - b|| / ||b||: per sequence (max over the group's 4) and per group (the
packed_gradients row against b's group mean), and the max over everything; then the brute force.
"""
import math
import random
import sys
import time
from pathlib import Path

SRC = "/work/runs/kl-gradients-whole/src-771afac-order"
sys.path.insert(0, SRC)
import torch  # noqa: E402

import data  # noqa: E402
import rollout  # noqa: E402
import lab.kl_gradients as KG  # noqa: E402
from lab import kl_coords  # noqa: E402
from systems.model import load_model, load_tokenizer, stop_token_ids  # noqa: E402

torch.set_num_threads(1)
T0 = time.time()
POLICY = "/work/runs/kl-gradients-whole/no-kl-seed0/step_20"
SCRATCH = Path("/work/runs/kl-gradients-whole/scratch/independent")
SCRATCH.mkdir(parents=True, exist_ok=True)
GROUPS = int(sys.argv[1]) if len(sys.argv) > 1 else 16
TAIL, RS = (10, 100), (math.inf, 10, 100)
args = KG.parser.parse_args(["--layers", "whole", "--grad-tail", "10,100", "--seed", "2"])
G = args.group_size
tokenizer = load_tokenizer(args.model)
examples = data.load_task("arith", split="test")
reference = load_model(args.model, torch.float32).requires_grad_(False)
policy = load_model(POLICY, torch.float32).eval()
params, subsets, weights = KG.choose_subsets(policy, "whole", args.coords, args.seed)
blocks = [name for name, _ in kl_coords.pools(policy, "whole")]
views = kl_coords.views("whole", blocks)
sizes = [sum(len(i) for _, i in s) for s in subsets]
bounds = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
VIEWS = {v: [blocks.index(b) for b in views[v]] for v in ("layer", "model")}
print(f"pi {POLICY}; coordinates seed {args.seed}: blocks {blocks}, sizes {sizes}, weights "
      f"{[round(w, 4) for w in weights]}; views {views['layer']} and all {len(blocks)}")


def norm(x, view):
    """The view's weighted norm: sqrt(sum over its blocks of weight * ||x_block||^2)."""
    x = x.double()
    return math.sqrt(sum(weights[k] * float(x[bounds[k]:bounds[k + 1]].norm()) ** 2
                         for k in VIEWS[view]))


def rel(a, b, view):
    return norm(a - b, view) / norm(b, view)


def coords(grads):
    return torch.cat([kl_coords.coordinates(grads[j], index) for s in subsets
                      for j, index in s]).double()


# ---- the sample: measure_chunk's sampling lines (chunk 0 of --seed 2, "step 20"), 8 prompts a batch
seed = KG.chunk_seed(args.seed, "step 20", 0)
stop_ids = stop_token_ids(policy, tokenizer)
gen, prompt_rng = torch.Generator().manual_seed(seed), random.Random(seed)
sample, done = [], 0
while done < GROUPS:
    count = min(args.prompts_per_batch, GROUPS - done)
    problems = [prompt_rng.choice(examples) for _ in range(count)]
    prompts = [data.prompt_ids(tokenizer, ex) for ex in problems for _ in range(G)]
    with torch.no_grad():
        out = rollout.generate(policy, prompts, args.max_new_tokens, 1.0, 1.0, stop_ids, gen)
    completions = tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
    scores = torch.tensor([data.score(ex, c) for ex, c in
                           zip([ex for ex in problems for _ in range(G)], completions)])
    tokens, mask = out.tokens, out.response_mask
    done += count
    for k in range(count):
        rows = slice(k * G, (k + 1) * G)
        T = int(mask[rows].sum(1).max())  # the group's own padding only
        sample.append((prompts[rows], tokens[rows, :T], mask[rows, :T], scores[rows]))
print(f"chunk seed {seed}; {len(sample)} groups, response lengths "
      f"{[g[2].sum(1).long().tolist() for g in sample]}  ({time.time() - T0:.0f} s)", flush=True)


def code_rows(prompts, tokens, mask, scores):
    """(a): packed_gradients' group rows, and each sequence's s_R, e_R from the same functions."""
    grads, *_ = KG.packed_gradients(policy, reference, prompts, tokens, mask, scores, G, params,
                                    subsets, TAIL)
    names = KG.ROWS + KG.tail_rows(TAIL)
    row = lambda n: grads[0, names.index(n)].double()  # noqa: E731
    group = {("s", math.inf): row("k3_loss"), ("e", math.inf): row("p3")}
    group.update({("d", R): row(f"k3_loss_below_{R}") for R in TAIL})
    with kl_coords.capture(policy, params) as (saved, owned):
        logp, logp_all = KG.vocab_logprobs(policy, prompts, tokens, mask)
    with torch.no_grad():
        ref_logp, ref_all = KG.vocab_logprobs(reference, prompts, tokens, mask)
    outputs, _ = KG.row_outputs(logp, logp_all, ref_logp, ref_all, mask, scores, G, TAIL)
    parts = {("s", math.inf): outputs["k3_loss"][0], ("e", math.inf): outputs["p3"][0]}
    for R in TAIL:  # [(logp_all, -c_all), (logp, c_sampled)]: e_R's and s_R's VJPs
        (t_all, neg_c_all), (t_tok, c_tok) = outputs[f"k3_loss_below_{R}"]
        parts[("e", R)], parts[("s", R)] = (t_all, -neg_c_all), (t_tok, c_tok)
    split = {}  # each sequence alone: its coefficients, the others' zeroed
    for key, (tensor, c) in parts.items():
        for i in range(G):
            one = torch.zeros_like(c)
            one[i] = c[i]
            split[(key, i)] = [(tensor, one)]
    rows = kl_coords.entry_gradients(split, saved, owned, params, subsets)
    seqs = {key: [G * rows[(key, i)][0].double() for i in range(G)] for key in parts}
    return group, seqs


def independent(prompt, y):
    """(b): {(term, R): vector} for one sequence, and what the brute force needs."""
    ids, Lp, T = torch.tensor([prompt + y]), len(prompt), len(y)
    lp = policy(input_ids=ids).logits[0, Lp - 1:Lp + T - 1].float().log_softmax(-1)  # predicts y_t
    with torch.no_grad():
        lq = reference(input_ids=ids).logits[0, Lp - 1:Lp + T - 1].float().log_softmax(-1)
    yt, at = torch.tensor(y), torch.arange(T)
    lpy = lp[at, yt]
    with torch.no_grad():
        lpd, lqd = lp.double(), lq.double()
        r_y = (lqd[at, yt] - lpd[at, yt]).exp()  # the sampled token's ratio pi_ref / pi
        log_r = lqd - lpd  # every token's
        diff = lpd.exp() - lqd.exp()  # p_v - q_v
    out, seen = {}, {}
    for R in RS:
        c = ((1 - r_y) * (r_y <= R)).float()  # s's coefficients
        key = tuple(c.tolist())
        if key not in seen:
            seen[key] = coords(torch.autograd.grad((c * lpy).sum(), params, retain_graph=True))
        out[("s", R)] = seen[key]
        W = (diff * (log_r <= math.log(R))).float()  # e's weights (R = inf: every token)
        out[("e", R)] = coords(torch.autograd.grad((W * lp).sum(), params, retain_graph=True))
        out[("d", R)] = out[("s", R)] - out[("e", R)]
    return out, (lp, (diff * (log_r <= math.log(10))).float())


# ---- per group: (a) and (b), the relative differences
KEYS = [(term, R) for R in RS for term in ("s", "e", "d")]
label = lambda k: f"{k[0]}_{'inf' if k[1] == math.inf else k[1]}"  # noqa: E731
worst, saved_b, keep = {}, [], None
print("per group, row, view: max over its 4 sequences of ||a_i - b_i||/||b_i||, then the group's "
      "packed_gradients row against b's group mean after '|' (packed rows: s_inf = k3_loss, e_inf = p3, "
      "d_10, d_100 = k3_loss_below_R); /l = layer view, /m = model view")
for g, (prompts, tokens, mask, scores) in enumerate(sample):
    t0 = time.time()
    group, seqs = code_rows(prompts, tokens, mask, scores)
    for key in [k for k in KEYS if k[0] == "d"]:  # d = s - e from the split rows too
        seqs[key] = [s - e for s, e in zip(seqs[("s", key[1])], seqs[("e", key[1])])]
    b = []
    for i in range(G):
        n = int(mask[i].sum())
        assert mask[i, :n].all() and not mask[i, n:].any()
        vec, extra = independent(prompts[i], tokens[i, :n].tolist())
        b.append(vec)
        if keep is None or norm(vec[("e", 10)], "model") > keep[0]:
            keep = (norm(vec[("e", 10)], "model"), g, i)
    saved_b.append(b)
    line = []
    for key in KEYS:
        for view in ("layer", "model"):
            per = max(rel(seqs[key][i], b[i][key], view) for i in range(G))
            mean_b = sum(b[i][key] for i in range(G)) / G
            grp = rel(group[key], mean_b, view) if key in group else float("nan")
            if key in group:  # the packed row against the split rows' mean (the code's own)
                grp_code = rel(group[key], sum(seqs[key]) / G, view)
                worst[("code-consistency", view)] = max(worst.get(("code-consistency", view), 0),
                                                        grp_code)
            for name, x in ((key, per), ((key, "group"), grp)):
                if x == x:
                    worst[(name, view)] = max(worst.get((name, view), 0.0), x)
            line.append(f"{label(key)}/{view[0]} {per:.1e}" + (f"|{grp:.1e}" if grp == grp else ""))
    print(f"group {g:2d} ({time.time() - t0:.0f} s): " + "  ".join(line), flush=True)
torch.save(saved_b, SCRATCH / "independent_b.pt")

print("\nmax ||a - b|| / ||b|| per row and view (per sequence | per group, packed_gradients; "
      "'-': no packed row):")
for key in KEYS:
    cells = [f"{view} {worst[(key, view)]:.2e} | " + (f"{worst[((key, 'group'), view)]:.2e}"
             if ((key, "group"), view) in worst else "-") for view in ("layer", "model")]
    print(f"  {label(key):6s} " + "   ".join(cells))
overall = max(v for k, v in worst.items() if k[0] != "code-consistency")
print(f"max over everything: {overall:.3e}; every one within 1e-3: {overall <= 1e-3}  "
      f"(packed row vs the code's split rows: {max(worst[('code-consistency', v)] for v in VIEWS):.1e})")

# ---- brute force: e_t at three prefixes, R = 10 weights
_, g, i = keep
prompts, tokens, mask, _ = sample[g]
y = tokens[i, :int(mask[i].sum())].tolist()
vec, (lp, W) = independent(prompts[i], y)
e_t = lambda t: coords(torch.autograd.grad((W[t] * lp[t]).sum(), params, retain_graph=True))  # noqa
norms = [norm(e_t(t), "model") for t in range(len(y))]
t_max = max(range(len(y)), key=lambda t: norms[t])
rng = random.Random(0)
picks = [(g, i, t_max)] + [(gg, ii, rng.randrange(int(sample[gg][2][ii].sum())))
                           for gg, ii in ((rng.randrange(len(sample)), rng.randrange(G))
                                          for _ in range(2))]
print(f"\nbrute force (R = 10 weights): prefix of largest ||e_t|| in group {g} sequence {i} "
      f"(largest ||e_10||): t = {t_max}; two random")
for gg, ii, t in picks:
    prompts, tokens, mask, _ = sample[gg]
    y = tokens[ii, :int(mask[ii].sum())].tolist()
    _, (lp, W) = independent(prompts[ii], y)
    one = e_t(t)
    order = torch.argsort(W[t].abs(), descending=True)
    acc, gmax = 0, 0.0
    for v in order[:50].tolist():
        gv = coords(torch.autograd.grad(lp[t, v], params, retain_graph=True))
        gmax = max(gmax, norm(gv, "model"))
        acc = acc + float(W[t, v]) * gv
    rest = float(W[t, order[50:]].abs().sum())
    print(f"  group {gg} seq {ii} t {t}: ||e_t|| model {norm(one, 'model'):.4g}; top-50 sum vs "
          f"one backward: layer {rel(acc, one, 'layer'):.2e}, model {rel(acc, one, 'model'):.2e}; "
          f"rest sum|w| {rest:.2e} x max||g_v|| {gmax:.3g} = bound {rest * gmax / norm(one, 'model'):.2e} "
          f"(relative)", flush=True)
print(f"done in {time.time() - T0:.0f} s")
