"""E4: advantage.rloo and advantage.policy_loss (sec. 4.1, eq. 4)."""
import itertools

import pytest
import torch

import advantage
import oracle
from conftest import cases

f64 = torch.float64


def draw_returns(rng):
    G, groups = rng.randint(2, 6), rng.randint(1, 4)
    return [rng.choice([0.0, 1.0, rng.uniform(-2, 2)]) for _ in range(G * groups)], G


@pytest.mark.points(2)
@pytest.mark.parametrize("c", cases("e4-rloo", draw_returns, public=3, hidden=6))
def test_rloo_values(c):
    """A_i = R_i - mean of the other samples of its group."""
    returns, G = c
    got = advantage.rloo(torch.tensor(returns, dtype=f64), G)
    want = [R - (sum(returns[k - k % G:k - k % G + G]) - R) / (G - 1)
            for k, R in enumerate(returns)]
    error = (got - torch.tensor(want, dtype=f64)).abs().max().item()
    assert error < 1e-9, f"G = {G}: advantages off by {error:.2e}"


def draw_groups(rng):
    T, G = rng.choice([(1, 2), (1, 3), (2, 2), (2, 3), (3, 2)])
    return T, G, oracle.toy_params(rng)[1:], rng.randrange(2**31)


@pytest.mark.points(2)
@pytest.mark.parametrize("c", cases("e4-baseline", draw_groups))
def test_rloo_baseline_adds_no_expected_gradient(c):
    """Every group of G samples of the toy model enumerated: E[grad] with RLOO = without."""
    T, G, (theta, ref), seed = c
    m = oracle.toy(T, theta, ref)
    scores = torch.rand(2**T, dtype=f64, generator=torch.Generator().manual_seed(seed))
    groups = torch.tensor(list(itertools.product(range(2**T), repeat=G))).reshape(-1)
    logp = m["logp"][groups]
    prob = logp.sum(-1).reshape(-1, G).sum(-1).exp().detach().repeat_interleave(G)
    mask = prob[:, None] * torch.ones_like(logp)

    def grad(adv):
        loss, _ = oracle.policy_loss(logp, logp.detach(), adv, mask, num_tokens=G)
        return torch.stack(torch.autograd.grad(loss, (m["a"], m["b"]), retain_graph=True))

    got, want = grad(advantage.rloo(scores[groups], G)), grad(scores[groups])
    error = (got - want).abs().max().item()
    assert error < 1e-9, f"T = {T}, G = {G}: the baseline moves E[grad] by {error:.2e}"


def draw_ppo(rng):
    B, T = rng.randint(2, 6), rng.randint(1, 8)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    logits = torch.randn(B, T, 7, dtype=f64, generator=g)
    tokens = torch.randint(0, 7, (B, T), generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    return dict(logits=logits, tokens=tokens, mask=(torch.arange(T) < lengths[:, None]).to(f64),
                old_logp=(logits.log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
                          + 0.4 * torch.randn(B, T, dtype=f64, generator=g)),
                adv=torch.randn(B, dtype=f64, generator=g), clip_eps=rng.choice([0.1, 0.2, 0.3]),
                per_token=rng.random() < 0.3, num_tokens=float(lengths.sum()) + rng.randint(0, 9))


def losses(c, fn, on_policy):
    logits = c["logits"].clone().requires_grad_()
    logp = logits.log_softmax(-1).gather(-1, c["tokens"][..., None])[..., 0]
    old = logp.detach() if on_policy else c["old_logp"]
    adv = c["adv"][:, None] * torch.linspace(1, -1, logp.shape[1]) if c["per_token"] else c["adv"]
    loss, frac = fn(logp, old, adv, c["mask"], c["num_tokens"], c["clip_eps"])
    (grad,) = torch.autograd.grad(loss, logits)
    return float(loss), float(frac), grad


@pytest.mark.points(1)
@pytest.mark.parametrize("c", cases("e4-on-policy", draw_ppo))
def test_policy_loss_on_policy(c):
    """On-policy: value -sum mask A / num_tokens, gradient -(1/num_tokens) sum A grad log pi."""
    got, want = losses(c, advantage.policy_loss, True), losses(c, oracle.policy_loss, True)
    assert abs(got[0] - want[0]) < 1e-9, f"loss {got[0]:.6g}, expected {want[0]:.6g}"
    assert (got[2] - want[2]).abs().max() < 1e-9, "on-policy gradient differs"
    assert got[1] == 0, "nothing is clipped on-policy"


@pytest.mark.points(2)
@pytest.mark.parametrize("c", cases("e4-clip", draw_ppo, public=3, hidden=6))
def test_policy_loss_clipping(c):
    """Off-policy ratios: the clipped surrogate's value, gradient and clip_frac, token by token."""
    got, want = losses(c, advantage.policy_loss, False), losses(c, oracle.policy_loss, False)
    assert abs(got[0] - want[0]) < 1e-9, f"loss {got[0]:.6g}, expected {want[0]:.6g}"
    error = (got[2] - want[2]).abs().max().item()
    assert error < 1e-9, f"gradient off by {error:.2e} (which tokens are clipped?)"
    assert abs(got[1] - want[1]) < 1e-9, f"clip_frac {got[1]:.4g}, expected {want[1]:.4g}"
