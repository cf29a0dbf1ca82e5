"""E6: rollout.sample against a float64 definition of the distribution actually sampled."""
import torch

from classroom.harness import Wrong, f64, pick, tensor
from classroom.standins import sample, sampling_distribution

OWN, OTHERS, PATCH = ["rollout"], [], []
HINT = "The log-prob the trainer needs is of the tempered, truncated, renormalized distribution."


def draw(rng):
    n, V = rng.randint(1, 8), rng.randint(3, 60)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    return dict(logits=(rng.choice([1.0, 3.0]) * torch.randn(n, V, generator=g)).float(),
                temperature=rng.choice([1.0, rng.uniform(0.3, 1.7)]),
                top_p=rng.choice([1.0, rng.uniform(0.2, 0.97)]),
                uniform=torch.rand(n, dtype=f64, generator=g))


def call(c, run):
    got = run("sample", **c)
    n = len(c["logits"])
    return tensor(got["tokens"], "tokens", (n,)), tensor(got["logprobs"], "log-probs", (n,))


def greedy(c, run):
    """temperature = 0: the argmax, with log-prob 0 (a point mass)."""
    tokens, logprobs = call({**c, "temperature": 0.0}, run)
    if not torch.equal(tokens.long(), c["logits"].argmax(-1)):
        raise Wrong("greedy must take the argmax")
    if not (logprobs == 0).all():
        raise Wrong("greedy log-probs are log 1 = 0")


def inverse_cdf(c, run):
    """The token whose cumulative probability first exceeds the uniform (same token order)."""
    cdf = sampling_distribution(c["logits"], c["temperature"], c["top_p"]).cumsum(-1)
    want, _ = sample(c["logits"], c["temperature"], c["top_p"], c["uniform"])
    tokens, _ = call(c, run)
    # rows whose uniform sits within 1e-5 of a CDF step could go either way in float32
    near = ((cdf - c["uniform"][:, None]).abs() < 1e-5).any(-1)
    wrong = (tokens.long() != want) & ~near
    if wrong.any():
        raise Wrong(f"T = {c['temperature']:.2f}, top_p = {c['top_p']:.2f}: {int(wrong.sum())} "
                    "row(s) drew another token")


def logprobs(c, run):
    """The returned log-prob is log of the tempered, truncated, renormalized probability."""
    probs = sampling_distribution(c["logits"], c["temperature"], c["top_p"])
    tokens, got = call(c, run)
    if ((tokens < 0) | (tokens >= probs.shape[1])).any():
        raise Wrong("a token outside the vocabulary")
    want = probs.gather(-1, tokens.long()[:, None])[:, 0].log()
    error = (got.double() - want).abs().max().item()
    if not error < 1e-4:
        raise Wrong(f"T = {c['temperature']:.2f}, top_p = {c['top_p']:.2f}: log-probs off by "
                    f"{error:.2g}", f"T = {c['temperature']:.2f}, top_p = {c['top_p']:.2f}: "
                    "log-probs off by more than 1e-4")


def draw_crossing(rng):
    V = rng.randint(3, 12)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    probs = torch.rand(V, generator=g, dtype=f64) + 0.05
    probs, _ = (probs / probs.sum()).sort(descending=True)
    k = rng.randint(1, V - 2)  # top_p falls inside the k-th most likely token's mass
    return probs, k, float(probs[:k].sum() + probs[k] * rng.uniform(0.2, 0.8))


def crossing(c, run):
    """With the uniform at the top of the CDF, the last token of the nucleus is drawn: the one
    that crosses p."""
    probs, k, top_p = c
    tokens, got = call(dict(logits=probs.log().float()[None], temperature=1.0, top_p=top_p,
                            uniform=torch.tensor([0.999999], dtype=f64)), run)
    if tokens.item() != k:
        raise Wrong(f"top_p = {top_p:.3f}: drew the {tokens.item() + 1}-th most likely token, the "
                    f"nucleus ends at the {k + 1}-th",
                    f"top_p = {top_p:.3f}: the uniform at the top of the CDF drew a token other "
                    "than the last of the nucleus")
    if not abs(got.item() - (probs[k] / probs[:k + 1].sum()).log().item()) < 1e-4:
        raise Wrong("the crossing token's log-prob is not renormalized over the nucleus")


def tests(seed, hidden):
    draws = lambda name, fn, **n: list(enumerate(pick(seed, hidden, name, fn, **n)))  # noqa: E731
    return [
        dict(name="greedy", points=1, seconds=20, check=greedy,
             hint="temperature 0 is greedy: the argmax, a point mass (log-prob 0).",
             cases=draws("e6-greedy", draw, public=1, secret=3)),
        dict(name="tokens_by_inverse_cdf", points=2, seconds=20, check=inverse_cdf,
             hint="Draw the first token (in vocabulary order) whose cumulative probability "
                  "exceeds the uniform, over the renormalized nucleus.",
             cases=draws("e6-tokens", draw, public=4, secret=10)),
        dict(name="logprob_under_the_distribution_sampled", points=2, seconds=20, check=logprobs,
             hint=HINT, cases=draws("e6-logprobs", draw, public=4, secret=10)),
        dict(name="top_p_keeps_the_token_that_crosses_p", points=1, seconds=20, check=crossing,
             hint="Top-p keeps tokens while the mass before them is below p: the token that "
                  "crosses p is in the nucleus.",
             cases=draws("e6-crossing", draw_crossing, public=2, secret=5)),
    ]
