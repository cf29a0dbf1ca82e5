"""Exact tests of kl.py and advantage.py on the toy model of sec. 3.3 (float64, all 2^T sequences).

Every expectation below is an exact sum over all 2^T binary sequences, each weighted by its
(detached) probability passed through the float mask of the real `policy_loss` / `kl_loss`, with
num_tokens = 1. So every claim of sec. 3 and appendix F about an expectation (of an estimator or of
its gradient) is checked to 1e-9, not statistically. Of the claims about variance, only the KL to
go's (app. F.3, last paragraph) is checked, below; K3's lower variance (sec. 3.2.2) is not. The
references (eqs. 19, 21-22, 41) are computed independently, by hand-derived formulas for Bernoulli
tokens.
"""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from advantage import group_mean, group_normalized, policy_loss, rloo, truncated_is_loss
import kl as kl_module
from kl import KINDS, PLACES, estimate, kl_loss, kl_to_go, off_policy_kl_loss, shape_rewards
from toy import toy_with_eos  # the toy model with an end-of-sequence token

f64 = torch.float64
TOL = 1e-9
# (T, (a, b) of the policy A, (a~, b~) of the reference B, beta)
CASES = [(1, (0.3, 0.0), (-0.4, 0.0), 1.0), (3, (0.5, -0.2), (0.0, -0.3), 0.1),
         (5, (-0.7, 0.4), (0.2, 0.3), 0.5), (8, (0.5, -0.2), (0.0, -0.3), 2.0)]


def toy(T, theta, ref):
    """All 2^T sequences with per-token log-probs under A (differentiable in a, b) and B
    (eqs. 17-18)."""
    y = torch.tensor(list(itertools.product([0.0, 1.0], repeat=T)), dtype=f64)
    c = y.cumsum(-1) - y  # c_{t-1}
    a, b = (torch.tensor(v, dtype=f64, requires_grad=True) for v in theta)
    z, z_ref = a + b * c, ref[0] + ref[1] * c
    logp = y * F.logsigmoid(z) + (1 - y) * F.logsigmoid(-z)
    ref_logp = y * F.logsigmoid(z_ref) + (1 - y) * F.logsigmoid(-z_ref)
    return dict(y=y, c=c, a=a, b=b, z=z, z_ref=z_ref, logp=logp, ref_logp=ref_logp)


def expected_loss_grad(m, kind, place, beta, scores=None):
    """grad_(a, b) E[loss] of one configuration, through the real shape_rewards, policy_loss and
    kl_loss."""
    logp, ref_logp = m["logp"], m["ref_logp"]
    weight = logp.sum(-1, keepdim=True).exp().detach()  # pi(y): the weighted sum over all y is E_pi
    scores = torch.zeros(len(logp), dtype=f64) if scores is None else scores
    mask = m.get("mask", torch.ones_like(logp))
    returns = shape_rewards(scores, logp, ref_logp, mask, kind, place, beta)
    pg_loss, clip_frac = policy_loss(logp, logp.detach(), returns, weight * mask, num_tokens=1)
    assert clip_frac.item() == 0  # on-policy: nothing is clipped
    loss = pg_loss + kl_loss(logp, ref_logp, weight * mask, kind, place, beta, num_tokens=1)
    params = m["params"] if "params" in m else (m["a"], m["b"])
    return torch.stack(torch.autograd.grad(loss, params, retain_graph=True))


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
        # eq. 41 (arXiv 2512.21852, app. F.4, numbers two lines (41); this is the second):
        # sum_t E_{y<t}[grad KL(pi_ref || pi)], with d/dz KL(Bern(q) || Bern(p)) = p - q
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
    # grad(kind, place) = E[grad of the KL term]
    grad = lambda kind, place: expected_loss_grad(m, kind, place, beta) / beta
    assert close(refs["true"], refs["closed_form"])  # eq. 23 == eqs. 21-22
    assert close(grad("k1", "reward"), refs["true"])  # eqs. 10, 12: unbiased
    assert close(grad("k1", "loss"), torch.zeros(2))  # eq. 13: zero in expectation
    assert close(grad("k3", "loss"), refs["eq41"])  # eqs. 16, 41: token-level forward KL
    assert close(grad("k3", "reward"), refs["true"] + refs["eq19"])  # eqs. 15, 19
    # eq. 45: the K3-in-reward bias is minus the K3-in-loss gradient
    assert close(refs["eq19"], -refs["eq41"])
    assert close(grad("k1", "both"), refs["true"])  # sec. 3.1, 4.3
    assert close(grad("k3", "both"), refs["true"])
    # the token-level reverse KL, prefix held fixed
    assert close(grad("k2", "loss"), refs["k2_path"])
    assert close(grad("k1", "none"), torch.zeros(2))
    # and the biased ones really are biased; K2-in-loss only from T = 2 on:
    # for one token it is exact
    biased = ([("k1", "loss"), ("k3", "loss"), ("k3", "reward")]
              + ([("k2", "loss")] if T > 1 else []))
    for kind, place in biased:
        assert (grad(kind, place) - refs["true"]).abs().max() > 1e-3, (kind, place)
    if T == 1:
        assert close(grad("k2", "loss"), refs["true"])


@pytest.mark.parametrize("T, theta, ref, beta", CASES)
def test_full_objective_gradient(T, theta, ref, beta):
    """With a task reward: the loss gradient is -grad(E[R] - beta KL) for the unbiased
    configurations."""
    m = toy(T, theta, ref)
    scores = torch.rand(len(m["y"]), dtype=f64, generator=torch.Generator().manual_seed(T))
    pi = m["logp"].sum(-1).exp()
    grad_reward = torch.stack(torch.autograd.grad((pi * scores).sum(), (m["a"], m["b"]),
                                                  retain_graph=True))
    true = references(m)["true"]
    for kind, place in (("k1", "reward"), ("k1", "both"), ("k3", "both")):
        assert close(expected_loss_grad(m, kind, place, beta, scores), -(grad_reward - beta * true))
    # lands where beta = 0 lands
    assert close(expected_loss_grad(m, "k1", "loss", beta, scores), -grad_reward)
    assert close(expected_loss_grad(m, "k3", "none", beta, scores), -grad_reward)


@pytest.mark.parametrize("T, theta, ref, beta", CASES)
def test_estimators_expectation(T, theta, ref, beta):
    m = toy(T, theta, ref)
    pi = m["logp"].sum(-1).exp().detach()
    kl = references(m)["kl"]
    expect = lambda kind: (pi * estimate(m["logp"].detach(), m["ref_logp"], kind).sum(-1)).sum()
    assert close(expect("k1"), kl)  # K1 (eq. 11) is unbiased: app. F.3, after eq. 30
    assert close(expect("k3"), kl)  # eqs. 34-37: unbiased
    if T > 1:
        assert (expect("k2") - kl).abs() > 1e-4  # K2 is not an unbiased estimate of the KL


def test_estimate_values_and_k3_stability():
    g = torch.Generator().manual_seed(0)
    logp, ref_logp = (-5 * torch.rand(64, 32, dtype=f64, generator=g),
                      -5 * torch.rand(64, 32, dtype=f64, generator=g))
    r = (ref_logp - logp).exp()
    assert torch.allclose(estimate(logp, ref_logp, "k1"), logp - ref_logp)
    assert torch.allclose(estimate(logp, ref_logp, "k2"), 0.5 * (logp - ref_logp) ** 2)
    assert torch.allclose(estimate(logp, ref_logp, "k3"), r - 1 - r.log())  # eq. 14
    # K3 >= 0 per token, also far from r = 1 and in float32 / bfloat16
    log_r = torch.cat([torch.linspace(-30, 30, 10001), torch.logspace(-12, 0, 500),
                       -torch.logspace(-12, 0, 500)])
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        assert (estimate(torch.zeros_like(log_r, dtype=dtype), log_r.to(dtype), "k3") >= 0).all()
    # near r = 1 the naive r - 1 - log r cancels catastrophically in float32;
    # expm1 keeps ~1e-3 relative accuracy
    small = torch.tensor([1e-4, -1e-4, 3e-4, 1e-3, -1e-3], dtype=torch.float32)
    exact = estimate(torch.zeros_like(small, dtype=f64), small.double(), "k3")
    k3 = estimate(torch.zeros_like(small), small, "k3").double()
    naive = (small.exp() - 1 - small).double()
    assert ((k3 - exact).abs() / exact).max() < 1e-2
    assert ((naive - exact).abs() / exact).max() > 1e-1
    assert estimate(torch.zeros(3), torch.zeros(3), "k3").eq(0).all()


# ---- variable lengths: the toy model with an end-of-sequence token -------------------------------

# (T, (a, b, e) of the policy, (a~, b~, e~) of the reference, beta)
EOS_CASES = [(1, (0.3, 0.0, -1.0), (-0.4, 0.0, 0.5), 1.0),
             (3, (0.5, -0.2, -0.8), (0.0, -0.3, -1.5), 0.1),
             (5, (-0.7, 0.4, -1.2), (0.2, 0.3, -0.6), 0.5)]


def eos_references(m):
    """Exact references for variable lengths, each a (3,) gradient in (a, b, e)."""
    seq_logp, seq_ref = m["logp"].sum(-1), m["ref_logp"].sum(-1).detach()
    pi, mask, params = seq_logp.exp(), m["mask"], m["params"]
    grad = lambda f: torch.stack(torch.autograd.grad(f, params, retain_graph=True))  # noqa: E731
    r = (m["ref_logp"] - m["logp"]).detach().exp() * mask  # r_t on response tokens, 0 on padding
    # the token-level forward KL of each reached prefix, KL(pi_ref(.|y<t) || pi(.|y<t)),
    # weighted by P(prefix)
    forward_kl = (m["ref_dist"].exp() * (m["ref_dist"] - m["dist"])).sum(-1)
    return dict(
        kl=(pi * (seq_logp - seq_ref)).sum().detach(),
        true=grad((pi * (seq_logp - seq_ref)).sum()),  # grad KL(pi || pi_ref), lengths varying
        eq19=grad((pi.detach() * r.sum(-1) * seq_logp).sum()),  # E[sum_t r_t grad log pi(y)]
        length=grad((pi * mask.sum(-1)).sum()),  # grad E[T]
        eq41=grad((pi.detach()[:, None] * mask * forward_kl).sum()),
    )


@pytest.mark.parametrize("T, theta, ref, beta", EOS_CASES)
def test_variable_lengths_table1(T, theta, ref, beta):
    """Responses that end with EOS: the "-1" of K3 = r - 1 - log r sums to -T, so K3-in-reward picks
    up -grad E[T] (zero when every response has the same length):
    grad KL + E[sum_t r_t grad log pi(y)] - grad E[T]. That equals grad KL minus the K3-in-loss
    gradient (eq. 45 holds as it stands); the other rows of Table 1 hold unchanged, and K1 and K3
    stay unbiased estimates of the KL."""
    m = toy_with_eos(T, theta, ref)
    refs = eos_references(m)
    grad = lambda kind, place: expected_loss_grad(m, kind, place, beta) / beta  # noqa: E731
    pi = m["logp"].sum(-1).exp().detach()
    for kind in ("k1", "k3"):
        assert close(
            (pi * (m["mask"] * estimate(m["logp"].detach(), m["ref_logp"], kind)).sum(-1)).sum(),
            refs["kl"])
    assert close(grad("k1", "reward"), refs["true"])
    assert close(grad("k1", "loss"), torch.zeros(3))
    assert close(grad("k3", "loss"), refs["eq41"])
    assert close(grad("k3", "reward"), refs["true"] + refs["eq19"] - refs["length"])
    assert close(grad("k3", "reward"), refs["true"] - refs["eq41"])  # eq. 45
    assert close(grad("k1", "both"), refs["true"]) and close(grad("k3", "both"), refs["true"])
    # the fixed-length formula misses grad E[T], which is not small here (the stop logit e moves
    # E[T]); with T = 1 every response has one token (EOS or a bit), E[T] = 1 and the two
    # formulas agree
    missed = (grad("k3", "reward") - refs["true"] - refs["eq19"]).abs().max()
    assert missed > 1e-2 if T > 1 else missed < TOL


def verl_low_var_kl(logprob, ref_logprob):
    """verl's `kl_penalty` for "low_var_kl" (core_algos.py at 1dda039), written out as the
    reference."""
    kl = ref_logprob - logprob
    kl = torch.clamp(kl, min=-20, max=20)
    ratio = torch.exp(kl)
    kld = (ratio - kl - 1).contiguous()
    return torch.clamp(kld, min=-10, max=10)


def test_verl_clamp_values_and_gradients_at_the_boundaries():
    """--kl-clamp verl: K3 equals verl's low_var_kl in value and gradient on both sides of each
    bound (log r = +-20, K3 = 10), and K1/K2 are never clamped (verl does not clamp them either)."""
    log_r = torch.tensor([-30.0, -20.5, -20.0, -19.5, -12.0, -11.0, -9.0, 0.0, 1e-3, 2.0, 2.5, 2.52,
                          2.6, 3.0, 19.5, 20.0, 20.5, 30.0], dtype=f64)
    logp = torch.zeros_like(log_r, requires_grad=True)
    ours = estimate(logp, log_r, "k3", clamp="verl")
    (grad,) = torch.autograd.grad(ours.sum(), logp)
    logp_verl = torch.zeros_like(log_r, requires_grad=True)
    theirs = verl_low_var_kl(logp_verl, log_r)
    (grad_verl,) = torch.autograd.grad(theirs.sum(), logp_verl)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, grad_verl, rtol=1e-12, atol=1e-12)
    # by hand: past K3 = 10 (log r > ~2.53, or log r < -11) the value is 10 and the gradient 0;
    # inside it is d/d logp (r - 1 - log r) = 1 - r; past |log r| = 20 the value stays 10
    assert ours[log_r.abs() >= 12].eq(10).all() and grad[log_r.abs() >= 12].eq(0).all()
    inside = (log_r > -9.5) & (log_r < 2.5)
    torch.testing.assert_close(grad[inside], 1 - log_r[inside].exp())
    # the exact default: no bound at all (pi = 1e-6, pi_ref = 0.1 gives K3 ~ 1e5)
    exact = estimate(torch.tensor([1e-6]).log().double(), torch.tensor([0.1]).log().double(), "k3")
    assert 9.9e4 < exact.item() < 1.0e5
    assert estimate(torch.tensor([1e-6]).log().double(), torch.tensor([0.1]).log().double(),
                    "k3", "verl") == 10
    # K1 and K2 pass through unclamped; the clamp reaches shape_rewards and kl_loss
    for kind in ("k1", "k2"):
        assert torch.equal(estimate(logp, log_r, kind, "verl"), estimate(logp, log_r, kind))
    mask, scores = torch.ones(1, len(log_r), dtype=f64), torch.zeros(1, dtype=f64)
    assert torch.allclose(
        shape_rewards(scores, logp[None], log_r[None], mask, "k3", "reward", 1.0, "verl"),
        -theirs.sum().detach()[None])
    loss = kl_loss(logp[None], log_r[None], mask, "k3", "loss", 1.0, 1, "verl")
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0], grad_verl)
    with pytest.raises(ValueError, match="none, verl"):
        estimate(logp, log_r, "k3", clamp="openrlhf")


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
        assert torch.allclose(as_bool,
                              kl_loss(logp, ref_logp, (mask > 0).double(), kind, "loss", 1.0, 7))


def test_places_gradients_and_errors():
    logp = torch.randn(3, 5, dtype=f64).requires_grad_()
    ref_logp, mask, scores = (torch.randn(3, 5, dtype=f64), torch.ones(3, 5, dtype=f64),
                              torch.randn(3, dtype=f64))
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
    expected = torch.tensor([[R - (sum(group) - R) / (len(group) - 1) for R in group]
                             for group in groups])
    assert torch.allclose(rloo(returns, 4), expected.reshape(-1))
    assert torch.allclose(rloo(returns, 2),
                          torch.tensor([1.0, -1.0, -1.0, 1.0, -1.0, 1.0, -2.0, 2.0]))
    assert torch.allclose(group_mean(returns, 4)[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    std = (1 / 3) ** 0.5  # unbiased std of (1, 0, 0, 1)
    assert torch.allclose(group_normalized(returns, 4)[:4],
                          torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-6))
    for bad in (1, 3):
        with pytest.raises(ValueError, match="group_size"):
            rloo(returns, bad)


@pytest.mark.parametrize("T, G", [(2, 3), (3, 2), (2, 4)])
def test_rloo_baseline_adds_no_expected_gradient(T, G):
    """Enumerate every group of G samples: RLOO's expected gradient is exactly
    grad E[R - beta K1]."""
    m = toy(T, (0.4, -0.6), (-0.2, 0.3))
    scores = torch.rand(2**T, dtype=f64, generator=torch.Generator().manual_seed(0))
    # (2^T)^G groups, flat
    groups = torch.tensor(list(itertools.product(range(2**T), repeat=G))).reshape(-1)
    logp, ref_logp = m["logp"][groups], m["ref_logp"][groups]
    # prod_i pi(y_i)
    group_prob = logp.sum(-1).reshape(-1, G).sum(-1).exp().detach().repeat_interleave(G)
    mask = torch.ones_like(logp)
    returns = shape_rewards(scores[groups], logp, ref_logp, mask, "k1", "reward", 0.5)

    def grad(advantages):  # num_tokens = G: the loss is the group mean, in expectation over groups
        loss, _ = policy_loss(logp, logp.detach(), advantages, group_prob[:, None] * mask,
                              num_tokens=G)
        return torch.stack(torch.autograd.grad(loss, (m["a"], m["b"]), retain_graph=True))

    pi = m["logp"].sum(-1).exp()
    grad_reward = torch.stack(torch.autograd.grad((pi * scores).sum(), (m["a"], m["b"]),
                                                  retain_graph=True))
    target = -(grad_reward - 0.5 * references(m)["true"])
    assert close(grad(returns), target)  # no baseline
    assert close(grad(rloo(returns, G)), target)  # RLOO: same expected gradient
    # Dr. GRPO's mean includes R_i itself
    assert close(grad(group_mean(returns, G)), (G - 1) / G * target)


def test_policy_loss_gradient_and_clipping():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 5, 7, dtype=f64, generator=g).requires_grad_()
    tokens = torch.randint(0, 7, (4, 5), generator=g)
    logp = logits.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
    mask = torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2, [1.0] * 5, [1.0] * 1 + [0.0] * 4],
                        dtype=f64)
    adv = torch.randn(4, dtype=f64, generator=g)
    loss, clip_frac = policy_loss(logp, logp.detach(), adv, mask, num_tokens=14)
    # on-policy: grad = -(1/num_tokens) sum_i A_i grad log pi(y_i)
    (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)
    (expected,) = torch.autograd.grad(-(adv[:, None] * mask * logp).sum() / 14, logits)
    assert (close(grad, expected) and clip_frac.item() == 0
            and close(loss, -(adv[:, None] * mask).sum() / 14))
    # off-policy: ratios 0.5, 1.1, 1.5 with A = +1 and -1
    logp = torch.log(torch.tensor([[0.5, 1.1, 1.5], [0.5, 1.1, 1.5]], dtype=f64)).requires_grad_()
    adv, ones = torch.tensor([1.0, -1.0], dtype=f64), torch.ones(2, 3, dtype=f64)
    loss, clip_frac = policy_loss(logp, torch.zeros(2, 3, dtype=f64), adv, ones, num_tokens=6)
    # A > 0: min(w, clip(w)) = 0.5, 1.1, 1.2 (clipped at 1.5);
    # A < 0: -max(w, clip(w)) = -0.8 (clipped), -1.1, -1.5
    assert close(loss, -torch.tensor(0.5 + 1.1 + 1.2 - 0.8 - 1.1 - 1.5, dtype=f64) / 6)
    assert close(clip_frac, torch.tensor(2 / 6, dtype=f64)) and not clip_frac.requires_grad
    (grad,) = torch.autograd.grad(loss, logp)
    assert close(grad, torch.tensor([[-0.5, -1.1, 0.0], [0.0, 1.1, 1.5]], dtype=f64) / 6)


# ---- off-policy: samples from a behaviour policy mu != pi (sec. 3.2, last paragraph) -----------

# (T, pi's (a, b), mu's (a, b), pi_ref's (a, b), beta)
OFF_CASES = [(1, (0.3, 0.0), (-0.2, 0.0), (-0.4, 0.0), 1.0),
             (3, (0.5, -0.2), (0.1, 0.3), (0.0, -0.3), 0.1),
             (5, (-0.7, 0.4), (-0.3, 0.1), (0.2, 0.3), 0.5),
             (8, (0.5, -0.2), (0.8, -0.5), (0.0, -0.3), 2.0)]


def behaviour(m, mu):
    """Per-token log-probs of the toy's sequences under mu = (a, b) (eq. 17), constants."""
    z = mu[0] + mu[1] * m["c"]
    return (m["y"] * F.logsigmoid(z) + (1 - m["y"]) * F.logsigmoid(-z)).detach()


def off_policy_grad(m, mu_logp, kind, place, beta, shape_logp=None):
    """grad E_mu[loss] / beta of a configuration of Table 1 as train.py applies it to samples of mu:
    returns shaped with the behaviour log-probs (old_logp), the token ratio pi/mu of policy_loss (no
    clipping), the KL loss at pi. Each y is weighted by mu(y) through the mask. shape_logp: the
    log-probs the return is shaped with instead (--async-lag shapes with the current pi's)."""
    logp, ref_logp = m["logp"], m["ref_logp"]
    weight = mu_logp.sum(-1, keepdim=True).exp() * torch.ones_like(logp)  # mu(y)
    ones = torch.ones_like(logp)
    scores = torch.zeros(len(logp), dtype=f64)
    shape_logp = mu_logp if shape_logp is None else shape_logp
    returns = shape_rewards(scores, shape_logp, ref_logp, ones, kind, place, beta)
    pg_loss, _ = policy_loss(logp, mu_logp, returns, weight, num_tokens=1, clip_eps=1e9)
    loss = pg_loss + kl_loss(logp, ref_logp, weight, kind, place, beta, num_tokens=1)
    return torch.stack(torch.autograd.grad(loss, (m["a"], m["b"]), retain_graph=True)) / beta


def sequence_weighted_grad(m, mu_logp, beta, estimator):
    """grad E_mu[beta sum_i w_i sg[K_i]] / beta, w_i = prod_t pi/mu: kl.off_policy_kl_loss; or, with
    estimator="k2", Liu et al.'s (arXiv 2510.01555) importance-weighted K2-as-loss, sg[w_i] K2 of
    the whole sequence."""
    weight = mu_logp.sum(-1, keepdim=True).exp() * torch.ones_like(m["logp"])
    if estimator == "k1":
        loss = off_policy_kl_loss(m["logp"], mu_logp, m["ref_logp"], weight, beta, num_tokens=1)
    else:
        log_w = (m["logp"] - mu_logp).sum(-1).detach()
        k2 = 0.5 * (m["logp"] - m["ref_logp"]).sum(-1) ** 2  # the sequence as one action
        loss = beta * (weight[:, 0] * log_w.exp() * k2).sum()
    return torch.stack(torch.autograd.grad(loss, (m["a"], m["b"]), retain_graph=True)) / beta


def off_policy_references(m, mu_logp):
    """What each configuration computes off-policy, by hand for Bernoulli tokens: (2,) gradients."""
    y, c, z, z_ref = m["y"], m["c"], m["z"].detach(), m["z_ref"]
    p, q = torch.sigmoid(z), torch.sigmoid(z_ref)
    mu = mu_logp.sum(-1).exp()
    per_param = lambda g: torch.stack([g, g * c], -1)  # noqa: E731  d z_t / d(a, b) = (1, c_{t-1})
    token_score = per_param(y - p)  # grad log pi(y_t | y<t)
    omega = (m["logp"].detach() - mu_logp).exp()  # token-level ratio pi / mu
    r = (m["ref_logp"] - m["logp"]).detach().exp()  # pi_ref / pi
    k1_mu = (mu_logp - m["ref_logp"]).sum(-1)  # the KL in the reward, at the behaviour log-probs
    return dict(
        # K1-in-reward: E_mu[K1(mu, y) sum_t omega_t grad log pi(y_t | y<t)]
        k1_reward=(mu[:, None] * k1_mu[:, None] * (omega[..., None] * token_score).sum(1)).sum(0),
        # K1-in-loss: E_mu[grad log pi(y)], no longer 0 (eq. 13 needs y ~ pi)
        k1_loss=(mu[:, None] * token_score.sum(1)).sum(0),
        # K3-in-loss: E_mu[sum_t (1 - r_t) grad log pi(y_t | y<t)]
        k3_loss=(mu[:, None] * ((1 - r)[..., None] * token_score).sum(1)).sum(0),
    )


@pytest.mark.parametrize("T, theta, mu, ref, beta", OFF_CASES)
def test_off_policy_table1(T, theta, mu, ref, beta):
    """Off-policy every configuration of Table 1 is biased, and what each computes is written out
    by hand; the sequence-level importance weight w = prod_t pi/mu on sg[K1] (kl.off_policy_kl_loss)
    is the true gradient of KL(pi || pi_ref) exactly, under samples from mu; on-policy it is
    K1-in-reward."""
    m = toy(T, theta, ref)
    mu_logp = behaviour(m, mu)
    true, hand = references(m)["true"], off_policy_references(m, mu_logp)
    grad = lambda kind, place: off_policy_grad(m, mu_logp, kind, place, beta)  # noqa: E731
    assert close(grad("k1", "reward"), hand["k1_reward"])
    assert close(grad("k1", "loss"), hand["k1_loss"])
    assert close(grad("k3", "loss"), hand["k3_loss"])
    assert close(grad("k1", "both"), hand["k1_reward"] + hand["k1_loss"])
    for kind, place in [("k1", "reward"), ("k1", "loss"), ("k3", "reward"), ("k3", "loss"),
                        ("k1", "both"), ("k3", "both"), ("k2", "loss")]:
        assert (grad(kind, place) - true).abs().max() > 1e-3, (kind, place)
    # --async-lag shapes the return with the current pi's log-probs: biased from T = 2 on (at T = 1
    # the token ratio is the sequence's importance weight, and this is "weighted" below)
    async_k1 = off_policy_grad(m, mu_logp, "k1", "reward", beta, shape_logp=m["logp"].detach())
    assert (async_k1 - true).abs().max() > 1e-3 if T > 1 else close(async_k1, true)
    assert close(sequence_weighted_grad(m, mu_logp, beta, "k1"), true)  # unbiased off-policy
    # Liu et al.'s (2510.01555) importance-sampling correction, on the whole sequence's K2
    assert close(sequence_weighted_grad(m, mu_logp, beta, "k2"), true)
    # on-policy (mu = pi) the weighted loss is K1-in-reward, value and gradient
    pi_logp = m["logp"].detach()
    k1_in_reward = expected_loss_grad(m, "k1", "reward", beta) / beta
    assert close(sequence_weighted_grad(m, pi_logp, beta, "k1"), k1_in_reward)


@pytest.mark.parametrize("T, theta, ref, beta", CASES)
def test_liu_k2_as_loss_equals_k1_in_reward_for_the_whole_sequence(T, theta, ref, beta):
    """Liu et al. (2510.01555): on-policy, "K2 as loss" has K1-in-reward's gradient. Exactly so when
    the sequence is one action (K2 of the summed log-ratio): E[grad 1/2 (log pi(y)/pi_ref(y))^2] =
    grad KL at every T. The per-token K2 that implementations sum is that only at T = 1
    (test_expected_gradients_table1)."""
    m = toy(T, theta, ref)
    pi = m["logp"].sum(-1).exp().detach()
    k2_sequence = 0.5 * (m["logp"] - m["ref_logp"]).sum(-1) ** 2
    grad = torch.stack(torch.autograd.grad((pi * k2_sequence).sum(), (m["a"], m["b"]),
                                           retain_graph=True))
    assert close(grad, references(m)["true"])
    assert close(grad, expected_loss_grad(m, "k1", "reward", beta) / beta)


def test_truncated_is_loss_by_hand():
    """prime-rl's -min(w, C) A: gradient -w A / num_tokens per token where w <= C,
    0 past the cap."""
    g = torch.Generator().manual_seed(2)
    logp = (-3 * torch.rand(3, 5, dtype=f64, generator=g)).requires_grad_()
    # w = e^3 ... e^-3
    behaviour = logp.detach() + torch.tensor([-3.0, -1.0, 0.0, 1.0, 3.0], dtype=f64)
    advantages, mask = torch.tensor([1.0, -2.0, 0.5], dtype=f64), torch.ones(3, 5, dtype=f64)
    mask[2, 4] = 0
    loss, truncated = truncated_is_loss(logp, behaviour, advantages, mask, num_tokens=7.0, cap=8.0)
    (grad,) = torch.autograd.grad(loss, logp)
    w = (logp - behaviour).exp().detach()
    assert close(loss, (mask * -w.clamp(max=8.0) * advantages[:, None]).sum() / 7)
    assert close(grad, mask * -w * advantages[:, None] * (w <= 8.0) / 7)
    assert close(truncated, torch.tensor(3 / 7.0, dtype=f64))  # w = e^3 > 8 in each row

    # per-token advantages (B, T), as a KL to go gives them: each token weighted by its own A_t
    per_token = torch.rand(3, 5, dtype=f64, generator=g) - 0.5
    loss, _ = truncated_is_loss(logp, behaviour, per_token, mask, num_tokens=7.0, cap=8.0)
    assert close(loss, (mask * -w.clamp(max=8.0) * per_token).sum() / 7)

# ---- the KL as a per-token reward, summed to go (OpenRLHF), and toy.py's enumerators -------------


@pytest.mark.parametrize("T, theta, ref, beta", CASES)
def test_kl_to_go_in_the_reward_is_unbiased_with_less_variance(T, theta, ref, beta):
    """Token t's return R - beta sum_{s>=t} sg[K1_s], through the real policy_loss with per-token
    advantages: its expected gradient is grad KL exactly; here one sequence's gradient varies
    less."""
    import toy as toy_module

    m = toy(T, theta, ref)
    logp, ref_logp = m["logp"], m["ref_logp"]
    mask = torch.ones_like(logp)
    weight = logp.sum(-1, keepdim=True).exp().detach()
    to_go = kl_to_go(logp, ref_logp, mask, "k1")
    assert not to_go.requires_grad
    by_hand = torch.stack([(logp - ref_logp)[:, t:].sum(-1) for t in range(T)], -1).detach()
    assert close(to_go, by_hand)
    loss, _ = policy_loss(logp, logp.detach(), -beta * to_go, weight * mask, num_tokens=1)
    grad = torch.stack(torch.autograd.grad(loss, (m["a"], m["b"]), retain_graph=True)) / beta
    true = references(m)["true"]
    assert close(grad, true)
    whole_mean, whole_var = toy_module.kl_gradient_moments(T, False, theta, ref)
    to_go_mean, to_go_var = toy_module.kl_gradient_moments(T, True, theta, ref)
    assert close(whole_mean, true) and close(to_go_mean, true)
    # less variance in these cases (not always: at T = 2 with pi near pi_ref it can be more)
    assert to_go_var < whole_var if T > 1 else abs(to_go_var - whole_var) < TOL


@pytest.mark.parametrize("T, theta, ref, beta", CASES)
def test_toy_expected_gradient_is_table1(T, theta, ref, beta):
    """toy.expected_gradient, the enumerator the classroom's exercise E3 asks for, is Table 1."""
    import toy as toy_module

    m = toy(T, theta, ref)
    refs = references(m)
    expected = {("k1", "reward"): refs["true"], ("k1", "loss"): torch.zeros(2),
                ("k3", "reward"): refs["true"] + refs["eq19"], ("k3", "loss"): refs["eq41"],
                ("k1", "both"): refs["true"], ("k2", "loss"): refs["k2_path"]}
    for (kind, place), value in expected.items():
        assert close(toy_module.expected_gradient(kind, place, T, theta, ref), value), (kind, place)


@pytest.mark.parametrize("log_w", [90.0, 1000.0])
def test_off_policy_kl_loss_at_huge_weights(log_w):
    """A sequence whose w = prod_t pi/mu is e^90 (exp overflows fp32 from e^88.7) or e^1000
    (float64's too): the loss and gradient stay finite and are what each weight says. exact caps w
    at e^MAX_LOG_W (30), truncated at C = 8, self-normalized divides by the batch's mean w; the
    gradient on each token is beta w_i K1_i / num_tokens (d log w_i / d logp_t = 1)."""
    T, beta, num_tokens = 4, 0.5, 8
    logp = torch.full((2, T), -1.0, requires_grad=True)  # fp32, as in training
    ref_logp = torch.full((2, T), -1.5)  # K1 = 0.5 per token, 2 per sequence
    behaviour_logp = logp.detach() - torch.tensor([[log_w / T], [0.0]])  # log w = (log_w, 0)
    mask = torch.ones(2, T)
    log_mean_w = torch.tensor([log_w, 0.0], dtype=torch.float64).logsumexp(0).item() - math.log(2)
    for max_log_w, log_normalizer, w in [
        (kl_module.MAX_LOG_W, 0.0, (math.exp(30), 1.0)),  # exact (the default), capped
        (math.log(8), 0.0, (8.0, 1.0)),  # truncated
        (kl_module.MAX_LOG_W, log_mean_w, (2.0, 2 * math.exp(-log_w))),  # self-normalized
    ]:
        loss = off_policy_kl_loss(logp, behaviour_logp, ref_logp, mask, beta, num_tokens,
                                  max_log_w, log_normalizer)
        (grad,) = torch.autograd.grad(loss, logp)
        want = torch.tensor(w)[:, None].expand(2, T) * beta * 2 / num_tokens
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        assert loss.item() == pytest.approx(sum(w) * beta * 2 / num_tokens, rel=1e-6)
        assert torch.allclose(grad, want.float(), rtol=1e-5, atol=0), (max_log_w, grad)
    # the default is exact
    loss = off_policy_kl_loss(logp, behaviour_logp, ref_logp, mask, beta, num_tokens)
    assert loss.item() == pytest.approx((math.exp(30) + 1) * beta * 2 / num_tokens, rel=1e-6)
