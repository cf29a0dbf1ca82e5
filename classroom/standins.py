"""Stand-ins for the functions of other exercises, so that each exercise is graded on its own code:
the grader sends this file's text to the child process of an exercise that calls them (E2 and E5
call kl.estimate, E3 the losses of E2 and E4, E7 rollout.sample) and never to the child of the
exercise they answer, which runs first (classroom/README.md). The grader's references use them too.
Float64 straight from the definitions."""
import torch

f64 = torch.float64


def k3_of_log_r(x):
    """K3 = e^x - 1 - x in float64: the series below |x| = 1e-2 (no cancellation), else direct."""
    x = x.to(f64)
    series = x**2 / 2 + x**3 / 6 + x**4 / 24 + x**5 / 120 + x**6 / 720
    return torch.where(x.abs() < 1e-2, series, torch.exp(x) - 1 - x)


def estimate(logp, ref_logp, kind, clamp="none"):
    """kl.estimate (differentiable in logp, same dtype as logp)."""
    log_ratio = logp.to(f64) - ref_logp.to(f64)
    if kind == "k1":
        out = log_ratio  # eq. 11
    elif kind == "k2":
        out = log_ratio**2 / 2
    elif clamp == "verl":
        out = k3_of_log_r((-log_ratio).clamp(-20, 20)).clamp(-10, 10)
    else:
        out = k3_of_log_r(-log_ratio)  # eq. 14
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
    """advantage.policy_loss: per token max(-A w, -A clip(w)), summed / num_tokens (eq. 4)."""
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


def sample(logits, temperature, top_p, uniform, draw=None):
    """rollout.sample: inverse CDF over the sampled distribution; greedy at temperature 0 (`draw`,
    a GPU's inverse CDF, is not needed: this one's is float64 throughout)."""
    if not temperature > 0:  # a point mass, log-prob 0
        return logits.max(-1).indices, logits.new_zeros(logits.shape[0])
    probs = sampling_distribution(logits, temperature, top_p)
    cdf = probs.cumsum(-1)
    tokens = torch.searchsorted(cdf, uniform[:, None].to(f64) * cdf[:, -1:], right=True)
    tokens = tokens.clamp(max=probs.shape[-1] - 1)[:, 0]
    return tokens, probs.gather(-1, tokens[:, None])[:, 0].log().float()
