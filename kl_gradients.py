"""Table 1 measured on a real LLM: the bias and variance of each configuration's KL gradient (paper
sec. 3, Table 1, eqs. 6-16), on SmolLM2-135M-Instruct and the `arith` task.

pi_ref is the base model; pi the same after N steps of no-KL RLOO training on `arith` (train.main,
--kl k1 --place none, checkpoints step_N), or any --policy DIR. For each distance:

1. Samples. Groups of G responses y ~ pi (temperature 1, rollout.generate with the fp32 policy) to
   prompts drawn uniformly, with replacement, from the held-out split (data.load_task("arith",
   split="test")): the groups are i.i.d.
2. The trainer's estimator. For each group, the loss train.py builds with the task score set to 0:
   kl.shape_rewards -> advantage.rloo -> advantage.policy_loss + kl.kl_loss (on-policy: old_logp =
   sg[logp], ratio 1), with log-probs from train.token_logprobs in fp32. Its gradient is the
   configuration's estimate of the gradient of the KL term. It is linear in the per-token log-probs,
   so autograd gives its coefficients dloss/dlogp (B, T) through the real functions, and one
   vector-Jacobian product through the model turns them into the parameter gradient (exactly the
   gradient of the trainer's loss, by the chain rule). `task_pg` is the same loss with the real
   score and no KL: the task's policy gradient on the same samples.
3. Scale. beta = 1 and num_tokens = G: each group's vector x_k is a per-sequence estimate of
   grad KL(pi || pi_ref) in nats (eq. 6), and beta multiplies every KL row alike (it changes no cosine
   or relative error; variances scale as beta^2). The trainer divides by the batch's random token
   count instead: `--normalizer-prompts` batches of that many groups are formed from the pool and
   the expected token-normalized gradient, E[sum_k S_k / N], is reported beside it (`tok_*`).
4. Dimensions. Gradients w.r.t. the last decoder layer (only it requires grad, so the backward
   stops there), of which a fixed random subset of --coords coordinates is kept in each of two
   parameter blocks, its attention and its MLP: two subsets whose answers are compared; the table
   pools them. --layers all draws both from the whole parameter vector (a full backward; GPUs).
5. Statistics. From the groups' Gram matrices: E[g_c] . E[g_r] and ||E[g_c]||^2 as U-statistics
   (pairs of distinct groups: unbiased, no noise floor of tr(Cov)/n), trace of the covariance, and
   95% percentile bootstrap intervals over groups (resampled within even and odd groups, so that
   the check on independent halves is resampled alike). The reference grad KL is K1-in-reward
   (eqs. 10, 12). Per configuration c: cos(E[g_c], grad KL); proj = E[g_c] . grad KL / ||grad KL||^2;
   rel_err = ||E[g_c] - grad KL|| / ||grad KL||; var = G tr Cov(x_k), one sequence's variance;
   var_ratio = var / var(task_pg); by response-length tercile of the groups, var and the bias.
   A ratio to ||grad KL||^2 is undefined in a resample whose U-statistic of it is <= 0 (the noise
   above the signal); such resamples count as the worst case, so its interval is then unbounded.
   Defined whatever the noise, in units of K1-in-reward's one-sequence variance var_ref: snr =
   ||E[g_c]||^2 / var_ref, bias_snr = ||E[g_c] - grad KL||^2 / var_ref (an interval above 0
   detects the bias; 1 / snr is about the number of sequences that resolve the vector).
6. At scale (--batch-groups B > 1, for GPUs). B groups are differentiated in one pass: the trainer's
   token_logprobs packs each group into one sequence, and a Linear's gradient is sum_l delta_l a_l^T
   over its output gradients delta and inputs a, so per-pack products give every group's gradient
   exactly (batch_gradients; test_kl_gradients.py checks them against group_gradients). The mean of
   each batch's B i.i.d. groups is then the unit of step 5 (var = G B tr Cov of a unit), so the
   statistics need (n / B)^2 Gram entries, not n^2; the length terciles and the token normalizer,
   which are per group, are left to the per-group runs (--batch-groups 1).

    python kl_gradients.py        # trains pi (~15-25 min), then 3 distances (~40 min, one core)
    python kl_gradients.py --analyze runs/kl-gradients/gradients   # statistics of saved gradients
    python kl_gradients.py --device cuda --groups 4096 --batch-groups 32 --out studies/kl-gradients-gpu
"""
import argparse
import json
import math
import random
import resource
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

import advantage
import data
import kl
import rollout
import study
import train
from model import load_model, load_tokenizer, stop_token_ids

# name: (estimator, place, clamp, KL to go)
CONFIGS = {"k1_reward": ("k1", "reward", "none", False), "k1_loss": ("k1", "loss", "none", False),
           "k1_both": ("k1", "both", "none", False), "k3_reward": ("k3", "reward", "none", False),
           "k3_loss": ("k3", "loss", "none", False), "k3_both": ("k3", "both", "none", False),
           "k2_loss": ("k2", "loss", "none", False),
           "k3_reward_verl": ("k3", "reward", "verl", False),
           "k1_to_go": ("k1", "none", "none", True), "task_pg": ("k1", "none", "none", False)}
SUMS = {"k1_both": ("k1_reward", "k1_loss"), "k3_both": ("k3_reward", "k3_loss")}  # sec. 4.3
REF = "k1_reward"  # the reference grad KL (eqs. 10, 12)
UNBIASED = ("k1_reward", "k1_both", "k3_both", "k1_to_go")  # Table 1's unbiased rows

parser = argparse.ArgumentParser(description="The bias and variance of every Table 1 "
                                             "configuration's KL gradient on a real LLM.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--model", default="smollm2-135m",
                    help="pi_ref, and the model trained into pi (a hub id, a directory, "
                         "smollm2-135m)")
parser.add_argument("--policy", default=None,
                    help="measure this policy directory against --model instead of training one")
parser.add_argument("--steps", default="5,10,20",
                    help="distances: checkpoints step_N of a no-KL run on arith, trained if absent")
parser.add_argument("--train-dir", default="runs/kl-gradients/no-kl-seed0",
                    help="the no-KL training run (train.py --kl k1 --place none --save-every 5)")
parser.add_argument("--groups", type=int, default=128, help="groups of G responses per distance")
parser.add_argument("--group-size", type=int, default=4, help="G, the RLOO group (train.py's)")
parser.add_argument("--prompts-per-batch", type=int, default=8,
                    help="groups sampled together (rollout.generate's batch)")
parser.add_argument("--batch-groups", type=int, default=1,
                    help="groups differentiated in one pass (GPUs: 32). Above 1, each batch's mean "
                         "gradient is one unit of the statistics (no length terciles, no token "
                         "normalizer: see the docstring); 1: every group is a unit")
parser.add_argument("--normalizer-prompts", type=int, default=8,
                    help="prompts per trainer batch for the token-normalized comparison "
                         "(train.py's --prompts-per-step)")
parser.add_argument("--max-new-tokens", type=int, default=40, help="response length cap")
parser.add_argument("--layers", default="-1.self_attn,-1.mlp",
                    help="one parameter subset per entry, INDEX or INDEX.SUBMODULE of the decoder "
                         "layers (default: the last layer's attention, its MLP), or 'all': two "
                         "disjoint random subsets of the whole parameter vector")
parser.add_argument("--coords", type=int, default=16384,
                    help="random coordinates kept per subset (0: all of the subset's)")
parser.add_argument("--basis", default="coords", choices=("coords", "displacement"),
                    help="coords = --coords random coordinates per subset; displacement = per row "
                         "of each matrix of the subset, the component along theta_pi - theta_ref "
                         "(the directions training moved; all rows, --coords unused)")
parser.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples")
parser.add_argument("--device", default="cpu", help="cpu or cuda")
parser.add_argument("--seed", type=int, default=0, help="seeds prompts, samples, coordinates")
parser.add_argument("--out", default="studies/kl-gradients",
                    help="directory for results.json and results.csv")
parser.add_argument("--figure", default="assets/kl_gradients.png", help="the figure's path")
parser.add_argument("--save-gradients", default=None,
                    help="also save each distance's per-group gradients to DIR/LABEL.pt")
parser.add_argument("--analyze", default=None,
                    help="no sampling: the statistics of the gradients saved in DIR by "
                         "--save-gradients (the same distances and flags)")
parser.add_argument("--replot", action="store_true",
                    help="only redraw --figure from OUT/results.json")


# ---------------------------------------------------------------- the trainer's estimator

def config_loss(name, logp, ref_logp, mask, scores, group_size, beta, num_tokens):
    """The loss train.py minimizes for one configuration, on-policy (old_logp = sg[logp])."""
    kind, place, clamp, to_go = CONFIGS[name]
    # eq. 7: R - beta sum_t sg[KL_t] (reward, both); R otherwise
    returns = kl.shape_rewards(scores, logp, ref_logp, mask, kind, place, beta, clamp)
    advantages = advantage.rloo(returns, group_size)
    if to_go:  # OpenRLHF: A_t = rloo(R) - beta sum_{s>=t} KL_s (docs/peers.md)
        advantages = advantages[:, None] - beta * kl.kl_to_go(logp, ref_logp, mask, kind, clamp)
    pg_loss, _ = advantage.policy_loss(logp, logp.detach(), advantages, mask, num_tokens)
    # eq. 9: + beta sum_t KL_t / num_tokens (loss, both)
    return pg_loss + kl.kl_loss(logp, ref_logp, mask, kind, place, beta, num_tokens, clamp)


def coefficients(logp, ref_logp, mask, scores, group_size, beta=1.0, num_tokens=None, names=None):
    """dloss/dlogp (B, T) of each configuration's loss: the gradient of the loss w.r.t. the
    parameters is sum_{i,t} coefficient_it grad log pi(y_it | x, y<t). The KL rows get score 0."""
    num_tokens = group_size if num_tokens is None else num_tokens
    result = {}
    for name in names or CONFIGS:
        leaf = logp.detach().clone().requires_grad_()
        score = scores if name == "task_pg" else torch.zeros_like(scores)
        loss = config_loss(name, leaf, ref_logp.detach(), mask, score, group_size, beta, num_tokens)
        result[name] = torch.autograd.grad(loss, leaf)[0]
    return result


def group_gradients(logp, params, coefs, subsets):
    """(C, m) per configuration, the gradient of its loss at the subsets' coordinates: one
    vector-Jacobian product of the (B, T) log-probs per configuration; the two "both" rows as the
    sums they are (their coefficients are the sums, test_kl_gradients.py checks it)."""
    rows = {}
    names = [name for name in coefs if name not in SUMS]
    for i, name in enumerate(names):
        grads = torch.autograd.grad(logp, params, grad_outputs=coefs[name],
                                    retain_graph=i < len(names) - 1, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]
        rows[name] = torch.cat([coordinates(grads[j], index) for subset in subsets
                                for j, index in subset])
    for name, parts in SUMS.items():  # place both = the reward's gradient + the loss's, exactly
        if name in coefs:
            rows[name] = rows[parts[0]] + rows[parts[1]]
    return torch.stack([rows[name] for name in coefs]).float().cpu()


def batch_gradients(policy, prompts, tokens, mask, ref_logp, scores, group_size, params, subsets):
    """((groups, C, m), logp): group_gradients for many groups in one pass, and the detached
    log-probs. The rows of each group (one prompt, contiguous) are one pack of
    train.token_logprobs; a Linear's weight gradient is sum_l delta_l a_l^T over the positions l,
    so the per-pack product of its output gradient delta and its input a is that group's gradient.
    Adjacent groups must differ in prompt (else token_logprobs packs them together)."""
    owners = {id(m.weight): m for m in policy.modules() if isinstance(m, torch.nn.Linear)}
    if any(id(p) not in owners or owners[id(p)].bias is not None for p in params):
        raise SystemExit("--batch-groups > 1 needs --layers made of bias-free Linear weights "
                         "and --basis coords")
    modules = [owners[id(p)] for p in params]
    saved = {}
    hooks = [m.register_forward_hook(lambda m, inputs, out: saved.__setitem__(m, (inputs[0], out)))
             for m in modules]
    try:
        logp, _ = train.token_logprobs(policy, prompts, tokens, mask, 1.0, torch.float32)
    finally:
        for hook in hooks:
            hook.remove()
    groups = len(prompts) // group_size
    if len(saved[modules[0]][0]) != groups:
        raise ValueError("adjacent groups share a prompt: token_logprobs packed them together")
    coefs = coefficients(logp.detach(), ref_logp, mask, scores, group_size)
    rows = {}
    names = [name for name in coefs if name not in SUMS]
    for i, name in enumerate(names):
        deltas = torch.autograd.grad(logp, [saved[m][1] for m in modules],
                                     grad_outputs=coefs[name], retain_graph=i < len(names) - 1)
        # (groups, out, in): each pack's gradient of this module's weight
        grads = [torch.bmm(d.transpose(1, 2), saved[m][0].detach()) for m, d in zip(modules, deltas)]
        rows[name] = torch.cat([grads[j].reshape(groups, -1)[:, index] for subset in subsets
                                for j, index in subset], dim=1)
        del grads, deltas
    for name, parts in SUMS.items():
        if name in coefs:
            rows[name] = rows[parts[0]] + rows[parts[1]]
    return torch.stack([rows[name] for name in coefs], dim=1).float().cpu(), logp.detach()


def spread(problems, key):
    """The problems reordered so that no two neighbours have the same key (a prompt drawn twice in
    one batch would be packed with its twin): the most frequent first, into the even slots, then
    the odd ones."""
    counts = {}
    for p in problems:
        counts.setdefault(key(p), []).append(p)
    ordered = [p for group in sorted(counts.values(), key=len, reverse=True) for p in group]
    slots = list(range(0, len(ordered), 2)) + list(range(1, len(ordered), 2))
    result = [None] * len(ordered)
    for slot, p in zip(slots, ordered):
        result[slot] = p
    if any(key(a) == key(b) for a, b in zip(result, result[1:])):
        raise ValueError("one prompt fills over half of a batch: lower --batch-groups")
    return result


def choose_subsets(model, layers, coords, seed, reference=None):
    """(params that need grad, subsets): each subset a list of (index into params, flat coordinate
    indices), `coords` random coordinates of one decoder layer, or of the whole vector ('all').
    With a `reference` (--basis displacement) the entries are (index, theta - theta_ref) instead:
    the coordinates are the gradient's components along the displacement of each row."""
    gen = torch.Generator().manual_seed(seed)
    if layers == "all":
        pools = [list(model.named_parameters())] * 2
    else:  # "INDEX" or "INDEX.SUBMODULE" of model.model.layers
        pools = []
        for entry in layers.split(","):
            index, _, sub = entry.partition(".")
            path = f"model.layers.{int(index) % len(model.model.layers)}" + (f".{sub}" if sub else "")
            pools.append([(f"{path}.{name}", p)
                          for name, p in model.get_submodule(path).named_parameters()])
    params = list(dict.fromkeys(p for pool in pools for _, p in pool))
    position = {id(p): j for j, p in enumerate(params)}
    taken = {}  # 'all': the two subsets are disjoint
    subsets = []
    for pool in pools:
        if reference is not None:
            ref_params = dict(reference.named_parameters())
            subsets.append([(position[id(p)], (p.detach() - ref_params[name].detach()))
                            for name, p in pool])
            continue
        sizes = torch.tensor([p.numel() for _, p in pool])
        total = int(sizes.sum())
        if coords and coords < total:
            flat = torch.randint(total, (4 * coords,), generator=gen).unique()
            flat = flat[torch.randperm(len(flat), generator=gen)]
            flat = flat[~torch.isin(flat, taken.get(id(pool[0]), torch.zeros(0, dtype=torch.long)))]
            flat = flat[:coords].sort().values
        else:
            flat = torch.arange(total)
        taken[id(pool[0])] = torch.cat([taken.get(id(pool[0]), flat[:0]), flat])
        starts = torch.cumsum(sizes, 0) - sizes
        subset = []
        for (_, p), start, size in zip(pool, starts.tolist(), sizes.tolist()):
            inside = flat[(flat >= start) & (flat < start + size)] - start
            if len(inside):
                subset.append((position[id(p)], inside.to(p.device)))
        subsets.append(subset)
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    return params, subsets


def coordinates(grad, index):
    """A subset's coordinates of one parameter's gradient: the kept entries (index: flat long
    indices), or (index: the displacement theta - theta_ref) the component along each row's
    displacement, sum_i g_ri delta_ri (each entry of a vector parameter on its own)."""
    if index.dtype == torch.long:
        return grad.reshape(-1)[index]
    product = grad * index
    return (product.sum(-1) if product.dim() > 1 else product).reshape(-1)


def measure(policy, reference, tokenizer, examples, args, device, label=""):
    """Sample args.groups groups and return the per-group gradients X (n, C, m) and per-sequence
    records (lengths, K1 and K3 sums, scores)."""
    params, subsets = choose_subsets(policy, args.layers, args.coords, args.seed,
                                     reference if args.basis == "displacement" else None)
    stop_ids = stop_token_ids(policy, tokenizer)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    prompt_rng = random.Random(args.seed)
    G, X, seqs = args.group_size, [], {"length": [], "k1": [], "k3": [], "score": []}
    batched, done = args.batch_groups > 1, 0
    bar = tqdm(total=args.groups, desc=f"groups {label}".strip(), mininterval=5)
    while done < args.groups:
        count = min(args.batch_groups if batched else args.prompts_per_batch, args.groups - done)
        problems = [prompt_rng.choice(examples) for _ in range(count)]
        if batched:  # i.i.d. draws; their order within a unit does not matter
            problems = spread(problems, lambda ex: tuple(data.prompt_ids(tokenizer, ex)))
        prompts = [data.prompt_ids(tokenizer, ex) for ex in problems for _ in range(G)]
        with torch.no_grad():
            out = rollout.generate(policy, prompts, args.max_new_tokens, 1.0, 1.0, stop_ids, gen)
        completions = tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
        scores = torch.tensor([data.score(ex, c) for ex, c in
                               zip([ex for ex in problems for _ in range(G)], completions)],
                              dtype=torch.float32, device=device)
        tokens, mask = out.tokens, out.response_mask
        ref_logp, _ = train.no_grad_logprobs(reference, prompts, tokens, mask, 1.0, torch.float32,
                                             len(prompts))
        done += count
        if batched:  # one unit: the mean of `count` groups' gradients
            grads, logp = batch_gradients(policy, prompts, tokens, mask, ref_logp, scores, G,
                                          params, subsets)
            X.append(grads.mean(0))
            with torch.no_grad():
                seqs["length"] += mask.sum(1).tolist()
                seqs["k1"] += (mask * kl.estimate(logp, ref_logp, "k1")).sum(1).tolist()
                seqs["k3"] += (mask * kl.estimate(logp, ref_logp, "k3")).sum(1).tolist()
                seqs["score"] += scores.tolist()
            bar.update(count)
            continue
        for k in range(count):
            rows = slice(k * G, (k + 1) * G)
            T = int(mask[rows].sum(1).max())  # the group's own padding only
            # the gradient pass, fp32 like the trainer's values (train.token_logprobs)
            group_mask, group_ref = mask[rows, :T], ref_logp[rows, :T]
            logp, _ = train.token_logprobs(policy, prompts[rows], tokens[rows, :T], group_mask, 1.0,
                                           torch.float32)
            coefs = coefficients(logp.detach(), group_ref, group_mask, scores[rows], G)
            X.append(group_gradients(logp, params, coefs, subsets))
            with torch.no_grad():
                seqs["length"] += group_mask.sum(1).tolist()
                seqs["k1"] += (group_mask * kl.estimate(logp, group_ref, "k1")).sum(1).tolist()
                seqs["k3"] += (group_mask * kl.estimate(logp, group_ref, "k3")).sum(1).tolist()
                seqs["score"] += scores[rows].tolist()
            bar.update(1)
    bar.close()
    sizes = [sum(len(index) if index.dtype == torch.long else len(index.reshape(len(index), -1))
                 for _, index in subset) for subset in subsets]
    return torch.stack(X), {key: np.array(v) for key, v in seqs.items()}, sizes


# ---------------------------------------------------------------- statistics

def grams(X, names, ref=REF):
    """Gram matrices over groups (float64, (n, n)): Q[c] = <x_kc, x_lc>, R[c] = <x_kc, x_l,ref>."""
    r = names.index(ref)
    Xr = X[:, r].double()
    Q, R = {}, {}
    for c, name in enumerate(names):
        Xc = X[:, c].double()
        Q[name], R[name] = Xc @ Xc.T, Xc @ Xr.T
    return Q, R


def u_inner(G, W, a=None, b=None):
    """Unbiased E[a x] . E[b y] from G[k, l] = <x_k, y_l>: the mean over pairs of draws of two
    different groups, each row of W (B, n) a resample's multiplicities of the n groups (a group
    drawn twice is not two independent draws); a, b fixed row scales."""
    a = torch.ones(G.shape[0], dtype=G.dtype) if a is None else a
    b = torch.ones(G.shape[0], dtype=G.dtype) if b is None else b
    # sum_{k != l} w_k w_l a_k b_l G_kl over sum_{k != l} w_k w_l
    total = ((W * a) @ G * (W * b)).sum(1) - (W ** 2 * a * b * G.diagonal()).sum(1)
    return total / (W.sum(1) ** 2 - (W ** 2).sum(1))


def trace_cov(G, W):
    """tr Cov(x) = E||x||^2 - ||E x||^2 from the Gram G, unbiased, for each resample W (B, n)."""
    return (W * G.diagonal()).sum(1) / W.sum(1) - u_inner(G, W)


def resamples(n, B, seed):
    """(B + 1, n) multiplicities: row 0 the sample itself, then B bootstrap resamples drawn within
    the even and within the odd groups."""
    rng = np.random.default_rng(seed)
    W = np.zeros((B + 1, n))
    W[0] = 1
    for half in (np.arange(0, n, 2), np.arange(1, n, 2)):
        picks = rng.integers(0, len(half), size=(B, len(half)))
        for b in range(B):
            np.add.at(W[b + 1], half[picks[b]], 1)
    return torch.tensor(W)


def token_scales(lengths, group_size, prompts, draws=4000, seed=0):
    """a_k such that mean_k a_k x_k estimates E[sum_k S_k / N] T_bar of trainer batches of `prompts`
    groups (S_k = G x_k, N their token count), batches drawn from the pool without replacement."""
    rng = np.random.default_rng(seed)
    n_tok = lengths.reshape(-1, group_size).sum(1)
    n = len(n_tok)
    alpha = np.zeros(n)
    for _ in range(draws):
        batch = rng.choice(n, size=min(prompts, n), replace=False)
        alpha[batch] += 1 / n_tok[batch].sum()
    alpha /= draws
    return torch.tensor(alpha * n * group_size * lengths.mean())


def summarize(Q, R, W, names, lengths, group_size, a_tok=None, terciles=None):
    """Per configuration: estimates on W[0] and bootstrap 95% intervals over W[1:]."""
    def ci(values, undefined=(-math.inf, math.inf)):
        """[estimate, 2.5%, 97.5%] over the resamples. A resample where the statistic is undefined
        (nan: ||grad KL||^2 or ||E[g]||^2 estimated <= 0, the noise above the signal) counts as
        the worst case on each side, `undefined`: with over 2.5% of them the interval is all."""
        v = values.double().numpy()
        boot = v[1:]
        low = np.percentile(np.where(np.isnan(boot), undefined[0], boot), 2.5, method="lower")
        high = np.percentile(np.where(np.isnan(boot), undefined[1], boot), 97.5, method="higher")
        return [float(v[0]), float(low), float(high)]

    Urr = u_inner(Q[REF], W)
    over_ref = lambda x: torch.where(Urr > 0, x / Urr.abs().clamp(min=1e-300), math.nan)  # noqa
    var_pg = trace_cov(Q["task_pg"], W) * group_size
    positive = (0, math.inf)
    out = {"ref": {"norm": ci(Urr.clamp(min=0).sqrt()),
                   # the reference's own standard error, relative to its norm
                   "rel_se": ci(over_ref(trace_cov(Q[REF], W) / W.sum(1)).sqrt(), positive),
                   # the share of resamples whose ||grad KL||^2 is estimated <= 0
                   "undefined": float((Urr[1:] <= 0).double().mean())}}
    # one sequence's variance of the reference: a positive, well-measured scale
    var_ref = trace_cov(Q[REF], W) * group_size
    out["ref"]["snr"] = ci(Urr / var_ref)  # ||grad KL||^2 / var: 1/n sequences to resolve it
    for name in names:
        Ucc, Ucr = u_inner(Q[name], W), u_inner(R[name], W)
        d2 = Ucc - 2 * Ucr + Urr  # ||E[g_c] - grad KL||^2, unbiased
        # a ratio of unbiased quadratic forms can pass 1: clipped to [-1, 1]
        cos = torch.where((Ucc > 0) & (Urr > 0), Ucr / (Ucc.abs() * Urr.abs()).clamp(min=1e-300)
                          .sqrt(), math.nan).clamp(-1, 1)
        var = trace_cov(Q[name], W) * group_size
        row = {"cos": ci(cos, (-1, 1)), "proj": ci(over_ref(Ucr)),
               "rel_err": ci(over_ref(d2.clamp(min=0)).sqrt(), positive),
               "rel_err2": ci(over_ref(d2)), "norm_ratio": ci(over_ref(Ucc.clamp(min=0)).sqrt(),
                                                             positive),
               "var": ci(var), "var_ratio": ci(var / var_pg), "var_rel": ci(over_ref(var), positive),
               # in units of the reference's one-sequence variance (defined whatever the noise):
               # ||E[g_c]||^2 and ||E[g_c] - grad KL||^2; an interval above 0 detects them
               "snr": ci(Ucc / var_ref), "bias_snr": ci(d2 / var_ref)}
        if a_tok is not None:  # the trainer's token-normalized E[g] against grad KL
            Ut = u_inner(Q[name], W, a_tok, a_tok)
            Utr = u_inner(R[name], W, a_tok, None)
            row["tok_rel_err"] = ci(over_ref((Ut - 2 * Utr + Urr).clamp(min=0)).sqrt(), positive)
            row["tok_cos"] = ci(torch.where((Ut > 0) & (Urr > 0), Utr / (Ut.abs() * Urr.abs())
                                            .clamp(min=1e-300).sqrt(), math.nan).clamp(-1, 1),
                                (-1, 1))
            # ||E[g_tok] - E[g]|| / ||grad KL||: the normalizer's own effect
            D = a_tok - 1
            row["tok_shift"] = ci(over_ref(u_inner(Q[name], W, D, D).clamp(min=0)).sqrt(),
                                  positive)
        if terciles is not None:
            row["by_length"] = []
            for index in terciles:
                w = torch.zeros(W.shape[1], dtype=W.dtype)
                w[index] = 1
                Wt = W * w
                diff = Q[name] - R[name] - R[name].T + Q[REF]
                row["by_length"].append({
                    "mean_length": float(lengths.reshape(-1, group_size)[index].mean()),
                    "var": ci(trace_cov(Q[name], Wt) * group_size),
                    "rel_bias": ci(over_ref(u_inner(diff, Wt).clamp(min=0)).sqrt(), positive)})
        out[name] = row
    return out


def halves_check(Q, R, W, names=UNBIASED[1:], scale=None):
    """||E[g_c] - grad KL||^2 / ||grad KL||^2 with g_c from one half of the groups (even, odd) and
    K1-in-reward from the other: independent samples, so Table 1 predicts 0 within the interval.
    With a `scale` (B + 1,), the squared distance over it instead of over ||grad KL||^2."""
    n = Q[REF].shape[0]
    even, odd = torch.arange(n) % 2 == 0, torch.arange(n) % 2 == 1
    Urr = u_inner(Q[REF], W)
    result = {}
    for name in names:
        d2 = 0
        for A, B in ((even, odd), (odd, even)):
            WA, WB = W * A, W * B
            cross = ((WA @ R[name]) * WB).sum(1) / (WA.sum(1) * WB.sum(1))
            d2 = d2 + 0.5 * (u_inner(Q[name], WA) + u_inner(Q[REF], WB) - 2 * cross)
        v = (torch.where(Urr > 0, d2 / Urr.abs().clamp(min=1e-300), math.nan) if scale is None
             else d2 / scale).numpy()
        boot = v[1:]  # undefined resamples (||grad KL||^2 estimated <= 0) count as the worst case
        result[name] = [float(v[0]),
                        float(np.percentile(np.where(np.isnan(boot), -math.inf, boot), 2.5,
                                            method="lower")),
                        float(np.percentile(np.where(np.isnan(boot), math.inf, boot), 97.5,
                                            method="higher"))]
    return result


def analyze(X, seqs, names, sizes, args):
    """All statistics of one distance: pooled subsets, each subset alone, the halves check."""
    n, G = X.shape[0], args.group_size
    W = resamples(n, args.bootstrap, args.seed)
    lengths = seqs["length"]
    a_tok = terciles = None
    if args.batch_groups == 1:
        a_tok = token_scales(lengths, G, args.normalizer_prompts, seed=args.seed)
        group_len = lengths.reshape(-1, G).mean(1)
        order = np.argsort(group_len, kind="stable")
        terciles = [torch.tensor(t) for t in np.array_split(order, 3)]
    G = G * args.batch_groups  # sequences per unit: one sequence's variance is G tr Cov(unit)
    Q, R = grams(X, names)
    result = {"pooled": summarize(Q, R, W, names, lengths, G, a_tok, terciles),
              "halves_check": halves_check(Q, R, W),
              # the same in units of K1-in-reward's one-sequence variance
              "halves_check_snr": halves_check(Q, R, W, scale=trace_cov(Q[REF], W) * G),
              "subsets": []}
    start = 0
    for size in sizes:
        Qs, Rs = grams(X[:, :, start:start + size], names)
        result["subsets"].append(summarize(Qs, Rs, W, names, lengths, G))
        start += size
    return result


# ---------------------------------------------------------------- driver

def policies(args):
    """[(label, policy path)]: --policy, or the no-KL run's step_N checkpoints (trained if
    absent)."""
    if args.policy:
        return [(Path(args.policy).name, args.policy)]
    steps = [int(s) for s in args.steps.split(",")]
    train_dir = Path(args.train_dir)
    missing = [s for s in steps if not (train_dir / f"step_{s}").exists()]
    if missing:
        every = math.gcd(*steps)
        print(f"training pi: {max(steps)} no-KL steps into {train_dir} (train.py's defaults)")
        train.main(["--kl", "k1", "--place", "none", "--model", args.model,
                    "--steps", str(max(steps)), "--save-every", str(every), "--seed",
                    str(args.seed), "--out", str(train_dir)])
    return [(f"step {s}", str(train_dir / f"step_{s}")) for s in steps]


def line(label, name, row):
    f = lambda v: f"{v[0]:.3f} [{v[1]:.3f}, {v[2]:.3f}]"  # noqa: E731
    return (f"{label:>8} {name:<15} cos {f(row['cos'])}  rel.err {f(row['rel_err'])}  "
            f"var/var(task) {f(row['var_ratio'])}")


def write_csv(results, path):
    keys = ("cos", "proj", "rel_err", "norm_ratio", "var", "var_ratio", "tok_rel_err", "tok_shift")
    header = ["distance", "kl_k1", "kl_k3", "subset", "config"] + [
        f"{k}{s}" for k in keys for s in ("", "_low", "_high")]
    lines = [",".join(header)]
    for dist in results["distances"]:
        for subset, table in [("pooled", dist["pooled"])] + [
                (f"subset{i}", t) for i, t in enumerate(dist["subsets"])]:
            for name in CONFIGS:
                row = table[name]
                values = [f"{x:.6g}" for k in keys for x in row.get(k, [math.nan] * 3)]
                lines.append(",".join([dist["label"], f"{dist['kl_k1'][0]:.4f}",
                                       f"{dist['kl_k3'][0]:.4f}", subset, name] + values))
    Path(path).write_text("\n".join(lines) + "\n")


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dists = results["distances"]
    x = np.array([d["kl_k1"][0] for d in dists])
    # only what 512 sequences resolve: cosines and relative errors divide by ||grad KL||^2, whose
    # interval reaches 0 (their unbounded intervals are in the tables, not drawn)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    kl_names = [n for n in CONFIGS if n != "task_pg"]
    for i, name in enumerate(kl_names):
        style = dict(color=f"C{i}", marker="o", ms=3, ls="--" if name in UNBIASED else "-",
                     capsize=2, label=name)
        shift = (i - len(kl_names) / 2) * 0.012 * (x.max() - x.min() + 0.1)  # side by side
        for ax, key in zip(axes[:2], ("var_ratio", "bias_snr")):
            v = np.array([d["pooled"][name][key] for d in dists], dtype=float)
            ax.errorbar(x + shift, v[:, 0], yerr=[v[:, 0] - v[:, 1], v[:, 2] - v[:, 0]], **style)
    snr = np.array([d["pooled"]["ref"]["snr"] for d in dists])
    axes[2].errorbar(x, snr[:, 0], yerr=[snr[:, 0] - snr[:, 1], snr[:, 2] - snr[:, 0]], color="k",
                     marker="o", capsize=2)
    for ax in axes[1:]:
        ax.axhline(0, color="grey", lw=0.8)
    xlabel = "KL(pi || pi_ref), nats per sequence (K1)"
    axes[0].set(xlabel=xlabel, yscale="log", title="variance / task policy gradient's")
    axes[1].set(xlabel=xlabel, title="bias: ||E[g] - grad KL||^2 / var_ref")
    axes[1].set_yscale("symlog", linthresh=1e-3)
    axes[2].set(xlabel=xlabel, title="signal: ||grad KL||^2 / var_ref")
    axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"Table 1 on {results['model']}, {results['groups']} groups of "
                 f"{results['group_size']} per distance, beta = 1, 95% bootstrap intervals; "
                 "var_ref = one sequence's variance of K1-in-reward", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=70)


def main(argv=None):
    args = parser.parse_args(argv)
    if args.groups % args.batch_groups:
        parser.error("--groups must be a multiple of --batch-groups (units of equal size)")
    if args.replot:
        results = json.loads((Path(args.out) / "results.json").read_text())
        plot(results, args.figure)
        return results
    start = time.time()
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    tokenizer = load_tokenizer(args.model)
    examples = data.load_task("arith", split="test")
    targets = policies(args) if not args.analyze else [
        (f"step {s}", str(Path(args.train_dir) / f"step_{s}")) for s in args.steps.split(",")]
    if args.analyze and args.policy:
        targets = [(Path(args.policy).name, args.policy)]
    reference = None if args.analyze else load_model(args.model, torch.float32).to(device)
    reference = reference and reference.requires_grad_(False)
    names = list(CONFIGS)
    prior = {}  # --analyze: the measuring run's timing and memory, from its results.json
    if args.analyze and (Path(args.out) / "results.json").exists():
        prior = json.loads((Path(args.out) / "results.json").read_text())
    results = {"model": args.model, "groups": args.groups, "group_size": args.group_size,
               "flags": vars(args), "distances": []}
    # the CPU and dtypes: train.py samples pi's training batches in bf16 where the CPU has it, and
    # bf16 rounds differently on other CPUs, so another kind of machine trains another pi
    train_config = Path(args.train_dir) / "config.json"
    train_dtype = (json.loads(train_config.read_text()).get("dtype")
                   if train_config.is_file() and not args.policy else None)
    results["machine"] = prior.get("machine") or study.machine(
        "kl_gradients", train_dtype, "float32", torch.get_num_threads())
    for label, path in targets:
        t0 = time.time()
        policy = None
        if args.analyze:  # the saved gradients, and the measuring run's own timing
            saved = torch.load(Path(args.analyze) / f"{label.replace(' ', '_')}.pt",
                               weights_only=False)
            X, seqs, sizes = saved["X"], saved["seqs"], saved["sizes"]
            t0 -= saved.get("seconds", 0.0)
        else:
            policy = load_model(path, torch.float32).to(device)
            policy.eval()
            X, seqs, sizes = measure(policy, reference, tokenizer, examples, args, device, label)
        if args.save_gradients:
            Path(args.save_gradients).mkdir(parents=True, exist_ok=True)
            torch.save({"X": X, "seqs": seqs, "sizes": sizes, "seconds": time.time() - t0},
                       Path(args.save_gradients) / f"{label.replace(' ', '_')}.pt")
        stats = analyze(X, seqs, names, sizes, args)
        mean_se = lambda v: [float(v.mean()), float(v.std(ddof=1) / math.sqrt(len(v)))]  # noqa
        dist = {"label": label, "policy": path, "kl_k1": mean_se(seqs["k1"]),
                "kl_k3": mean_se(seqs["k3"]), "response_len": mean_se(seqs["length"]),
                "accuracy": mean_se(seqs["score"]), "coords": sizes, "seconds": time.time() - t0,
                **stats}
        for before in prior.get("distances", []):
            if before["label"] == label and args.analyze:
                dist["seconds"] = before["seconds"]
        results["distances"].append(dist)
        ref = stats["pooled"]["ref"]
        print(f"{label}: KL(pi || pi_ref) = {dist['kl_k1'][0]:.3f} +- {dist['kl_k1'][1]:.3f} (K1), "
              f"{dist['kl_k3'][0]:.3f} +- {dist['kl_k3'][1]:.3f} (K3) nats per sequence, "
              f"length {dist['response_len'][0]:.1f}; grad KL's relative standard error "
              f"{ref['rel_se'][0]:.3f}; {time.time() - t0:.0f} s")
        for name in names:
            print(line(label, name, stats["pooled"][name]))
        check = ", ".join(f"{k} {v[0]:+.3f} [{v[1]:+.3f}, {v[2]:+.3f}]"
                          for k, v in stats["halves_check"].items())
        print(f"{label:>8} independent halves, ||E[g] - grad KL||^2 / ||grad KL||^2: {check}")
        del policy
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
        results.update(seconds=time.time() - start, peak_rss_gib=peak)
        if "seconds" in prior:
            results.update(seconds=prior["seconds"], peak_rss_gib=prior["peak_rss_gib"])
        out = Path(args.out)  # written after each distance: a stopped run keeps what it measured
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(results, indent=1))
        write_csv(results, out / "results.csv")
    if args.figure:
        Path(args.figure).parent.mkdir(parents=True, exist_ok=True)
        plot(results, args.figure)
    print(f"{time.time() - start:.0f} s, peak resident memory {peak:.2f} GiB; "
          f"{out / 'results.json'}, {out / 'results.csv'}, {args.figure}")
    return results


if __name__ == "__main__":
    main()
