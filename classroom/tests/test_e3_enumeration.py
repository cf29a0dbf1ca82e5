"""E3: toy.expected_gradient is Table 1, against independent exact references (eqs. 13, 19, 23,
41). The oracle's shape_rewards, kl_loss and policy_loss stand in for E2's and E4's."""
import pytest
import torch

import oracle
import toy
from conftest import cases


@pytest.fixture(autouse=True)
def reference_losses(monkeypatch):
    for name in ("shape_rewards", "kl_loss", "policy_loss"):
        monkeypatch.setattr(toy, name, getattr(oracle, name))


def expected(kind, place, params):
    T, theta, ref = params
    got = toy.expected_gradient(kind, place, T, theta, ref)
    assert torch.is_tensor(got) and got.shape == (2,), "return a (2,) tensor: d/da, d/db"
    return got.detach().double()


def check(got, want, what):
    error = (got - want).abs().max().item()
    assert error < 1e-9, f"{what}: off by {error:.2e} (got {got.tolist()}, want {want.tolist()})"


@pytest.mark.points(2)
@pytest.mark.parametrize("params", cases("e3-k1-reward", oracle.toy_params))
def test_k1_in_reward_is_the_true_gradient(params):
    """K1 in the reward: grad KL (eqs. 10, 12, 23)."""
    refs = oracle.references(oracle.toy(*params))
    check(expected("k1", "reward", params), refs["true"], "k1 in reward vs grad KL")


@pytest.mark.points(1)
@pytest.mark.parametrize("params", cases("e3-k1-loss", oracle.toy_params))
def test_k1_in_loss_is_zero(params):
    """K1 in the loss: zero in expectation (eq. 13)."""
    check(expected("k1", "loss", params), torch.zeros(2, dtype=torch.float64), "k1 in loss vs 0")


@pytest.mark.points(2)
@pytest.mark.parametrize("params", cases("e3-k3-reward", oracle.toy_params))
def test_k3_in_reward_adds_eq19(params):
    """K3 in the reward: grad KL + E[sum_t r_t grad log pi(y)] (eqs. 15, 19)."""
    refs = oracle.references(oracle.toy(*params))
    check(expected("k3", "reward", params), refs["true"] + refs["eq19"], "k3 in reward vs eq. 19")


@pytest.mark.points(2)
@pytest.mark.parametrize("params", cases("e3-k3-loss", oracle.toy_params))
def test_k3_in_loss_is_eq41(params):
    """K3 in the loss: the token-level forward KL's gradient (eqs. 16, 41)."""
    refs = oracle.references(oracle.toy(*params))
    check(expected("k3", "loss", params), refs["eq41"], "k3 in loss vs eq. 41")
