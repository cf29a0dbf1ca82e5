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
    subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], check=True, capture_output=True, text=True)
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


def test_weight_controls_trade_bias_for_variance():
    """--is-weight on the toy: exact is unbiased at every drift; truncated (C = 8) is exact until
    a weight passes C, then biased; self-normalized's batch gradient equals kl.off_policy_kl_loss
    with the batch's log mean weight, is unbiased at drift 0 (w = 1) and biased far from it. Both
    cost far less variance than the exact weight at drift 2."""
    import kl

    rows = {row["drift"]: row for row in toy.weight_controls(4, (0.0, 1.0, 2.0), batches=2000)}
    assert all(row["exact"]["bias"] < 1e-9 for row in rows.values())
    assert rows[0.0]["truncated"]["bias"] < 1e-9 and rows[2.0]["truncated"]["bias"] > 0.05
    assert rows[0.0]["self_normalized"]["bias"] < 3 * rows[0.0]["self_normalized"]["bias_stderr"]
    far = rows[2.0]["self_normalized"]
    assert far["bias"] > 5 * far["bias_stderr"]
    assert max(rows[2.0]["truncated"]["variance"], far["variance"]) < rows[2.0]["exact"]["variance"]
    # one batch through the real loss: sum_i w_i / mean_j w_j K1_i grad log pi(y_i) / n
    T, n = 4, 6
    y = torch.tensor(list(itertools.product([0.0, 1.0], repeat=T)), dtype=torch.float64)[:n]
    a, b = (torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in toy.THETA)
    logp = toy.bernoulli_logp(toy.toy_logits(a, b, y), y)
    ref_logp = toy.bernoulli_logp(toy.toy_logits(*toy.REF, y), y)
    mu_logp = toy.bernoulli_logp(toy.toy_logits(toy.THETA[0] + 1.0, toy.THETA[1], y), y)
    log_w = (logp - mu_logp).sum(-1).detach()
    log_mean_w = (log_w.logsumexp(0) - torch.log(torch.tensor(float(n)))).item()
    ones = torch.ones(n, T, dtype=torch.float64)
    loss = kl.off_policy_kl_loss(logp, mu_logp, ref_logp, ones, 1.0, n, log_normalizer=log_mean_w)
    got = torch.stack(torch.autograd.grad(loss, (a, b), retain_graph=True))
    k1 = (logp - ref_logp).sum(-1).detach()
    by_hand = ((log_w.exp() / log_w.exp().mean()) * k1 * logp.sum(-1)).sum() / n
    assert torch.allclose(got, torch.stack(torch.autograd.grad(by_hand, (a, b))), atol=1e-12)
