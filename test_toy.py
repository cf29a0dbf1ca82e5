"""toy.py: its exact KL against enumeration, and the fast run's figures against Table 1."""

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import toy

TRIALS = 50


@pytest.fixture(scope="module")
def fast_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("toy")
    cmd = [sys.executable, "toy.py", "--out", str(out), "--fast", "--trials", str(TRIALS),
           "--samples", "200"]
    subprocess.run(cmd, cwd=Path(__file__).parent, check=True, capture_output=True, text=True)
    return out


def test_exact_kl_matches_enumeration():
    T = 7
    y = torch.tensor(list(itertools.product([0.0, 1.0], repeat=T)), dtype=torch.float64)
    a, b = (torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in toy.THETA)
    logp = toy.bernoulli_logp(toy.toy_logits(a, b, y), y).sum(-1)
    ref_logp = toy.bernoulli_logp(toy.toy_logits(*toy.REF, y), y).sum(-1)
    kl_enum = (logp.exp() * (logp - ref_logp)).sum()  # eq. 20 by brute force
    kl_dp = toy.exact_kl(a, b, T)
    assert abs(kl_dp.item() - kl_enum.item()) < 1e-12
    grad_enum = torch.autograd.grad(kl_enum, (a, b))
    grad_dp = torch.autograd.grad(kl_dp, (a, b))
    assert all(abs(x - y) < 1e-12 for x, y in zip(grad_enum, grad_dp))


def test_sampler_matches_the_model():
    y = toy.sample(*toy.THETA, (20000,), 3, torch.Generator().manual_seed(0))
    first = torch.sigmoid(torch.tensor(toy.THETA[0]))
    assert abs(y[:, 0].mean() - first) < 0.02  # p_1 = sigmoid(a)
    after_one = y[y[:, 0] == 1, 1].mean()
    # p_2 = sigmoid(a + b) after y_1 = 1
    assert abs(after_one - torch.sigmoid(torch.tensor(sum(toy.THETA)))) < 0.02


def test_figure1(fast_run):
    fig = json.loads((fast_run / "figure1.json").read_text())
    assert set(fig) == {"T", "configs"} and set(fig["configs"]) == set(toy.CONFIGS)
    assert (fast_run / "figure1.png").stat().st_size < 150_000
    c = fig["configs"]
    for i, T in enumerate(fig["T"]):
        noise = lambda name: c[name]["var"][i] / TRIALS  # E[bias^2] of an unbiased estimator
        for name in ("k1_reward", "k1_both", "k3_both"):
            assert c[name]["bias2"][i] < 10 * noise(name), (name, T)
        for name in ("k1_loss", "k3_reward"):
            assert c[name]["bias2"][i] > 100 * noise(name), (name, T)


def test_converge_reproduces_table1_behaviour(fast_run):
    res = json.loads((fast_run / "converge.json").read_text())
    assert (fast_run / "converge.png").stat().st_size < 150_000
    fields = {"expected_reward", "kl_to_ref", "kl_to_optimum", "objective", "diverged"}
    assert all(set(row) == fields for row in res["configs"].values())
    c, opt = res["configs"], res["optimum"]
    # unbiased: reach pi*
    for name in ("k1_reward", "k1_both", "k3_both"):
        assert not c[name]["diverged"] and c[name]["kl_to_optimum"] < 0.01
        assert abs(c[name]["objective"] - opt["objective"]) < 0.01
    # K1-in-loss: the KL term has zero expected gradient, so it follows beta = 0 exactly
    assert all(abs(c["k1_loss"][k] - c["no_kl"][k]) < 1e-9 for k in fields - {"diverged"})
    assert c["k1_loss"]["kl_to_optimum"] > 0.1
    # K3-in-loss: stable but elsewhere; K3-in-reward: the logits run off
    assert not c["k3_loss"]["diverged"] and c["k3_loss"]["kl_to_optimum"] > 0.05
    assert c["k3_reward"]["diverged"]
    assert not c["k2_loss"]["diverged"]


def test_off_policy_weighted_gradient_is_unbiased_and_what_it_costs(fast_run):
    """--place weighted in the toy: unbiased at every drift of mu from A; at drift 0 its one-sample
    variance is that of K1-in-reward's score-function gradient without a baseline, computed here by
    hand (sum_t (y_t - p_t)(1, c_{t-1}) times K1); far from A the importance weights blow it up."""
    T = 8
    rows = toy.off_policy_variance(T, (0.0, 1.0, 2.0))
    assert all(row["bias"] < 1e-9 for row in rows)
    y = torch.tensor(list(itertools.product([0.0, 1.0], repeat=T)), dtype=torch.float64)
    c = y.cumsum(-1) - y
    p = torch.sigmoid(toy.THETA[0] + toy.THETA[1] * c)
    logp = toy.bernoulli_logp(toy.toy_logits(*toy.THETA, y), y).sum(-1)
    ref_logp = toy.bernoulli_logp(toy.toy_logits(*toy.REF, y), y).sum(-1)
    score = torch.stack([(y - p).sum(-1), ((y - p) * c).sum(-1)], -1)
    g, pi = (logp - ref_logp)[:, None] * score, logp.exp()
    mean = (pi[:, None] * g).sum(0)
    assert abs(rows[0]["variance"] - (pi[:, None] * (g - mean) ** 2).sum().item()) < 1e-9
    assert rows[0]["second_moment_w"] == pytest.approx(1.0, abs=1e-12)
    assert rows[2]["variance"] > 100 * rows[0]["variance"] and rows[2]["second_moment_w"] > 100
    saved = json.loads((fast_run / "offpolicy.json").read_text())
    assert [row["drift"] for row in saved] == [0.0, 0.25, 0.5, 1.0, 2.0]
