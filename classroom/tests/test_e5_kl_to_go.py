"""E5: kl.kl_to_go, the KL as a per-token reward summed to go (OpenRLHF): values, and on the toy
model, exactly, that it keeps grad KL and lowers the variance."""
import pytest
import torch

import kl
import oracle
from conftest import cases

f64 = torch.float64


@pytest.fixture(autouse=True)
def reference_estimator(monkeypatch):
    monkeypatch.setattr(kl, "estimate", oracle.estimate)


def draw(rng):
    B, T = rng.randint(1, 6), rng.randint(1, 12)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    return dict(logp=-3 * torch.rand(B, T, dtype=f64, generator=g),
                ref_logp=-3 * torch.rand(B, T, dtype=f64, generator=g),
                mask=(torch.arange(T) < lengths[:, None]).to(f64), kind=rng.choice(["k1", "k3"]))


@pytest.mark.points(2)
@pytest.mark.parametrize("c", cases("e5-values", draw, public=3, hidden=6))
def test_values_with_masks(c):
    """sum_{s >= t} mask_s KL_s per token, padding included as 0."""
    logp = c["logp"].clone().requires_grad_()
    got = kl.kl_to_go(logp, c["ref_logp"], c["mask"], c["kind"])
    assert not got.requires_grad, "kl_to_go is part of a return: detach it"
    per_token = c["mask"] * oracle.estimate(c["logp"], c["ref_logp"], c["kind"])
    T = per_token.shape[1]
    want = torch.stack([per_token[:, t:].sum(-1) for t in range(T)], -1)
    error = (got - want).abs().max().item()
    assert error < 1e-9, f"{c['kind']}: off by {error:.2e}"


@pytest.mark.points(2)
@pytest.mark.parametrize("params", cases("e5-unbiased", oracle.toy_params))
def test_k1_to_go_keeps_the_true_gradient(params):
    """Token t's advantage -sum_{s>=t} sg[K1_s], every sequence of the toy model: E = grad KL."""
    m = oracle.toy(*params)
    logp, mask = m["logp"], torch.ones_like(m["logp"])
    weight = logp.sum(-1, keepdim=True).exp().detach()
    to_go = kl.kl_to_go(logp, m["ref_logp"], mask, "k1")
    loss, _ = oracle.policy_loss(logp, logp.detach(), -to_go, weight * mask, num_tokens=1)
    grad = torch.stack(torch.autograd.grad(loss, (m["a"], m["b"]), retain_graph=True))
    want = oracle.references(m)["true"]
    error = (grad - want).abs().max().item()
    assert error < 1e-9, f"T = {params[0]}: expected gradient off grad KL by {error:.2e}"


@pytest.mark.points(1)
@pytest.mark.parametrize("params", cases("e5-variance", oracle.toy_params))
def test_the_variance_it_gives(params):
    """The exact variance of one sequence's gradient with the student's K1 to go, against the
    oracle's (usually below the whole sequence's: 4x at T = 8; at T = 2, pi near pi_ref, not
    always)."""
    m = oracle.toy(*params)
    logp, mask = m["logp"], torch.ones_like(m["logp"])
    to_go = kl.kl_to_go(logp, m["ref_logp"], mask, "k1")
    k1 = (logp - m["ref_logp"]).detach()
    want = torch.stack([k1[:, t:].sum(-1) for t in range(k1.shape[1])], -1)
    score = ((m["y"] - torch.sigmoid(m["z"].detach()))[..., None]
             * torch.stack([torch.ones_like(m["c"]), m["c"]], -1))
    pi = logp.sum(-1).exp().detach()

    def variance(k1):
        g = (k1[..., None] * score).sum(1)
        mean = (pi[:, None] * g).sum(0)
        return (pi[:, None] * (g - mean) ** 2).sum().item()

    assert abs(variance(to_go) - variance(want)) < 1e-9, (
        f"T = {params[0]}: variance {variance(to_go):.6g}, expected {variance(want):.6g}")
