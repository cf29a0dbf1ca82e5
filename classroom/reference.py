"""The grader's references for the toy model of sec. 3.3, every sequence enumerated (eqs. 17-18),
with its closed forms (eqs. 19, 23, 41). Computed in the grader's process only, never sent to a
child; the float64 estimators, losses and sampler are in standins.py."""
import itertools

import torch
import torch.nn.functional as F

f64 = torch.float64


def toy(T, theta, ref):
    """All 2^T sequences; per-token log-probs under A (differentiable in a, b) and B."""
    y = torch.tensor(list(itertools.product([0.0, 1.0], repeat=T)), dtype=f64)
    c = y.cumsum(-1) - y  # c_{t-1}
    a = torch.tensor(theta[0], dtype=f64, requires_grad=True)
    b = torch.tensor(theta[1], dtype=f64, requires_grad=True)
    z, z_ref = a + b * c, ref[0] + ref[1] * c  # eq. 17
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
