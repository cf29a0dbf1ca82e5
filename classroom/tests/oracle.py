"""The grader's references, computed at grading time in float64 straight from the definitions
(loops and series, not the solution's code): the estimators, the KL's two places, the PPO-clip
loss, the sampler's distribution, and the toy model of sec. 3.3 enumerated with its closed forms.
The exercise tests also put these in place of the *other* exercises' functions, so that each
exercise is graded on its own code only."""
import itertools

import torch
import torch.nn.functional as F

f64 = torch.float64


def k3_of_log_r(x):
    """K3 = e^x - 1 - x in float64: the series below |x| = 1e-2 (no cancellation), else direct."""
    x = x.to(f64)
    series = x**2 / 2 + x**3 / 6 + x**4 / 24 + x**5 / 120 + x**6 / 720
    return torch.where(x.abs() < 1e-2, series, torch.exp(x) - 1 - x)


def estimate(logp, ref_logp, kind, clamp="none"):
    """Stand-in for kl.estimate (differentiable in logp, same dtype as logp)."""
    log_ratio = logp.to(f64) - ref_logp.to(f64)
    if kind == "k1":
        out = log_ratio
    elif kind == "k2":
        out = log_ratio**2 / 2
    else:
        x = -log_ratio
        if clamp == "verl":
            x = x.clamp(-20, 20)
            out = k3_of_log_r(x).clamp(-10, 10)
        else:
            out = k3_of_log_r(x)
    return out.to(logp.dtype)


def shape_rewards(scores, logp, ref_logp, mask, kind, place, beta, clamp="none"):
    shaped = scores.clone()
    if place in ("both", "reward"):  # eq. 7
        shaped = shaped - beta * (estimate(logp, ref_logp, kind, clamp) * mask).sum(-1)
    return shaped.detach()


def kl_loss(logp, ref_logp, mask, kind, place, beta, num_tokens, clamp="none"):
    if place in ("both", "loss"):  # eq. 9
        return beta * (estimate(logp, ref_logp.detach(), kind, clamp) * mask).sum() / num_tokens
    return torch.zeros((), dtype=logp.dtype)


def policy_loss(logp, old_logp, advantages, mask, num_tokens, clip_eps=0.2):
    """Stand-in for advantage.policy_loss: per token, max(-A w, -A clip(w)), summed / num_tokens."""
    ratio = (logp - old_logp.detach()).exp()
    adv = advantages.detach().to(logp.dtype)
    adv = adv if adv.dim() == 2 else adv[:, None].expand_as(logp)
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_eps, 1 + clip_eps))
    clipped = (-adv * ratio.clamp(1 - clip_eps, 1 + clip_eps)) > (-adv * ratio)
    return (mask * per_token).sum() / num_tokens, (mask * clipped).sum() / num_tokens


def sampling_distribution(logits, temperature, top_p):
    """(n, V) float64 probabilities actually sampled: softmax(z / T), then the top-p nucleus (the
    most likely tokens, one by one, until their mass reaches top_p), renormalized."""
    probs = torch.softmax(logits.to(f64) / temperature, -1)
    out = torch.zeros_like(probs)
    for row in range(len(probs)):
        mass = 0.0
        for token in probs[row].argsort(descending=True).tolist():
            if mass >= top_p:
                break
            out[row, token] = probs[row, token]
            mass += probs[row, token].item()
    return out / out.sum(-1, keepdim=True)


def sample(logits, temperature, top_p, uniform):
    """Stand-in for rollout.sample: inverse CDF over the sampled distribution."""
    if not temperature > 0:  # greedy: a point mass, log-prob 0
        return logits.max(-1).indices, logits.new_zeros(logits.shape[0])
    probs = sampling_distribution(logits, temperature, top_p)
    cdf = probs.cumsum(-1)
    tokens = torch.searchsorted(cdf, uniform[:, None].to(f64) * cdf[:, -1:], right=True)
    tokens = tokens.clamp(max=probs.shape[-1] - 1)[:, 0]
    return tokens, probs.gather(-1, tokens[:, None])[:, 0].log().float()


# ---- the toy model of sec. 3.3, every sequence (eqs. 17-18) ------------------------------------


def toy(T, theta, ref):
    """All 2^T sequences; per-token log-probs under A (differentiable in a, b) and B."""
    y = torch.tensor(list(itertools.product([0.0, 1.0], repeat=T)), dtype=f64)
    c = y.cumsum(-1) - y  # c_{t-1}
    a = torch.tensor(theta[0], dtype=f64, requires_grad=True)
    b = torch.tensor(theta[1], dtype=f64, requires_grad=True)
    z, z_ref = a + b * c, ref[0] + ref[1] * c
    logp = y * F.logsigmoid(z) + (1 - y) * F.logsigmoid(-z)
    ref_logp = y * F.logsigmoid(z_ref) + (1 - y) * F.logsigmoid(-z_ref)
    return dict(y=y, c=c, a=a, b=b, z=z, z_ref=z_ref, logp=logp, ref_logp=ref_logp)


def references(m):
    """Exact (2,) gradients in (a, b): grad KL (eq. 23, autograd through the exact sum), eq. 19's
    E[sum_t r_t grad log pi(y)], eq. 41's token-level forward KL gradient."""
    y, c, z, z_ref = m["y"], m["c"], m["z"].detach(), m["z_ref"]
    p, q = torch.sigmoid(z), torch.sigmoid(z_ref)
    seq_logp, seq_ref = m["logp"].sum(-1), m["ref_logp"].sum(-1).detach()
    pi = seq_logp.exp().detach()
    per_param = lambda g: torch.stack([g, g * c], -1)  # noqa: E731  d z_t / d(a, b) = (1, c_{t-1})
    score = per_param(y - p).sum(1)
    r = torch.where(y == 1, q / p, (1 - q) / (1 - p))
    kl = (seq_logp.exp() * (seq_logp - seq_ref)).sum()
    true = torch.stack(torch.autograd.grad(kl, (m["a"], m["b"]), retain_graph=True))
    return dict(true=true, eq19=(pi[:, None] * score * r.sum(1, keepdim=True)).sum(0),
                eq41=(pi[:, None] * per_param(p - q).sum(1)).sum(0))


def toy_params(rng):
    """(T, theta, ref) of a random toy model."""
    return (rng.randint(1, 7), (rng.uniform(-1, 1), rng.uniform(-0.6, 0.6)),
            (rng.uniform(-1, 1), rng.uniform(-0.6, 0.6)))
