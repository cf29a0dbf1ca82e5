"""Exact tests of kl.py and advantage.py on the toy model of sec. 3.3 (float64, all 2^T sequences).

Every expectation below is an exact sum over all 2^T binary sequences, each weighted by its (detached)
probability passed through the float mask of the real `policy_loss` / `kl_loss`, with num_tokens = 1.
So every claim of sec. 3 and appendix F is checked to 1e-9, not statistically. The references
(eqs. 19, 21-22, 41) are computed independently, by hand-derived formulas for Bernoulli tokens.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F

from advantage import group_mean, group_normalized, policy_loss, rloo
from kl import KINDS, PLACES, estimate, kl_loss, shape_rewards

f64 = torch.float64
TOL = 1e-9
# (T, (a, b) of the policy A, (a~, b~) of the reference B, beta)
CASES = [(1, (0.3, 0.0), (-0.4, 0.0), 1.0), (3, (0.5, -0.2), (0.0, -0.3), 0.1),
         (5, (-0.7, 0.4), (0.2, 0.3), 0.5), (8, (0.5, -0.2), (0.0, -0.3), 2.0)]


def toy(T, theta, ref):
    """All 2^T sequences with per-token log-probs under A (differentiable in a, b) and B (eqs. 17-18)."""
    y = torch.tensor(list(itertools.product([0.0, 1.0], repeat=T)), dtype=f64)
    c = y.cumsum(-1) - y  # c_{t-1}
    a, b = (torch.tensor(v, dtype=f64, requires_grad=True) for v in theta)
    z, z_ref = a + b * c, ref[0] + ref[1] * c
    logp = y * F.logsigmoid(z) + (1 - y) * F.logsigmoid(-z)
    ref_logp = y * F.logsigmoid(z_ref) + (1 - y) * F.logsigmoid(-z_ref)
    return dict(y=y, c=c, a=a, b=b, z=z, z_ref=z_ref, logp=logp, ref_logp=ref_logp)


def expected_loss_grad(m, kind, place, beta, scores=None):
    """grad_(a, b) E[loss] of one configuration, through the real shape_rewards, policy_loss and kl_loss."""
    logp, ref_logp = m["logp"], m["ref_logp"]
    weight = logp.sum(-1, keepdim=True).exp().detach()  # pi(y): the weighted sum over all y is E_pi
    scores = torch.zeros(len(logp), dtype=f64) if scores is None else scores
    mask = torch.ones_like(logp)
    returns = shape_rewards(scores, logp, ref_logp, mask, kind, place, beta)
    pg_loss, clip_frac = policy_loss(logp, logp.detach(), returns, weight * mask, num_tokens=1)
    assert clip_frac.item() == 0  # on-policy: nothing is clipped
    loss = pg_loss + kl_loss(logp, ref_logp, weight * mask, kind, place, beta, num_tokens=1)
    return torch.stack(torch.autograd.grad(loss, (m["a"], m["b"]), retain_graph=True))


def references(m):
    """Independent exact references, as (2,) tensors of d/da, d/db."""
    y, c, z, z_ref = m["y"], m["c"], m["z"].detach(), m["z_ref"]
    p, q = torch.sigmoid(z), torch.sigmoid(z_ref)
    seq_logp, seq_ref = m["logp"].sum(-1), m["ref_logp"].sum(-1).detach()
    pi = seq_logp.exp().detach()
    log_ratio = (seq_logp - seq_ref).detach()
    per_param = lambda g: torch.stack([g, g * c], -1)  # d z_t / d(a, b) = (1, c_{t-1})
    score = per_param(y - p).sum(1)  # grad log A(y) = sum_t (y_t - p_t) (1, c_{t-1})
    r = torch.where(y == 1, q / p, (1 - q) / (1 - p))  # r_t = pi_ref(y_t | y<t) / pi(y_t | y<t)
    kl = (seq_logp.exp() * (seq_logp - seq_ref)).sum()
    true = torch.stack(torch.autograd.grad(kl, (m["a"], m["b"]), retain_graph=True))
    return dict(
        kl=(pi * log_ratio).sum(),  # eq. 20
        true=true,  # eq. 23: autograd through the exact sum, probabilities not detached
        closed_form=(pi[:, None] * score * log_ratio[:, None]).sum(0),  # eqs. 21-22
        # eq. 19: E[sum_t r_t grad log pi(y)]
        eq19=(pi[:, None] * score * r.sum(1, keepdim=True)).sum(0),
        # eq. 41: sum_t E_{y<t}[grad KL(pi_ref(.|y<t) || pi(.|y<t))], with d/dz KL(Bern(q) || Bern(p)) = p - q
        eq41=(pi[:, None] * per_param(p - q).sum(1)).sum(0),
        # token-level reverse KL, prefix frozen: d/dz KL(Bern(p) || Bern(q)) = p (1 - p) (z - z_ref)
        k2_path=(pi[:, None] * per_param(p * (1 - p) * (z - z_ref)).sum(1)).sum(0),
    )


def close(x, y):
    return (x - y).abs().max().item() < TOL


@pytest.mark.parametrize("T, theta, ref, beta", CASES)
def test_expected_gradients_table1(T, theta, ref, beta):
    m = toy(T, theta, ref)
    refs = references(m)
    grad = lambda kind, place: expected_loss_grad(m, kind, place, beta) / beta  # = E[grad of the KL term]
    assert close(refs["true"], refs["closed_form"])  # eq. 23 == eqs. 21-22
    assert close(grad("k1", "reward"), refs["true"])  # eqs. 10, 12: unbiased
    assert close(grad("k1", "loss"), torch.zeros(2))  # eq. 13: zero in expectation
    assert close(grad("k3", "loss"), refs["eq41"])  # eqs. 16, 41: token-level forward KL
    assert close(grad("k3", "reward"), refs["true"] + refs["eq19"])  # eqs. 15, 19
    assert close(refs["eq19"], -refs["eq41"])  # eq. 45: the K3-in-reward bias is minus the K3-in-loss gradient
    assert close(grad("k1", "both"), refs["true"])  # sec. 3.1, 4.3
    assert close(grad("k3", "both"), refs["true"])
    assert close(grad("k2", "loss"), refs["k2_path"])  # the token-level reverse KL, prefix held fixed
    assert close(grad("k1", "none"), torch.zeros(2))
    # and the biased ones really are biased; K2-in-loss only from T = 2 on: for one token it is exact
    biased = [("k1", "loss"), ("k3", "loss"), ("k3", "reward")] + ([("k2", "loss")] if T > 1 else [])
    for kind, place in biased:
        assert (grad(kind, place) - refs["true"]).abs().max() > 1e-3, (kind, place)
    if T == 1:
        assert close(grad("k2", "loss"), refs["true"])


@pytest.mark.parametrize("T, theta, ref, beta", CASES)
def test_full_objective_gradient(T, theta, ref, beta):
    """With a task reward: the loss gradient is -grad(E[R] - beta KL) for the unbiased configurations."""
    m = toy(T, theta, ref)
    scores = torch.rand(len(m["y"]), dtype=f64, generator=torch.Generator().manual_seed(T))
    pi = m["logp"].sum(-1).exp()
    grad_reward = torch.stack(torch.autograd.grad((pi * scores).sum(), (m["a"], m["b"]), retain_graph=True))
    true = references(m)["true"]
    for kind, place in (("k1", "reward"), ("k1", "both"), ("k3", "both")):
        assert close(expected_loss_grad(m, kind, place, beta, scores), -(grad_reward - beta * true))
    assert close(expected_loss_grad(m, "k1", "loss", beta, scores), -grad_reward)  # lands where beta = 0 lands
    assert close(expected_loss_grad(m, "k3", "none", beta, scores), -grad_reward)


@pytest.mark.parametrize("T, theta, ref, beta", CASES)
def test_estimators_expectation(T, theta, ref, beta):
    m = toy(T, theta, ref)
    pi = m["logp"].sum(-1).exp().detach()
    kl = references(m)["kl"]
    expect = lambda kind: (pi * estimate(m["logp"].detach(), m["ref_logp"], kind).sum(-1)).sum()
    assert close(expect("k1"), kl)  # eq. 11: unbiased
    assert close(expect("k3"), kl)  # eqs. 34-37: unbiased
    if T > 1:
        assert (expect("k2") - kl).abs() > 1e-4  # K2 is not an unbiased estimate of the KL


def test_estimate_values_and_k3_stability():
    g = torch.Generator().manual_seed(0)
    logp, ref_logp = -5 * torch.rand(64, 32, dtype=f64, generator=g), -5 * torch.rand(64, 32, dtype=f64, generator=g)
    r = (ref_logp - logp).exp()
    assert torch.allclose(estimate(logp, ref_logp, "k1"), logp - ref_logp)
    assert torch.allclose(estimate(logp, ref_logp, "k2"), 0.5 * (logp - ref_logp) ** 2)
    assert torch.allclose(estimate(logp, ref_logp, "k3"), r - 1 - r.log())  # eq. 14
    # K3 >= 0 per token, also far from r = 1 and in float32 / bfloat16
    log_r = torch.cat([torch.linspace(-30, 30, 10001), torch.logspace(-12, 0, 500), -torch.logspace(-12, 0, 500)])
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        assert (estimate(torch.zeros_like(log_r, dtype=dtype), log_r.to(dtype), "k3") >= 0).all()
    # near r = 1 the naive r - 1 - log r cancels catastrophically in float32; expm1 keeps ~1e-3 relative accuracy
    small = torch.tensor([1e-4, -1e-4, 3e-4, 1e-3, -1e-3], dtype=torch.float32)
    exact = estimate(torch.zeros_like(small, dtype=f64), small.double(), "k3")
    k3 = estimate(torch.zeros_like(small), small, "k3").double()
    naive = (small.exp() - 1 - small).double()
    assert ((k3 - exact).abs() / exact).max() < 1e-2
    assert ((naive - exact).abs() / exact).max() > 1e-1
    assert estimate(torch.zeros(3), torch.zeros(3), "k3").eq(0).all()


def test_mask_weights_tokens_and_padding_is_ignored():
    g = torch.Generator().manual_seed(1)
    logp = -torch.rand(4, 6, dtype=f64, generator=g)
    ref_logp = -torch.rand(4, 6, dtype=f64, generator=g)
    mask = torch.rand(4, 6, dtype=f64, generator=g)
    mask[:, 4:] = 0
    scores = torch.rand(4, dtype=f64, generator=g)
    for kind in KINDS:
        kl = estimate(logp, ref_logp, kind)
        loss = kl_loss(logp, ref_logp, mask, kind, "loss", 0.3, num_tokens=7)
        assert torch.allclose(loss, 0.3 * (mask * kl).sum() / 7)
        returns = shape_rewards(scores, logp, ref_logp, mask, kind, "both", 0.3)
        assert torch.allclose(returns, scores - 0.3 * (mask * kl).sum(-1))
        # changing padded positions changes nothing
        junk_logp, junk_ref = logp.clone(), ref_logp.clone()
        junk_logp[:, 4:], junk_ref[:, 4:] = -9.0, -0.1
        assert torch.allclose(kl_loss(junk_logp, junk_ref, mask, kind, "both", 0.3, 7), loss)
        assert torch.allclose(shape_rewards(scores, junk_logp, junk_ref, mask, kind, "reward", 0.3),
                              shape_rewards(scores, logp, ref_logp, mask, kind, "reward", 0.3))
        # a bool mask works like the float one
        as_bool = kl_loss(logp, ref_logp, mask > 0, kind, "loss", 1.0, 7)
        assert torch.allclose(as_bool, kl_loss(logp, ref_logp, (mask > 0).double(), kind, "loss", 1.0, 7))


def test_places_gradients_and_errors():
    logp = torch.randn(3, 5, dtype=f64).requires_grad_()
    ref_logp, mask, scores = torch.randn(3, 5, dtype=f64), torch.ones(3, 5, dtype=f64), torch.randn(3, dtype=f64)
    for place in PLACES:
        returns = shape_rewards(scores, logp, ref_logp, mask, "k3", place, 0.1)
        assert not returns.requires_grad and returns.shape == (3,)
        loss = kl_loss(logp, ref_logp, mask, "k3", place, 0.1, 15)
        assert loss.shape == () and loss.dtype == f64
        assert loss.requires_grad == (place in ("loss", "both"))
        if place in ("loss", "none"):
            assert torch.equal(returns, scores)
        if place in ("reward", "none"):
            assert loss.item() == 0
    with pytest.raises(ValueError, match="k1, k2, k3"):
        estimate(logp, ref_logp, "k4")
    with pytest.raises(ValueError, match="reward, loss, both, none"):
        kl_loss(logp, ref_logp, mask, "k1", "advantage", 0.1, 15)
    with pytest.raises(ValueError, match="k1, k2, k3"):
        shape_rewards(scores, logp, ref_logp, mask, "K1", "reward", 0.1)


def test_rloo_definition_and_errors():
    returns = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 3.0, 5.0, 7.0])
    groups = returns.reshape(2, 4).tolist()
    expected = torch.tensor([[R - (sum(group) - R) / (len(group) - 1) for R in group] for group in groups])
    assert torch.allclose(rloo(returns, 4), expected.reshape(-1))
    assert torch.allclose(rloo(returns, 2), torch.tensor([1.0, -1.0, -1.0, 1.0, -1.0, 1.0, -2.0, 2.0]))
    assert torch.allclose(group_mean(returns, 4)[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    std = (1 / 3) ** 0.5  # unbiased std of (1, 0, 0, 1)
    assert torch.allclose(group_normalized(returns, 4)[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-6))
    for bad in (1, 3):
        with pytest.raises(ValueError, match="group_size"):
            rloo(returns, bad)


@pytest.mark.parametrize("T, G", [(2, 3), (3, 2), (2, 4)])
def test_rloo_baseline_adds_no_expected_gradient(T, G):
    """Enumerate every group of G samples: RLOO's expected gradient is exactly grad E[R - beta K1]."""
    m = toy(T, (0.4, -0.6), (-0.2, 0.3))
    scores = torch.rand(2**T, dtype=f64, generator=torch.Generator().manual_seed(0))
    groups = torch.tensor(list(itertools.product(range(2**T), repeat=G))).reshape(-1)  # (2^T)^G groups, flat
    logp, ref_logp = m["logp"][groups], m["ref_logp"][groups]
    group_prob = logp.sum(-1).reshape(-1, G).sum(-1).exp().detach().repeat_interleave(G)  # prod_i pi(y_i)
    mask = torch.ones_like(logp)
    returns = shape_rewards(scores[groups], logp, ref_logp, mask, "k1", "reward", 0.5)

    def grad(advantages):  # num_tokens = G: the loss is the group mean, in expectation over groups
        loss, _ = policy_loss(logp, logp.detach(), advantages, group_prob[:, None] * mask, num_tokens=G)
        return torch.stack(torch.autograd.grad(loss, (m["a"], m["b"]), retain_graph=True))

    pi = m["logp"].sum(-1).exp()
    grad_reward = torch.stack(torch.autograd.grad((pi * scores).sum(), (m["a"], m["b"]), retain_graph=True))
    target = -(grad_reward - 0.5 * references(m)["true"])
    assert close(grad(returns), target)  # no baseline
    assert close(grad(rloo(returns, G)), target)  # RLOO: same expected gradient
    assert close(grad(group_mean(returns, G)), (G - 1) / G * target)  # Dr. GRPO's mean includes R_i itself


def test_policy_loss_gradient_and_clipping():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 5, 7, dtype=f64, generator=g).requires_grad_()
    tokens = torch.randint(0, 7, (4, 5), generator=g)
    logp = logits.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
    mask = torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2, [1.0] * 5, [1.0] * 1 + [0.0] * 4], dtype=f64)
    adv = torch.randn(4, dtype=f64, generator=g)
    loss, clip_frac = policy_loss(logp, logp.detach(), adv, mask, num_tokens=14)
    # on-policy: grad = -(1/num_tokens) sum_i A_i grad log pi(y_i)
    (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)
    (expected,) = torch.autograd.grad(-(adv[:, None] * mask * logp).sum() / 14, logits)
    assert close(grad, expected) and clip_frac.item() == 0 and close(loss, -(adv[:, None] * mask).sum() / 14)
    # off-policy: ratios 0.5, 1.1, 1.5 with A = +1 and -1
    logp = torch.log(torch.tensor([[0.5, 1.1, 1.5], [0.5, 1.1, 1.5]], dtype=f64)).requires_grad_()
    adv, ones = torch.tensor([1.0, -1.0], dtype=f64), torch.ones(2, 3, dtype=f64)
    loss, clip_frac = policy_loss(logp, torch.zeros(2, 3, dtype=f64), adv, ones, num_tokens=6)
    # A > 0: min(w, clip(w)) = 0.5, 1.1, 1.2 (clipped at 1.5);  A < 0: -max(w, clip(w)) = -0.8 (clipped), -1.1, -1.5
    assert close(loss, -torch.tensor(0.5 + 1.1 + 1.2 - 0.8 - 1.1 - 1.5, dtype=f64) / 6)
    assert close(clip_frac, torch.tensor(2 / 6, dtype=f64)) and not clip_frac.requires_grad
    (grad,) = torch.autograd.grad(loss, logp)
    assert close(grad, torch.tensor([[-0.5, -1.1, 0.0], [0.0, 1.1, 1.5]], dtype=f64) / 6)
