"""E6: rollout.sample against a float64 oracle of the distribution actually sampled."""
import pytest
import torch

import oracle
import rollout
from conftest import cases

f64 = torch.float64


def draw(rng):
    n, V = rng.randint(1, 8), rng.randint(3, 60)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    return dict(logits=(rng.choice([1.0, 3.0]) * torch.randn(n, V, generator=g)).float(),
                temperature=rng.choice([1.0, rng.uniform(0.3, 1.7)]),
                top_p=rng.choice([1.0, rng.uniform(0.2, 0.97)]),
                uniform=torch.rand(n, dtype=f64, generator=g))


def call(c):
    tokens, logprobs = rollout.sample(c["logits"], c["temperature"], c["top_p"], c["uniform"])
    n = len(c["logits"])
    assert tokens.shape == (n,) and logprobs.shape == (n,), "return (tokens (n,), logprobs (n,))"
    return tokens, logprobs


@pytest.mark.points(1)
@pytest.mark.parametrize("c", cases("e6-greedy", draw, public=1, hidden=3))
def test_greedy(c):
    """temperature = 0: the argmax, with log-prob 0 (a point mass)."""
    tokens, logprobs = call({**c, "temperature": 0.0})
    assert torch.equal(tokens, c["logits"].argmax(-1)), "greedy must take the argmax"
    assert (logprobs == 0).all(), "greedy log-probs are log 1 = 0"


@pytest.mark.points(2)
@pytest.mark.parametrize("c", cases("e6-tokens", draw, public=4, hidden=10))
def test_tokens_by_inverse_cdf(c):
    """The token whose cumulative probability first exceeds the uniform (same token order)."""
    probs = oracle.sampling_distribution(c["logits"], c["temperature"], c["top_p"])
    cdf = probs.cumsum(-1)
    want, _ = oracle.sample(c["logits"], c["temperature"], c["top_p"], c["uniform"])
    tokens, _ = call(c)
    # rows whose uniform sits within 1e-5 of a CDF step could go either way in float32
    near = ((cdf - c["uniform"][:, None]).abs() < 1e-5).any(-1)
    wrong = (tokens != want) & ~near
    assert not wrong.any(), (f"T = {c['temperature']:.2f}, top_p = {c['top_p']:.2f}: "
                             f"{int(wrong.sum())} row(s) drew another token")


@pytest.mark.points(2)
@pytest.mark.parametrize("c", cases("e6-logprobs", draw, public=4, hidden=10))
def test_logprob_under_the_distribution_sampled(c):
    """The returned log-prob is log of the tempered, truncated, renormalized probability."""
    probs = oracle.sampling_distribution(c["logits"], c["temperature"], c["top_p"])
    tokens, logprobs = call(c)
    want = probs.gather(-1, tokens[:, None])[:, 0].log()
    error = (logprobs.double() - want).abs().max().item()
    assert error < 1e-4, (f"T = {c['temperature']:.2f}, top_p = {c['top_p']:.2f}: log-probs off "
                          f"by {error:.2g}")


def draw_crossing(rng):
    V = rng.randint(3, 12)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    probs = torch.rand(V, generator=g, dtype=f64) + 0.05
    probs, _ = (probs / probs.sum()).sort(descending=True)
    k = rng.randint(1, V - 2)  # top_p falls inside the k-th most likely token's mass
    top_p = float(probs[:k].sum() + probs[k] * rng.uniform(0.2, 0.8))
    return probs, k, top_p


@pytest.mark.points(1)
@pytest.mark.parametrize("c", cases("e6-crossing", draw_crossing, public=2, hidden=5))
def test_top_p_keeps_the_token_that_crosses_p(c):
    """With the uniform at the top of the CDF, the last token of the nucleus is drawn: the one
    that crosses p."""
    probs, k, top_p = c
    logits = probs.log().float()[None]
    tokens, logprobs = rollout.sample(logits, 1.0, top_p, torch.tensor([0.999999], dtype=f64))
    assert tokens.item() == k, (f"top_p = {top_p:.3f}: drew the {tokens.item() + 1}-th most likely "
                                f"token, the nucleus ends at the {k + 1}-th")
    want = (probs[k] / probs[:k + 1].sum()).log().item()
    assert abs(logprobs.item() - want) < 1e-4, "its log-prob is not renormalized over the nucleus"
