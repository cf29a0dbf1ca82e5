"""E3: toy.expected_gradient is Table 1, against independent exact references (eqs. 13, 19, 23,
41). The stand-ins of shape_rewards, kl_loss and policy_loss replace E2's and E4's."""
import torch

from classroom.harness import close, f64, pick
from classroom.reference import references, toy, toy_params

OWN, OTHERS = ["toy"], ["kl", "advantage"]
PATCH = [["toy", "shape_rewards"], ["toy", "kl_loss"], ["toy", "policy_loss"]]
HINT = ("An expectation over all sequences is a sum weighted by pi(y); that weight is a "
        "probability, not part of the model the gradient flows through.")
CONFIGS = {  # (kind, place) -> (what, the reference's expected gradient)
    ("k1", "reward"): ("k1 in reward vs grad KL (eqs. 10, 12, 23)", lambda r: r["true"]),
    ("k1", "loss"): ("k1 in loss vs 0 (eq. 13)", lambda r: torch.zeros(2, dtype=f64)),
    ("k3", "reward"): ("k3 in reward vs eq. 19", lambda r: r["true"] + r["eq19"]),
    ("k3", "loss"): ("k3 in loss vs eq. 41", lambda r: r["eq41"]),
}


def table1(c, run):
    """One configuration's exact expected gradient, a (2,) tensor in (a, b)."""
    (kind, place), (T, theta, ref) = c
    what, want = CONFIGS[kind, place]
    got = run("expected_gradient", kind=kind, place=place, T=T, theta=theta, ref=ref)["value"]
    close(got, want(references(toy(T, theta, ref))), f"T = {T}, {what}", 1e-9)


def tests(seed, hidden):
    out = []
    for (kind, place), points in zip(CONFIGS, (2, 1, 2, 2)):
        name = f"{kind}_in_{place}"
        params = pick(seed, hidden, f"e3-{kind}-{place}", toy_params)
        out.append(dict(name=name, points=points, seconds=30, check=table1, hint=HINT,
                        cases=[(i, ((kind, place), p)) for i, p in enumerate(params)]))
    return out
