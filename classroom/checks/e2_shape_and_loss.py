"""E2: kl.shape_rewards (eq. 7) and kl.kl_loss (eq. 9), with the stand-in estimator in place of
kl.estimate so that E1 does not count here."""
import torch

from classroom.harness import Wrong, close, f64, number, pick
from classroom import standins

OWN, OTHERS, PATCH = ["kl"], [], [["kl", "estimate"]]
PLACES = ("reward", "loss", "both", "none")


def draw(rng):
    B, T = rng.randint(1, 6), rng.randint(1, 12)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T) < lengths[:, None]).to(f64)
    if rng.random() < 0.5:  # a float mask weights tokens
        mask = mask * torch.rand(B, T, dtype=f64, generator=g)
    return dict(logp=-3 * torch.rand(B, T, dtype=f64, generator=g),
                ref_logp=-3 * torch.rand(B, T, dtype=f64, generator=g),
                scores=torch.rand(B, dtype=f64, generator=g), mask=mask,
                kind=rng.choice(["k1", "k2", "k3"]), beta=rng.choice([0.01, 0.1, 1.0]),
                num_tokens=float(mask.sum()) + rng.randint(0, 20))


def shaped_values(c, run):
    """R - beta sum_t mask KL_t for places reward and both, R otherwise."""
    c, place = c
    args = dict(scores=c["scores"], logp=c["logp"], ref_logp=c["ref_logp"], mask=c["mask"],
                kind=c["kind"], place=place, beta=c["beta"])
    got = run("shape_rewards", **args)["value"]
    close(got, standins.shape_rewards(**args), f"place={place}, {c['kind']}: returns", 1e-9)


def detached(c, run):
    """The shaped return is a constant to the optimizer: no gradient reaches logp through it."""
    got = run("shape_rewards", scores=c["scores"], logp=c["logp"], ref_logp=c["ref_logp"],
              mask=c["mask"], kind=c["kind"], place="reward", beta=c["beta"])
    if got["requires_grad"]:
        raise Wrong("the shaped return requires grad: it must be stop-gradient")


def loss_and_gradient(c, run):
    """beta sum mask KL / num_tokens and its path-wise gradient for places loss and both, else 0."""
    c, place = c
    args = dict(ref_logp=c["ref_logp"], mask=c["mask"], kind=c["kind"], place=place,
                beta=c["beta"], num_tokens=c["num_tokens"])
    got = run("kl_loss", logp=c["logp"], **args)
    logp = c["logp"].clone().requires_grad_()
    want = standins.kl_loss(logp, **args)
    number(got["value"], want.item(), f"place={place}, {c['kind']}: loss", 1e-9)
    if place in ("loss", "both"):
        if got["grad"] is None:
            raise Wrong(f"place={place}: no gradient reaches logp")
        (want_grad,) = torch.autograd.grad(want, logp)
        close(got["grad"], want_grad, f"place={place}: gradient in logp", 1e-9)


def frozen_reference(c, run):
    """The reference model is frozen: kl_loss sends no gradient into ref_logp."""
    got = run("kl_loss", logp=c["logp"], ref_logp=c["ref_logp"], mask=c["mask"], kind=c["kind"],
              place="loss", beta=c["beta"], num_tokens=c["num_tokens"], grad_of="ref_logp")
    if got["grad"] is not None and got["grad"].abs().max() != 0:
        raise Wrong("a gradient reached ref_logp")


def tests(seed, hidden):
    draws = lambda name, **n: list(enumerate(pick(seed, hidden, name, draw, **n)))  # noqa: E731
    return [
        dict(name="shape_rewards_values", points=2, seconds=20, check=shaped_values,
             hint="Eq. 7: the KL is subtracted from the return only for places reward and both, "
                  "summed over each row's tokens with the mask as weights.",
             cases=[(f"{place}-{i}", (c, place)) for i, c in draws("e2-shape")
                    for place in PLACES]),
        dict(name="shaped_return_carries_no_gradient", points=1, seconds=20, check=detached,
             hint="The return is a constant to the optimizer (stop-gradient: detach it).",
             cases=draws("e2-detach", public=1, secret=3)),
        dict(name="kl_loss_value_and_gradient", points=2, seconds=20, check=loss_and_gradient,
             hint="Eq. 9: beta sum mask KL / num_tokens, for places loss and both; it divides by "
                  "the batch's num_tokens, not by each row's length.",
             cases=[(f"{place}-{i}", (c, place)) for i, c in draws("e2-loss")
                    for place in PLACES]),
        dict(name="no_gradient_into_the_reference", points=1, seconds=20, check=frozen_reference,
             hint="The reference is frozen: detach ref_logp.",
             cases=draws("e2-ref", public=1, secret=3)),
    ]
