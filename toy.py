"""The paper's toy model (sec. 3.3, appendix C), run through the real kl.py and advantage.py.

Binary sequences y_1..y_T from p_t = sigmoid(a + b c_{t-1}), c_{t-1} = y_1 + ... + y_{t-1}
(eqs. 17-18).

1. Figure 1: the squared bias and the variance of the Monte-Carlo gradient of the KL term (R = 0,
   beta = 1, no baseline), for each configuration (estimator x place), against the exact gradient of
   KL(A || B), over the length T: `trials` trials of N = `samples` sequences drawn from A.
2. Convergence: a tabular policy (one logit per prefix, so the optimum pi* ~ pi_ref exp(R / beta) is
   reachable) climbs E[R] - beta KL(pi || pi_ref) with each configuration's *exact expected*
   gradient, summing over all 2^T sequences: where each configuration's mean update leads. Table 1's
   "Behavior" column is sec. 4.1's LLM runs, which sampled gradients also shape (sec. 4.1's
   "potential explanation" of K1-in-loss's instabilities is variance); exact-gradient descent
   cannot show that.

    python toy.py --out DIR
        # figure1.{json,png}, converge.{json,png}, offpolicy.{json,png}, weight_controls.json
        # and their tables; ~1.5 min on 2 cores
"""

import argparse
import itertools
import json
import math
import pathlib

import torch
import torch.nn.functional as F

from advantage import policy_loss
from kl import MAX_LOG_W, estimate, kl_loss, kl_to_go, off_policy_kl_loss, shape_rewards

parser = argparse.ArgumentParser(description="The paper's toy model: Fig. 1 and where each KL "
                                             "configuration converges.")
parser.add_argument("--out", required=True,
                    help="directory for figure1.json/.png and converge.json/.png")
parser.add_argument("--trials", type=int, default=200,
                    help="Monte-Carlo trials per point of Fig. 1")
parser.add_argument("--samples", type=int, default=1000, help="sequences per trial (N in sec. 3.3)")
parser.add_argument("--seed", type=int, default=0, help="random seed of the Monte-Carlo samples")
parser.add_argument("--fast", action="store_true",
                    help="a short run for the tests: T <= 8, fewer steps")

CONFIGS = {"k1_reward": ("k1", "reward"), "k1_loss": ("k1", "loss"), "k3_reward": ("k3", "reward"),
           "k3_loss": ("k3", "loss"), "k1_both": ("k1", "both"), "k3_both": ("k3", "both"),
           "k2_loss": ("k2", "loss")}
THETA, REF = (0.5, -0.2), (0.0, -0.3)  # (a, b) of the policy A, (a~, b~) of the reference B
BETA, LR = 0.2, 8.0  # KL coefficient and step size of the convergence study
f64 = torch.float64  # everything in double precision


def bernoulli_logp(logits, y):
    """log p(y_t | y_<t) per token, for binary tokens with P(y_t = 1 | y_<t) = sigmoid(logits)."""
    return y * F.logsigmoid(logits) + (1 - y) * F.logsigmoid(-logits)


def toy_logits(a, b, y):
    # eq. 17: p_t = sigmoid(a + b c_{t-1}),  c_{t-1} = sum_{k<t} y_k
    return a + b * (y.cumsum(-1) - y)


def sample(a, b, shape, T, generator):
    y, c = torch.zeros(*shape, T, dtype=f64), torch.zeros(shape, dtype=f64)
    for t in range(T):
        y[..., t] = torch.bernoulli(torch.sigmoid(a + b * c), generator=generator)  # eq. 17
        c += y[..., t]
    return y


def exact_kl(a, b, T):
    """KL(A || B) exactly (eq. 20), by dynamic programming over c_{t-1}; differentiable in
    (a, b)."""
    c = torch.arange(T + 1, dtype=f64)
    prob_c, kl = (c == 0).double(), 0.0  # P(c_{t-1} = c), starting from c_0 = 0
    for _ in range(T):
        z, z_ref = a + b * c, REF[0] + REF[1] * c
        # chain rule: KL(A || B) = sum_t E_{c_{t-1} ~ A}[ KL(Bern(p_t^A) || Bern(p_t^B)) ]
        p = torch.sigmoid(z)
        kl_t = (p * (F.logsigmoid(z) - F.logsigmoid(z_ref))
                + (1 - p) * (F.logsigmoid(-z) - F.logsigmoid(-z_ref)))
        kl = kl + (prob_c * kl_t).sum()
        prob_c = prob_c * (1 - p) + F.pad(prob_c * p, (1, 0))[:-1]
    return kl


def training_loss(logp, ref_logp, scores, kind, place, beta, weight, num_tokens):
    """What train.py minimizes, on-policy: PPO-clip on KL-shaped returns (eq. 7) + the KL loss
    (eq. 9).

    `weight` (B, 1) scales each sequence through the mask: 1 for samples, pi(y) for an exact
    expectation.
    """
    mask = torch.ones_like(logp)
    returns = shape_rewards(scores, logp, ref_logp, mask, kind, place, beta)
    pg_loss, _ = policy_loss(logp, logp.detach(), returns, weight * mask, num_tokens)
    return pg_loss + kl_loss(logp, ref_logp, weight * mask, kind, place, beta, num_tokens)


# ---- variable lengths: the toy model with an end-of-sequence token (test_kl.py, lab/check_kl.py)

EOS = 2  # token code of the stop token; 0 and 1 are the toy's binary tokens


def toy_with_eos(T, theta, ref):
    """Every response of the toy model with a stop token: at each step EOS with probability
    sigmoid(e), else y_t ~ Bernoulli(sigmoid(a + b c_{t-1})) (eq. 17). A response ends with its EOS
    (a token of the response, as in train.py's response_mask) or at T tokens: sum_{k<T} 2^k + 2^T
    responses, padded to T."""
    rows = [[*bits, EOS] for k in range(T) for bits in itertools.product([0, 1], repeat=k)]
    rows += [list(bits) for bits in itertools.product([0, 1], repeat=T)]
    tokens = torch.tensor([row + [0] * (T - len(row)) for row in rows], dtype=f64)
    mask = torch.tensor([[1.0] * len(row) + [0.0] * (T - len(row)) for row in rows], dtype=f64)
    y = (tokens == 1).double()
    c = y.cumsum(-1) - y  # c_{t-1}
    params = [torch.tensor(v, dtype=f64, requires_grad=True) for v in theta]

    def next_token_logp(a, b, e):
        """(responses, T, 3): log P(token v | prefix) for v = 0, 1, EOS at every position."""
        z = a + b * c
        keep = F.logsigmoid(-torch.as_tensor(e, dtype=f64))
        return torch.stack([keep + F.logsigmoid(-z), keep + F.logsigmoid(z),
                            F.logsigmoid(torch.as_tensor(e, dtype=f64)).expand_as(z)], -1)

    dist, ref_dist = next_token_logp(*params), next_token_logp(*ref)
    pick = lambda d: d.gather(-1, tokens.long()[..., None])[..., 0] * mask  # noqa: E731
    return dict(params=params, mask=mask, dist=dist, ref_dist=ref_dist, logp=pick(dist),
                ref_logp=pick(ref_dist))


def figure1(lengths, trials, samples, seed, chunk=50):
    """Bias^2 and variance (summed over a, b) of the N-sample gradient of the KL term
    (beta = 1, R = 0)."""
    gen = torch.Generator().manual_seed(seed)
    result = {"T": list(lengths), "configs": {name: {"bias2": [], "var": []} for name in CONFIGS}}
    for T in lengths:
        a, b = (torch.tensor(v, dtype=f64, requires_grad=True) for v in THETA)
        exact = torch.stack(torch.autograd.grad(exact_kl(a, b, T), (a, b)))  # eq. 23
        grads = {name: [] for name in CONFIGS}
        # one (a, b) per trial, so autograd gives per-trial gradients
        for start in range(0, trials, chunk):
            n = min(chunk, trials - start)
            a, b = (torch.full((n, 1, 1), v, dtype=f64, requires_grad=True) for v in THETA)
            y = sample(*THETA, (n, samples), T, gen)
            logp = bernoulli_logp(toy_logits(a, b, y), y).reshape(n * samples, T)
            ref_logp = bernoulli_logp(toy_logits(*REF, y), y).reshape(n * samples, T)
            no_reward = torch.zeros(n * samples, dtype=f64)
            for name, (kind, place) in CONFIGS.items():
                # the loss is the mean over the N sequences of each trial: num_tokens = N, beta = 1
                loss = training_loss(logp, ref_logp, no_reward, kind, place, 1.0, 1.0,
                                     num_tokens=samples)
                grad_a, grad_b = torch.autograd.grad(loss, (a, b), retain_graph=True)
                grads[name].append(torch.cat([grad_a, grad_b], 1).reshape(n, 2))
        for name in CONFIGS:
            g = torch.cat(grads[name])
            result["configs"][name]["bias2"].append(((g.mean(0) - exact) ** 2).sum().item())
            result["configs"][name]["var"].append(g.var(0).sum().item())
    return result


def all_sequences(T):
    """All 2^T binary sequences and, per token, the index of its prefix's logit
    (a binary tree, root 0)."""
    y = ((torch.arange(2**T)[:, None] >> torch.arange(T - 1, -1, -1)) & 1).double()
    node = torch.zeros(2**T, T, dtype=torch.long)
    for t in range(1, T):
        node[:, t] = 2 * node[:, t - 1] + 1 + y[:, t - 1].long()
    return y, node


def expected_gradient(kind, place, T, theta=THETA, ref=REF):
    """E_pi[grad of the KL term] of one configuration (beta = 1, R = 0), exactly, as a (2,) tensor
    in (a, b): all 2^T sequences, each weighted by its detached probability pi(y), through the real
    training_loss. Table 1 by enumeration: k1 reward -> grad KL, k1 loss -> 0, k3 reward -> eq. 15
    (grad KL plus eq. 19's bias term), k3 loss -> eq. 41."""
    y, _ = all_sequences(T)
    a, b = (torch.tensor(v, dtype=f64, requires_grad=True) for v in theta)
    logp = bernoulli_logp(toy_logits(a, b, y), y)
    ref_logp = bernoulli_logp(toy_logits(*ref, y), y)
    weight = logp.sum(-1, keepdim=True).exp().detach()  # pi(y): the weighted sum is E_pi
    no_reward = torch.zeros(len(y), dtype=f64)
    loss = training_loss(logp, ref_logp, no_reward, kind, place, 1.0, weight, num_tokens=1)
    return torch.stack(torch.autograd.grad(loss, (a, b)))


def kl_gradient_moments(T, to_go, theta=THETA, ref=REF):
    """The K1-in-reward gradient of one sequence (beta = 1, R = 0), with the whole sequence's K1 in
    every token's return (eq. 8) or the K1 to go (kl.kl_to_go), exactly over all 2^T sequences:
    (mean (2,), variance = trace of the covariance over (a, b)). Both means are grad KL."""
    y, _ = all_sequences(T)
    logits = toy_logits(*theta, y)
    logp = bernoulli_logp(logits, y)
    ref_logp = bernoulli_logp(toy_logits(*ref, y), y)
    mask = torch.ones_like(logp)
    if to_go:
        k1 = kl_to_go(logp, ref_logp, mask, "k1")
    else:
        k1 = estimate(logp, ref_logp, "k1").sum(-1, keepdim=True).expand_as(logp)
    # grad_(a, b) log pi(y_t | y<t) = (y_t - p_t) (1, c_{t-1})
    c = y.cumsum(-1) - y
    score = (y - torch.sigmoid(logits))[..., None] * torch.stack([torch.ones_like(c), c], -1)
    g = (k1[..., None] * score).sum(1)  # (2^T, 2): sum_t K1(t) grad log pi(y_t | y<t)
    return moments(g, logp.sum(-1).exp())


def moments(g, p):
    """(mean (2,), variance = trace of the covariance) of one sample's gradient g (2^T, 2) when
    sequence i is drawn with probability p_i."""
    mean = (p[:, None] * g).sum(0)
    return mean, (p[:, None] * (g - mean) ** 2).sum().item()


def converge(T, steps, beta=BETA, lr=LR):
    """Gradient descent on the tabular logits with each configuration's exact expected gradient."""
    y, node = all_sequences(T)
    ref_logits = torch.zeros(2**T - 1, dtype=f64)
    ref_logits[node] = toy_logits(*REF, y)  # pi_ref is the toy reference B, written as a table
    ref_logp = bernoulli_logp(ref_logits[node], y)
    reward = (y.sum(-1) == T - 1).double()  # a sparse 0/1 "verifier": exactly T - 1 ones
    # pi* = pi_ref exp(R / beta) / Z,
    # and E_pi[R] - beta KL(pi || pi_ref) = beta log Z - beta KL(pi || pi*)
    log_z = torch.logsumexp(ref_logp.sum(-1) + reward / beta, 0)
    opt_logp = ref_logp.sum(-1) + reward / beta - log_z

    def metrics(seq_logp):
        pi = seq_logp.exp()
        kl_ref, kl_opt = ((pi * (seq_logp - ref_logp.sum(-1))).sum(),
                          (pi * (seq_logp - opt_logp)).sum())
        return {"expected_reward": (pi * reward).sum().item(), "kl_to_ref": kl_ref.item(),
                "kl_to_optimum": kl_opt.item(),
                "objective": (pi * reward).sum().item() - beta * kl_ref.item()}

    result, history = {"optimum": {**metrics(opt_logp), "beta": beta, "T": T}, "configs": {}}, {}
    for name, (kind, place) in {**CONFIGS, "no_kl": ("k1", "none")}.items():
        logits, history[name], diverged = ref_logits.clone().requires_grad_(), [], False
        for step in range(steps + 1):
            logp = bernoulli_logp(logits[node], y)
            if step < 100 or step % 10 == 0:
                history[name].append({"step": step, **metrics(logp.sum(-1).detach())})
            # pi(y): the weighted sum is E_pi exactly
            weight = logp.sum(-1, keepdim=True).exp().detach()
            loss = training_loss(logp, ref_logp, reward, kind, place, beta, weight, num_tokens=1)
            new_logits = logits - lr * torch.autograd.grad(loss, logits)[0]
            # diverged: a logit ran off (a token probability below e^-50) or became inf/nan
            if not new_logits.isfinite().all() or new_logits.abs().max() > 50:
                diverged = True
                break
            logits = new_logits.detach().requires_grad_()
        final = metrics(bernoulli_logp(logits[node], y).sum(-1).detach())
        result["configs"][name] = {**final, "diverged": diverged}
    return result, history


def off_policy_variance(T, drifts):
    """The price of the unbiased off-policy KL gradient (kl.off_policy_kl_loss, --place weighted):
    samples of mu = A with its `a` moved by `drift`, for the gradient of KL(A || B) in (a, b).
    Exact, over all 2^T sequences, through the real off_policy_kl_loss (beta = 1, one sequence): its
    mean (grad KL at every drift: unbiased), the variance of one sample's gradient
    (trace over (a, b)), and E_mu[w^2] = 1 + chi^2(A || mu), how many samples of mu one sample of A
    is worth."""
    y, _ = all_sequences(T)
    a, b = (torch.tensor(v, dtype=f64, requires_grad=True) for v in THETA)
    logp = bernoulli_logp(toy_logits(a, b, y), y)
    ref_logp = bernoulli_logp(toy_logits(torch.tensor(REF[0], dtype=f64), REF[1], y), y)
    true = torch.stack(torch.autograd.grad(exact_kl(a, b, T), (a, b)))
    rows = []
    for drift in drifts:
        mu_logp = bernoulli_logp(toy_logits(THETA[0] + drift, THETA[1], y), y)
        # one sample's gradient: the loss of each sequence alone, mask 1 (num_tokens = 1)
        grads = []
        for i in range(len(y)):
            loss = off_policy_kl_loss(logp[i:i + 1], mu_logp[i:i + 1], ref_logp[i:i + 1],
                                      torch.ones(1, T, dtype=f64), 1.0, 1)
            grads.append(torch.stack(torch.autograd.grad(loss, (a, b), retain_graph=True)))
        mu = mu_logp.sum(-1).exp()
        mean, variance = moments(torch.stack(grads), mu)
        w = (logp.detach() - mu_logp).sum(-1).exp()
        rows.append({"drift": drift, "bias": (mean - true).abs().max().item(), "variance": variance,
                     "second_moment_w": (mu * w**2).sum().item()})
    return rows


def weight_controls(T, drifts, cap=8.0, n=32, batches=20000, seed=0):
    """What the variance controls of --is-weight give up (kl.off_policy_kl_loss, beta = 1): samples
    of mu = A with its `a` moved by `drift`, gradient of KL(A || B) in (a, b), a batch of n
    sequences. Per weight: the relative bias ||E[g] - grad KL|| / ||grad KL|| and the variance
    (trace) of the batch's gradient g. exact (w) and truncated (min(w, cap)) are exact over 2^T
    sequences; self-normalized (w_i / mean_j w_j) is biased by the batch's own normalizer, so its
    mean is over `batches` sampled batches (with the bias's standard error)."""
    y, _ = all_sequences(T)
    a, b = (torch.tensor(v, dtype=f64, requires_grad=True) for v in THETA)
    logp = bernoulli_logp(toy_logits(a, b, y), y)
    ref_logp = bernoulli_logp(toy_logits(torch.tensor(REF[0], dtype=f64), REF[1], y), y)
    true = torch.stack(torch.autograd.grad(exact_kl(a, b, T), (a, b)))
    generator, ones, rows = torch.Generator().manual_seed(seed), torch.ones(1, T, dtype=f64), []
    for drift in drifts:
        mu_logp = bernoulli_logp(toy_logits(THETA[0] + drift, THETA[1], y), y)
        mu = mu_logp.sum(-1).exp()
        row = {"drift": drift}
        for name, max_log_w in (("exact", MAX_LOG_W), ("truncated", math.log(cap))):
            grads = torch.stack([torch.stack(torch.autograd.grad(off_policy_kl_loss(
                logp[i:i + 1], mu_logp[i:i + 1], ref_logp[i:i + 1], ones, 1.0, 1, max_log_w),
                (a, b), retain_graph=True)) for i in range(len(y))])
            mean, variance = moments(grads, mu)
            row[name] = {"bias": ((mean - true).norm() / true.norm()).item(),
                         "variance": variance / n}
            if name == "exact":  # w_i K1_i grad log pi(y_i): h_i, the same without its weight
                log_w = (logp.detach() - mu_logp).sum(-1)
                h = grads / log_w.exp()[:, None]
        # the self-normalized gradient of a batch: mean_i (w_i / mean_j w_j) h_i
        batch = torch.multinomial(mu, batches * n, True, generator=generator).view(batches, n)
        w = (log_w[batch] - log_w[batch].logsumexp(1, keepdim=True)).exp() * n
        estimates = (w[..., None] * h[batch]).mean(1)
        mean = estimates.mean(0)
        row["self_normalized"] = {
            "bias": ((mean - true).norm() / true.norm()).item(),
            "bias_stderr": (estimates.std(0).norm() / batches ** 0.5 / true.norm()).item(),
            "variance": estimates.var(0).sum().item()}
        rows.append(row)
    return rows


def plot(fig1, conv, history, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    style = lambda name: dict(ls="--" if "both" in name else "-",
                              color=f"C{list(history).index(name)}")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, key, title in zip(axes, ("bias2", "var"),
                              ("squared bias of the gradient", "variance of the gradient")):
        for name, stats in fig1["configs"].items():
            ax.plot(fig1["T"], stats[key], marker="o", ms=3, label=name, **style(name))
        ax.set(xscale="log", yscale="log", xlabel="sequence length T", title=title)
        ax.set_xticks(fig1["T"], [str(t) for t in fig1["T"]])
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "figure1.png", dpi=90)

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, rows in history.items():
        kl, reward = [h["kl_to_ref"] for h in rows], [h["expected_reward"] for h in rows]
        axes[0].plot(kl, reward, label=name, **style(name))
        axes[0].plot(kl[-1], reward[-1], "x" if conv["configs"][name]["diverged"] else "o",
                     color=style(name)["color"])
        axes[1].plot([h["step"] for h in rows], [max(h["kl_to_optimum"], 1e-12) for h in rows],
                     **style(name))
    opt = conv["optimum"]
    axes[0].plot(opt["kl_to_ref"], opt["expected_reward"], "k*", ms=12, label="optimum pi*")
    title = f"paths from pi_ref, beta = {opt['beta']} (x: diverged)"
    axes[0].set(xlabel="KL(pi || pi_ref)", ylabel="E[R]", title=title)
    axes[1].set(xscale="symlog", yscale="log", xlabel="gradient step", ylabel="KL(pi || pi*)",
                title="distance to pi*")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "converge.png", dpi=90)


def plot_offpolicy(rows, out):
    """offpolicy.png: --place weighted's one-sample gradient variance and E_mu[w^2], by drift."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drift = [row["drift"] for row in rows]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(drift, [row["variance"] for row in rows], "o-",
            label="variance of one sample's gradient")
    ax.plot(drift, [row["second_moment_w"] for row in rows], "s--", label="E_mu[w^2] = 1 + chi^2")
    ax.set(yscale="log", xlabel="drift of mu from pi (a + drift)",
           title="unbiased off-policy KL gradient: its price")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "offpolicy.png", dpi=90)

def main(argv=None):
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lengths, T, steps = ((1, 2, 4, 8), 4, 300) if args.fast else ((1, 2, 4, 8, 16, 32, 64), 6, 3000)
    torch.set_num_threads(1)  # small tensors and a shared CPU: extra threads only add overhead

    fig1 = figure1(lengths, args.trials, args.samples, args.seed)
    print(f"Fig. 1: bias^2 | variance of the gradient of KL(A || B), {args.trials} trials "
          f"of N = {args.samples}")
    print(f"{'T =':>10}" + "".join(f"{t:>18} " for t in fig1["T"]))
    for name, stats in fig1["configs"].items():
        print(f"{name:>10}" + "".join(f"{b:>9.1e}|{v:<9.1e}"
                                      for b, v in zip(stats["bias2"], stats["var"])))

    conv, history = converge(T, steps)
    print(f"\nWhere each configuration lands: T = {T}, beta = {BETA}, {steps} steps of exact "
          "expected gradients")
    print(f"{'':>10}{'E[R]':>10}{'KL(ref)':>10}{'KL(pi*)':>10}{'objective':>10}  diverged")
    for name, row in {"optimum": {**conv["optimum"], "diverged": False}, **conv["configs"]}.items():
        numbers = (row[k] for k in ("expected_reward", "kl_to_ref", "kl_to_optimum", "objective"))
        print(f"{name:>10}" + "".join(f"{v:>10.4f}" for v in numbers) + f"  {row['diverged']}")

    drifts = (0.0, 0.25, 0.5, 1.0, 2.0)
    offpolicy = off_policy_variance(4 if args.fast else 8, drifts)
    print("\nOff-policy, --place weighted: samples of mu = A with a + drift, "
          "exact over 2^T sequences")
    print(f"{'drift':>10}{'max |bias|':>12}{'variance':>12}{'E_mu[w^2]':>12}")
    for row in offpolicy:
        print(f"{row['drift']:>10}{row['bias']:>12.1e}{row['variance']:>12.4f}"
              f"{row['second_moment_w']:>12.3f}")

    controls = weight_controls(4 if args.fast else 8, drifts, batches=2000 if args.fast else 20000)
    print("\n--is-weight on the same samples, a batch of 32: relative bias | variance of the "
          "batch's gradient")
    print(f"{'drift':>10}{'exact':>22}{'truncated (C = 8)':>22}{'self-normalized':>22}")
    for row in controls:
        print(f"{row['drift']:>10}" + "".join(
            f"{row[name]['bias']:>11.4f} |{row[name]['variance']:>9.3f}"
            for name in ("exact", "truncated", "self_normalized")))

    print("\nK1 in the reward, one sequence's gradient: variance with the whole sequence's K1 "
          "| with the K1 to go")
    for T in (1, 2, 4, 8) if args.fast else (1, 2, 4, 8, 16):
        whole, to_go = (kl_gradient_moments(T, flag)[1] for flag in (False, True))
        print(f"{'T = ' + str(T):>10}{whole:>12.4f}{to_go:>12.4f}   {to_go / whole:.2f}x")

    (out / "offpolicy.json").write_text(json.dumps(offpolicy, indent=1))
    (out / "weight_controls.json").write_text(json.dumps(controls, indent=1))
    (out / "figure1.json").write_text(json.dumps(fig1, indent=1))
    (out / "converge.json").write_text(json.dumps(conv, indent=1))
    plot(fig1, conv, history, out)
    plot_offpolicy(offpolicy, out)
    return fig1, conv, offpolicy


if __name__ == "__main__":
    main()
