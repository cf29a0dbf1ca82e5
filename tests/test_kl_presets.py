"""lab/kl_presets.py against hand-written references (issue 60, items 2 and 5).

Each preset's term is checked on small random float64 tensors, on-policy (old_logp = logp.detach())
and off-policy (old_logp of another policy): its VALUE against the library's estimator written here
independently (in probabilities, r = pi_ref / pi), and its autograd GRADIENT w.r.t. logp against
the closed form derived by hand (e.g. d/dlogp of (pi/mu) K3 = (pi/mu) K1; a straight-through term
has its surrogate's gradient; a detached ratio contributes none). Clamps are checked at each
library's bounds, and masked positions must not change the masked term. No exact checker here.
"""

import math

import pytest
import torch

from lab.kl_presets import PRESETS

IDS = [
    "paper-k1-reward", "paper-k1-loss", "paper-k3-reward", "paper-k3-loss",
    "trl-grpo-k3", "trl-grpo-k3-corrected", "trl-grpo-k3-corrected-sequence", "trl-rloo-k1",
    "nemo-k3", "nemo-k3-onpolicy-approx", "nemo-k3-before-2506",
    "slime-k1-loss", "slime-low-var-kl", "slime-unbiased-kl",
    "openrlhf-k1-reward", "openrlhf-k3-loss", "openrlhf-unbiased-gradient",
    "verl-k1-reward", "verl-low-var-kl-loss", "verl-k3plus-loss", "verl-k1plus-loss",
    "verl-k3plus-reward", "areal-kdrl", "skyrl-k3-loss", "skyrl-k2-loss",
]
KEYS = {"library", "configuration", "source", "place", "aggregate", "ratio", "term", "note"}
PLACES = {"loss", "reward", "reward-to-go"}
AGGREGATES = {"token-mean", "seq-mean", "sum"}
RATIOS = {"token", "sequence", "sequence-product", "none"}


# ---- the estimators, written from probabilities (independent of the module's log-ratio forms) ----

def k1(lp, ref):
    # log (pi / pi_ref)
    return torch.log(torch.exp(lp) / torch.exp(ref))


def k2(lp, ref):
    return 0.5 * k1(lp, ref) ** 2


def k3(lp, ref):
    # r - 1 - log r, r = pi_ref / pi
    r = torch.exp(ref) / torch.exp(lp)
    return r - 1 - torch.log(r)


def ratio(lp, old):
    # pi / mu
    return torch.exp(lp) / torch.exp(old)


def zeros(lp, ref, old, mask):
    return torch.zeros_like(lp)


def seq_ratio(lp, old, mask):
    # exp(mean over the sequence's tokens of log pi/mu), (B, 1)
    n = mask.sum(-1, keepdim=True).clamp(min=1.0)
    return torch.exp((torch.log(ratio(lp, old)) * mask).sum(-1, keepdim=True) / n)


def trl_sequence_grad(lp, ref, old, mask):
    # d/dlogp_t sum_s m_s c K3_s, c = seq ratio: c (1 - r_t) + c (sum_s m_s K3_s) / n
    c = seq_ratio(lp, old, mask)
    n = mask.sum(-1, keepdim=True).clamp(min=1.0)
    r = torch.exp(ref) / torch.exp(lp)
    return c * (1 - r) + c * (mask * k3(lp, ref)).sum(-1, keepdim=True) / n


def one(lp, ref, old, mask):
    # d K1 / d logp
    return torch.ones_like(lp)


def k3_grad(lp, ref, old, mask):
    # d K3 / d logp = 1 - r
    return 1 - torch.exp(ref) / torch.exp(lp)


def k1_grad(lp, ref, old, mask):
    # d K2 / d logp = K1; also d/dlogp of exp(x - sg x) K3 = K3 + (1 - r) = K1
    return k1(lp, ref)


def weighted_k1(lp, ref, old, mask):
    # d/dlogp (pi/mu) K3 = (pi/mu) K3 + (pi/mu)(1 - r) = (pi/mu) K1; and sg[pi/mu] d K2 = (pi/mu) K1
    return ratio(lp, old) * k1(lp, ref)


def value_k1(lp, ref, old, mask):
    return k1(lp, ref)


def value_k2(lp, ref, old, mask):
    return k2(lp, ref)


def value_k3(lp, ref, old, mask):
    return k3(lp, ref)


def value_weighted_k3(lp, ref, old, mask):
    return ratio(lp, old) * k3(lp, ref)


def value_seq_weighted_k3(lp, ref, old, mask):
    return seq_ratio(lp, old, mask) * k3(lp, ref)


def value_k1_at_old(lp, ref, old, mask):
    return k1(old, ref)


def value_k3_at_old(lp, ref, old, mask):
    return k3(old, ref)


# Per preset: (value(lp, ref, old, mask), the gradient of sum_t m_t term_t w.r.t. lp_t, divided by
# m_t; None where only the value counts), valid where no clamp acts (the random inputs keep
# |log r| < 1.5 and |log pi/mu| < 1: K3 < 2, pi/mu < 3).
REFERENCES = {
    "paper-k1-reward": (value_k1, None),
    "paper-k1-loss": (value_k1, one),
    "paper-k3-reward": (value_k3, None),
    "paper-k3-loss": (value_k3, k3_grad),
    "trl-grpo-k3": (value_k3, k3_grad),
    "trl-grpo-k3-corrected": (value_weighted_k3, weighted_k1),
    "trl-grpo-k3-corrected-sequence": (value_seq_weighted_k3, trl_sequence_grad),
    "trl-rloo-k1": (value_k1_at_old, zeros),
    # exp(x - sg x) K3: value K3, gradient K1, whatever mu is
    "nemo-k3": (value_k3, k1_grad),
    "nemo-k3-onpolicy-approx": (value_weighted_k3, weighted_k1),
    "nemo-k3-before-2506": (value_k3, k3_grad),
    "slime-k1-loss": (value_k1, one),
    "slime-low-var-kl": (value_k3, k3_grad),
    "slime-unbiased-kl": (value_weighted_k3, weighted_k1),
    "openrlhf-k1-reward": (value_k1_at_old, zeros),
    "openrlhf-k3-loss": (value_k3, k3_grad),
    # value K3; gradient of sg[w] K2 (the detached w contributes nothing)
    "openrlhf-unbiased-gradient": (value_k3, weighted_k1),
    "verl-k1-reward": (value_k1_at_old, zeros),
    "verl-low-var-kl-loss": (value_k3, k3_grad),
    # k3+ / k1+: the estimator's value, K2's gradient
    "verl-k3plus-loss": (value_k3, k1_grad),
    "verl-k1plus-loss": (value_k1, k1_grad),
    "verl-k3plus-reward": (value_k3_at_old, zeros),
    "areal-kdrl": (value_k1, one),
    "skyrl-k3-loss": (value_k3, k3_grad),
    "skyrl-k2-loss": (value_k2, k1_grad),
    "tba-prime-k3-loss": (value_k3_at_old, zeros),
}


def _inputs(seed, off_policy, B=4, T=6):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 0.05
    ref = lp + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5) * 3.0
    behaviour = lp + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5) * 2.0
    old = behaviour if off_policy else lp
    mask = torch.ones(B, T, dtype=torch.float64)
    mask[0, 4:] = 0.0
    mask[2, 2:] = 0.0
    return lp, ref, old, mask


def _value_and_grad(term, lp, ref, old, mask, on_policy):
    logp = lp.clone().requires_grad_(True)
    old_logp = logp.detach() if on_policy else old
    value = term(logp, ref, old_logp, mask)
    assert value.shape == lp.shape
    (grad,) = torch.autograd.grad((value * mask).sum(), logp, allow_unused=True)
    grad = torch.zeros_like(lp) if grad is None else grad
    return value.detach(), grad


def test_every_id_is_present_with_the_contract_keys():
    assert sorted(set(IDS) - set(PRESETS)) == []
    assert any(key.startswith("tba-prime-") for key in PRESETS)
    for key, preset in PRESETS.items():
        assert set(preset) == KEYS, key
        assert preset["place"] in PLACES, key
        assert preset["aggregate"] in AGGREGATES, key
        assert preset["ratio"] in RATIOS, key
        assert callable(preset["term"]), key
        assert all(isinstance(preset[k], str) and preset[k] for k in KEYS - {"term"}), key
    assert set(REFERENCES) == set(PRESETS)


def test_sources_name_a_commit():
    for key, preset in PRESETS.items():
        if preset["library"] != "paper":
            assert "@" in preset["source"], key


@pytest.mark.parametrize("on_policy", [True, False], ids=["on-policy", "off-policy"])
@pytest.mark.parametrize("key", sorted(REFERENCES))
def test_value_and_gradient_match_the_hand_derived_forms(key, on_policy):
    value_of, grad_of = REFERENCES[key]
    for seed in range(3):
        lp, ref, old, mask = _inputs(seed, off_policy=not on_policy)
        old_ref = lp if on_policy else old
        value, grad = _value_and_grad(PRESETS[key]["term"], lp, ref, old, mask, on_policy)
        expected = value_of(lp, ref, old_ref, mask)
        torch.testing.assert_close(value * mask, expected * mask, rtol=1e-12, atol=1e-12)
        if grad_of is not None:
            expected_grad = grad_of(lp, ref, old_ref, mask) * mask
            torch.testing.assert_close(grad, expected_grad, rtol=1e-11, atol=1e-12)


def test_ratio_corrected_terms_give_k1_on_policy():
    # the token-level reverse KL's per-token coefficient: d term / d logp = K1 when mu = pi
    lp, ref, _, mask = _inputs(7, off_policy=False)
    for key in ("trl-grpo-k3-corrected", "nemo-k3", "nemo-k3-onpolicy-approx", "slime-unbiased-kl",
                "openrlhf-unbiased-gradient", "verl-k3plus-loss", "verl-k1plus-loss",
                "skyrl-k2-loss"):
        _, grad = _value_and_grad(PRESETS[key]["term"], lp, ref, lp, mask, on_policy=True)
        torch.testing.assert_close(grad, (lp - ref) * mask, rtol=1e-12, atol=1e-12, msg=key)


def test_masked_positions_are_ignored():
    for key, preset in PRESETS.items():
        for on_policy in (True, False):
            lp, ref, old, mask = _inputs(3, off_policy=not on_policy)
            value, grad = _value_and_grad(preset["term"], lp, ref, old, mask, on_policy)
            hidden = mask == 0
            g = torch.Generator().manual_seed(5)
            noise = torch.randn(lp.shape, dtype=torch.float64, generator=g)
            lp2, ref2, old2 = (torch.where(hidden, x + noise, x) for x in (lp, ref, old))
            value2, grad2 = _value_and_grad(preset["term"], lp2, ref2, old2, mask, on_policy)
            torch.testing.assert_close(value2 * mask, value * mask, rtol=0, atol=1e-13, msg=key)
            torch.testing.assert_close(grad2 * mask, grad * mask, rtol=0, atol=1e-13, msg=key)


# ---- clamps at each library's bounds ----

def _one_row(log_r, lp=-1.0):
    """logp = lp everywhere, ref_logp = lp + log_r (so log r = log pi_ref/pi is given), (1, T)."""
    log_r = torch.tensor([log_r], dtype=torch.float64)
    lp = torch.full_like(log_r, lp)
    return lp, lp + log_r, torch.ones_like(log_r)


LOG_R = [-30.0, -12.0, -1.0, 0.5, 2.8, 25.0]


def _k3_at(log_r):
    return math.exp(log_r) - 1 - log_r


@pytest.mark.parametrize("key", ["verl-low-var-kl-loss", "skyrl-k3-loss", "nemo-k3-before-2506",
                                 "slime-low-var-kl", "openrlhf-k3-loss"])
def test_k3_clamped_to_ten_with_zero_gradient(key):
    lp, ref, mask = _one_row(LOG_R)
    value, grad = _value_and_grad(PRESETS[key]["term"], lp, ref, lp, mask, on_policy=True)
    for i, log_r in enumerate(LOG_R):
        k3_value = _k3_at(min(max(log_r, -20), 20))
        if k3_value > 10:  # every |log r| here past ~2.6 (r > 14) or below -11
            assert value[0, i].item() == 10.0 and grad[0, i].item() == 0.0, (key, log_r)
        else:
            assert value[0, i].item() == pytest.approx(k3_value, rel=1e-12)
            assert grad[0, i].item() == pytest.approx(1 - math.exp(log_r), rel=1e-12)


@pytest.mark.parametrize("key", ["trl-grpo-k3", "paper-k3-loss"])
def test_unclamped_k3_is_not_clamped(key):
    lp, ref, mask = _one_row([2.8, -12.0])
    value, grad = _value_and_grad(PRESETS[key]["term"], lp, ref, lp, mask, on_policy=True)
    assert value[0].tolist() == pytest.approx([_k3_at(2.8), _k3_at(-12.0)], rel=1e-12)
    assert grad[0].tolist() == pytest.approx([1 - math.exp(2.8), 1 - math.exp(-12.0)], rel=1e-12)


def test_openrlhf_clamps_k1_too():
    # OpenRLHF clamps every estimator's output to [-10, 10]: K1 = -log r = 30 becomes 10
    lp, ref, mask = _one_row([-30.0, 12.0, 0.5])
    value, _ = _value_and_grad(PRESETS["openrlhf-k1-reward"]["term"], lp, ref, lp, mask, True)
    assert value[0].tolist() == pytest.approx([10.0, -10.0, -0.5], rel=1e-12)
    value, _ = _value_and_grad(PRESETS["verl-k1-reward"]["term"], lp, ref, lp, mask, True)
    assert value[0].tolist() == pytest.approx([30.0, -12.0, -0.5], rel=1e-12)


def test_k3plus_value_is_clamped_but_its_k2_gradient_is_not():
    lp, ref, mask = _one_row([2.8, 25.0, 0.5])
    value, grad = _value_and_grad(PRESETS["verl-k3plus-loss"]["term"], lp, ref, lp, mask, True)
    assert value[0].tolist() == pytest.approx([10.0, 10.0, _k3_at(0.5)], rel=1e-12)
    # gradient of K2 = 1/2 (log pi - log pi_ref)^2: log pi - log pi_ref = -log r
    assert grad[0].tolist() == pytest.approx([-2.8, -25.0, -0.5], rel=1e-12)


def test_openrlhf_weight_is_clamped_at_ten_and_detached():
    lp, ref, mask = _one_row([0.5, 0.5, 0.5])
    old = lp - torch.tensor([[3.0, 1.0, -1.0]], dtype=torch.float64)  # pi/mu = e^3 (> 10), e, 1/e
    term = PRESETS["openrlhf-unbiased-gradient"]["term"]
    value, grad = _value_and_grad(term, lp, ref, old, mask, on_policy=False)
    assert value[0].tolist() == pytest.approx([_k3_at(0.5)] * 3, rel=1e-12)
    weights = [10.0, math.e, math.exp(-1.0)]
    assert grad[0].tolist() == pytest.approx([-0.5 * w for w in weights], rel=1e-12)


def test_nemo_clamps_the_weighted_k3():
    # weight * K3 clamped to 10 (the weight's gradient with it); log r clamped to 20 first
    lp, ref, mask = _one_row([2.0, 2.0, 25.0])
    old = lp - torch.tensor([[0.0, 1.0, 0.0]], dtype=torch.float64)  # pi/mu = 1, e, 1
    term = PRESETS["nemo-k3-onpolicy-approx"]["term"]
    value, grad = _value_and_grad(term, lp, ref, old, mask, on_policy=False)
    k3_2 = _k3_at(2.0)  # 4.39: times e is 11.9 > 10
    assert value[0].tolist() == pytest.approx([k3_2, 10.0, 10.0], rel=1e-12)
    assert grad[0].tolist() == pytest.approx([-2.0, 0.0, 0.0], rel=1e-12)


def test_slime_clamps_after_the_ratio():
    lp, ref, mask = _one_row([2.0, 2.0])
    old = lp - torch.tensor([[0.0, 1.0]], dtype=torch.float64)
    value, grad = _value_and_grad(PRESETS["slime-unbiased-kl"]["term"], lp, ref, old, mask, False)
    assert value[0].tolist() == pytest.approx([_k3_at(2.0), 10.0], rel=1e-12)
    assert grad[0].tolist() == pytest.approx([-2.0, 0.0], rel=1e-12)


def test_reward_terms_read_the_sampling_time_logprobs():
    # off-policy, TRL RLOO / verl / OpenRLHF take the reward's KL from old_logp; the paper's is logp
    lp, ref, old, mask = _inputs(11, off_policy=True)
    for key, at_old in (("trl-rloo-k1", True), ("verl-k1-reward", True),
                        ("openrlhf-k1-reward", True), ("paper-k1-reward", False)):
        value, _ = _value_and_grad(PRESETS[key]["term"], lp, ref, old, mask, on_policy=False)
        torch.testing.assert_close(value, (old if at_old else lp) - ref, msg=key)
