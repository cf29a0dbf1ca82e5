"""E5: kl.kl_to_go, the KL as a per-token reward summed to go (OpenRLHF): values, and on the toy
model, exactly, that it keeps grad KL and gives the variance it should."""
import torch

from classroom.harness import Wrong, close, f64, number, pick, tensor
from classroom.reference import references, toy, toy_params
from classroom.standins import estimate

OWN, OTHERS, PATCH = ["kl"], [], [["kl", "estimate"]]
HINT = "A sum over s >= t is a cumulative sum read from the end (flip, cumsum, flip)."


def draw(rng):
    B, T = rng.randint(1, 6), rng.randint(1, 12)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    return dict(logp=-3 * torch.rand(B, T, dtype=f64, generator=g),
                ref_logp=-3 * torch.rand(B, T, dtype=f64, generator=g),
                mask=(torch.arange(T) < lengths[:, None]).to(f64), kind=rng.choice(["k1", "k3"]))


def values(c, run):
    """sum_{s >= t} mask_s KL_s per token, padding included as 0."""
    got = run("kl_to_go", **c)
    if got["requires_grad"]:
        raise Wrong("kl_to_go is part of a return: detach it")
    per_token = c["mask"] * estimate(c["logp"], c["ref_logp"], c["kind"])
    want = torch.stack([per_token[:, t:].sum(-1) for t in range(per_token.shape[1])], -1)
    close(got["value"], want, f"{c['kind']} to go", 1e-9)


def to_go_of_toy(m, run):
    logp = m["logp"].detach()
    got = run("kl_to_go", logp=logp, ref_logp=m["ref_logp"], mask=torch.ones_like(logp),
              kind="k1")["value"]
    return tensor(got, "K1 to go", logp.shape).double()


def score_function(m):
    """(2^T, T, 2): grad_(a, b) log pi(y_t | y<t) = (y_t - p_t) (1, c_{t-1}) per sequence, token."""
    return ((m["y"] - torch.sigmoid(m["z"].detach()))[..., None]
            * torch.stack([torch.ones_like(m["c"]), m["c"]], -1))


def unbiased(params, run):
    """Token t's advantage -sum_{s>=t} sg[K1_s], every sequence of the toy model: the expected
    policy gradient sum_y pi(y) sum_t K1-to-go_t grad log pi(y_t | y<t) is grad KL."""
    m = toy(*params)
    to_go = to_go_of_toy(m, run)
    pi = m["logp"].sum(-1).exp().detach()
    grad = (pi[:, None] * (to_go[..., None] * score_function(m)).sum(1)).sum(0)
    close(grad, references(m)["true"], f"T = {params[0]}: the expected gradient", 1e-9)


def variance(params, run):
    """The exact variance of one sequence's gradient with the submission's K1 to go, against the
    definition's (usually below the whole sequence's: 4x at T = 8; not always at T = 2)."""
    m = toy(*params)
    to_go = to_go_of_toy(m, run)
    k1 = (m["logp"] - m["ref_logp"]).detach()
    want = torch.stack([k1[:, t:].sum(-1) for t in range(k1.shape[1])], -1)
    score, pi = score_function(m), m["logp"].sum(-1).exp().detach()

    def of(k1):
        g = (k1[..., None] * score).sum(1)
        mean = (pi[:, None] * g).sum(0)
        return (pi[:, None] * (g - mean) ** 2).sum().item()

    number(torch.tensor(of(to_go), dtype=f64), of(want), f"T = {params[0]}: variance", 1e-9)


def tests(seed, hidden):
    draws = lambda name, fn, **n: list(enumerate(pick(seed, hidden, name, fn, **n)))  # noqa: E731
    return [
        dict(name="values_with_masks", points=2, seconds=20, check=values, hint=HINT,
             cases=draws("e5-values", draw, public=3, secret=6)),
        dict(name="k1_to_go_keeps_the_true_gradient", points=2, seconds=30, check=unbiased,
             hint="Token t's KL to go sums the estimates of tokens t..T (not 1..t), masked.",
             cases=draws("e5-unbiased", toy_params)),
        dict(name="the_variance_it_gives", points=1, seconds=30, check=variance, hint=HINT,
             cases=draws("e5-variance", toy_params)),
    ]
