"""E1: kl.estimate against float64 oracles (eqs. 11, 14)."""
import pytest
import torch

import kl
import oracle
from conftest import cases

f64 = torch.float64


def draw_inputs(rng):
    shape = (rng.randint(1, 6), rng.randint(1, 40))
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    spread = rng.choice([0.1, 1.0, 5.0])
    logp = -spread * torch.rand(shape, dtype=f64, generator=g)
    ref_logp = -spread * torch.rand(shape, dtype=f64, generator=g)
    return logp, ref_logp


@pytest.mark.points(1)
@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
@pytest.mark.parametrize("inputs", cases("e1-values", draw_inputs))
def test_values(kind, inputs):
    """Each estimator's value per token, in float64."""
    logp, ref_logp = inputs
    got = kl.estimate(logp, ref_logp, kind)
    assert got.shape == logp.shape, f"{kind}: shape {tuple(got.shape)}, not {tuple(logp.shape)}"
    error = (got.double() - oracle.estimate(logp, ref_logp, kind)).abs().max().item()
    assert error < 1e-9, f"{kind}: largest error {error:.2e} against the definition"


def draw_small(rng):
    n = rng.randint(5, 30)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    x = 10 ** (-2 - 3 * torch.rand(n, generator=g)) * torch.where(torch.rand(n, generator=g) < 0.5,
                                                                 -1.0, 1.0)
    logp = -3 * torch.rand(n, generator=g)
    return logp.float(), (logp + x).float()


@pytest.mark.points(2)
@pytest.mark.parametrize("inputs", cases("e1-near-one", draw_small))
def test_k3_is_accurate_near_r_equal_1_in_float32(inputs):
    """K3 in float32 at |log r| in [1e-5, 1e-2]: relative error below 1e-2."""
    logp, ref_logp = inputs
    exact = oracle.k3_of_log_r(ref_logp.double() - logp.double())
    got = kl.estimate(logp, ref_logp, "k3")
    assert got.dtype == torch.float32, f"K3 of float32 inputs came back as {got.dtype}"
    relative = ((got.double() - exact).abs() / exact).max().item()
    assert relative < 1e-2, f"K3 near r = 1: relative error {relative:.2g} in float32"


@pytest.mark.points(1)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_k3_is_non_negative_and_finite(dtype):
    """K3 >= 0 for log r from -30 to 30 and near 0, in float64, float32 and bfloat16."""
    log_r = torch.cat([torch.linspace(-30, 30, 2001), torch.logspace(-9, 0, 300),
                       -torch.logspace(-9, 0, 300), torch.zeros(3)]).to(dtype)
    got = kl.estimate(torch.zeros_like(log_r), log_r, "k3")
    assert torch.isfinite(got).all(), f"K3 is not finite in {dtype}"
    assert (got >= 0).all(), f"K3 < 0 in {dtype} at {int((got < 0).sum())} points"


@pytest.mark.points(1)
@pytest.mark.parametrize("inputs", cases("e1-grad", draw_inputs, public=1, hidden=3))
def test_gradients_in_logp(inputs):
    """d K / d logp per token: autograd through the estimate against the oracle's."""
    logp, ref_logp = inputs
    for kind in ("k1", "k2", "k3"):
        x = logp.clone().requires_grad_()
        (got,) = torch.autograd.grad(kl.estimate(x, ref_logp, kind).sum(), x)
        y = logp.clone().requires_grad_()
        (want,) = torch.autograd.grad(oracle.estimate(y, ref_logp, kind).sum(), y)
        error = (got - want).abs().max().item()
        assert error < 1e-8, f"{kind}: gradient in logp off by {error:.2e}"


@pytest.mark.points(1)
def test_verl_clamp():
    """clamp='verl': log r to [-20, 20], then K3 to [-10, 10]; zero gradient where clamped."""
    log_r = torch.tensor([-40.0, -25.0, -12.0, -3.0, 0.5, 2.0, 2.5, 5.0, 30.0], dtype=f64)
    logp = torch.zeros_like(log_r, requires_grad=True)
    got = kl.estimate(logp, log_r, "k3", clamp="verl")
    want = oracle.estimate(torch.zeros_like(log_r), log_r, "k3", clamp="verl")
    assert (got.detach() - want).abs().max() < 1e-9, "clamped values differ from verl's bounds"
    (grad,) = torch.autograd.grad(got.sum(), logp)
    clamped = (want.abs() >= 10) | (log_r.abs() > 20)
    assert (grad[clamped] == 0).all(), "a clamped value still has a gradient"
    assert (grad[~clamped] != 0).all(), "an unclamped value lost its gradient"
