"""E2: kl.shape_rewards (eq. 7) and kl.kl_loss (eq. 9), with the oracle's estimator in place of
kl.estimate so that E1 does not count here."""
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
    mask = (torch.arange(T) < lengths[:, None]).to(f64)
    if rng.random() < 0.5:  # a float mask weights tokens
        mask = mask * torch.rand(B, T, dtype=f64, generator=g)
    return dict(logp=-3 * torch.rand(B, T, dtype=f64, generator=g),
                ref_logp=-3 * torch.rand(B, T, dtype=f64, generator=g),
                scores=torch.rand(B, dtype=f64, generator=g), mask=mask,
                kind=rng.choice(["k1", "k2", "k3"]), beta=rng.choice([0.01, 0.1, 1.0]),
                num_tokens=float(mask.sum()) + rng.randint(0, 20))


@pytest.mark.points(2)
@pytest.mark.parametrize("place", ["reward", "loss", "both", "none"])
@pytest.mark.parametrize("c", cases("e2-shape", draw))
def test_shape_rewards_values(c, place):
    """R - beta sum_t mask KL_t for places reward and both, R otherwise."""
    got = kl.shape_rewards(c["scores"], c["logp"], c["ref_logp"], c["mask"], c["kind"], place,
                           c["beta"])
    want = oracle.shape_rewards(c["scores"], c["logp"], c["ref_logp"], c["mask"], c["kind"], place,
                                c["beta"])
    error = (got.double() - want).abs().max().item()
    assert error < 1e-9, f"place={place}, {c['kind']}: returns off by {error:.2e}"


@pytest.mark.points(1)
@pytest.mark.parametrize("c", cases("e2-detach", draw, public=1, hidden=3))
def test_shaped_return_carries_no_gradient(c):
    """The shaped return is a constant to the optimizer: no gradient reaches logp through it."""
    logp = c["logp"].clone().requires_grad_()
    got = kl.shape_rewards(c["scores"], logp, c["ref_logp"], c["mask"], c["kind"], "reward",
                           c["beta"])
    assert not got.requires_grad, "the shaped return requires grad: it must be stop-gradient"


@pytest.mark.points(2)
@pytest.mark.parametrize("place", ["reward", "loss", "both", "none"])
@pytest.mark.parametrize("c", cases("e2-loss", draw))
def test_kl_loss_value_and_gradient(c, place):
    """beta sum mask KL / num_tokens and its path-wise gradient for places loss and both, else 0."""
    logp = c["logp"].clone().requires_grad_()
    got = kl.kl_loss(logp, c["ref_logp"], c["mask"], c["kind"], place, c["beta"], c["num_tokens"])
    want_logp = c["logp"].clone().requires_grad_()
    want = oracle.kl_loss(want_logp, c["ref_logp"], c["mask"], c["kind"], place, c["beta"],
                          c["num_tokens"])
    assert abs(float(got) - float(want)) < 1e-9, (
        f"place={place}, {c['kind']}: loss {float(got):.6g}, expected {float(want):.6g}")
    if place in ("loss", "both"):
        (grad,) = torch.autograd.grad(got, logp)
        (want_grad,) = torch.autograd.grad(want, want_logp)
        error = (grad - want_grad).abs().max().item()
        assert error < 1e-9, f"place={place}: gradient in logp off by {error:.2e}"


@pytest.mark.points(1)
@pytest.mark.parametrize("c", cases("e2-ref", draw, public=1, hidden=3))
def test_no_gradient_into_the_reference(c):
    """The reference model is frozen: kl_loss sends no gradient into ref_logp."""
    ref_logp = c["ref_logp"].clone().requires_grad_()
    logp = c["logp"].clone().requires_grad_()
    loss = kl.kl_loss(logp, ref_logp, c["mask"], c["kind"], "loss", c["beta"], c["num_tokens"])
    (grad,) = torch.autograd.grad(loss, ref_logp, allow_unused=True)
    assert grad is None or grad.abs().max() == 0, "a gradient reached ref_logp"
