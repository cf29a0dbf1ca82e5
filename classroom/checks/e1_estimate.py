"""E1: kl.estimate against float64 definitions (eqs. 11, 14)."""
import torch

from classroom.harness import Wrong, close, f64, pick, size_of_error, tensor
from classroom.standins import estimate, k3_of_log_r

OWN, OTHERS, PATCH = ["kl"], [], []


def draw_inputs(rng):
    shape = (rng.randint(1, 6), rng.randint(1, 40))
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    spread = rng.choice([0.1, 1.0, 5.0])
    return (-spread * torch.rand(shape, dtype=f64, generator=g),
            -spread * torch.rand(shape, dtype=f64, generator=g))


def draw_small(rng):
    n = rng.randint(5, 30)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    x = 10 ** (-2 - 3 * torch.rand(n, generator=g)) * torch.where(torch.rand(n, generator=g) < 0.5,
                                                                 -1.0, 1.0)
    logp = -3 * torch.rand(n, generator=g)
    return logp.float(), (logp + x).float()


def values(c, run):
    """Each estimator's value per token, in float64."""
    (logp, ref_logp), kind = c
    got = run("kl_estimate", logp=logp, ref_logp=ref_logp, kind=kind)["value"]
    close(got, estimate(logp, ref_logp, kind), f"{kind} values", 1e-9)


def near_one(c, run):
    """K3 in float32 at |log r| in [1e-5, 1e-2]: relative error below 1e-2."""
    logp, ref_logp = c
    exact = k3_of_log_r(ref_logp.double() - logp.double())
    got = tensor(run("kl_estimate", logp=logp, ref_logp=ref_logp, kind="k3")["value"], "K3",
                 logp.shape)
    if got.dtype != torch.float32:
        raise Wrong(f"K3 of float32 inputs came back as {got.dtype}")
    relative = ((got.double() - exact).abs() / exact).max().item()
    if not relative < 1e-2:
        raise Wrong(f"K3 near r = 1: relative error {relative:.2g} in float32",
                    f"K3 near r = 1 in float32: {size_of_error(relative, 1.0)}")


def non_negative(dtype, run):
    """K3 >= 0 for log r from -30 to 30 and near 0, in float64, float32 and bfloat16."""
    log_r = torch.cat([torch.linspace(-30, 30, 2001), torch.logspace(-9, 0, 300),
                       -torch.logspace(-9, 0, 300), torch.zeros(3)]).to(getattr(torch, dtype))
    got = tensor(run("kl_estimate", logp=torch.zeros_like(log_r), ref_logp=log_r,
                     kind="k3")["value"], "K3", log_r.shape)
    if not torch.isfinite(got).all():
        raise Wrong(f"K3 is not finite in {dtype}")
    if not (got >= 0).all():
        raise Wrong(f"K3 < 0 in {dtype} at {int((got < 0).sum())} points")


def gradients(c, run):
    """d K / d logp per token: autograd through the estimate against the definition's."""
    logp, ref_logp = c
    for kind in ("k1", "k2", "k3"):
        got = run("kl_estimate", logp=logp, ref_logp=ref_logp, kind=kind, grad=True)["grad"]
        if got is None:
            raise Wrong(f"{kind}: no gradient reaches logp")
        x = logp.clone().requires_grad_()
        (want,) = torch.autograd.grad(estimate(x, ref_logp, kind).sum(), x)
        close(got, want, f"{kind} gradient in logp", 1e-8)


def verl_clamp(_, run):
    """clamp='verl': log r to [-20, 20], then K3 to [-10, 10]; zero gradient where clamped."""
    log_r = torch.tensor([-40.0, -25.0, -12.0, -3.0, 0.5, 2.0, 2.5, 5.0, 30.0], dtype=f64)
    got = run("kl_estimate", logp=torch.zeros_like(log_r), ref_logp=log_r, kind="k3",
              clamp="verl", grad=True)
    want = estimate(torch.zeros_like(log_r), log_r, "k3", clamp="verl")
    close(got["value"], want, "clamped K3", 1e-9)
    if got["grad"] is None:
        raise Wrong("clamped K3: no gradient reaches logp")
    grad = tensor(got["grad"], "gradient", log_r.shape)
    clamped = (want.abs() >= 10) | (log_r.abs() > 20)
    if not (grad[clamped] == 0).all():
        raise Wrong("a clamped value still has a gradient")
    if not (grad[~clamped] != 0).all():
        raise Wrong("an unclamped value lost its gradient")


def tests(seed, hidden):
    draw = lambda name, fn, **n: pick(seed, hidden, name, fn, **n)  # noqa: E731
    inputs = draw("e1-values", draw_inputs)
    return [
        dict(name="values", points=1, seconds=20, check=values,
             hint="K1 = log pi - log pi_ref (eq. 11), K2 = 1/2 (log pi - log pi_ref)^2, "
                  "K3 = r - 1 - log r with r = pi_ref / pi (eq. 14), per token.",
             cases=[(f"{kind}-{i}", (x, kind)) for kind in ("k1", "k2", "k3")
                    for i, x in enumerate(inputs)]),
        dict(name="k3_near_r_equal_1_in_float32", points=2, seconds=20, check=near_one,
             hint="Write K3 in terms of log r; which torch function computes e^x - 1 without "
                  "cancelling?",
             cases=list(enumerate(draw("e1-near-one", draw_small)))),
        dict(name="k3_non_negative_and_finite", points=1, seconds=20, check=non_negative,
             hint="K3 is a sum of non-negative terms in exact arithmetic; in floating point "
                  "e^x - 1 - x can cancel below 0 (torch.expm1).",
             cases=[(d, d) for d in ("float64", "float32", "bfloat16")]),
        dict(name="gradients_in_logp", points=1, seconds=20, check=gradients,
             hint="The estimate must stay differentiable in logp (no .detach(), no .item()).",
             cases=list(enumerate(draw("e1-grad", draw_inputs, public=1, secret=3)))),
        dict(name="verl_clamp", points=1, seconds=20, check=verl_clamp,
             hint="clamp='verl' bounds log r to [-20, 20] and then K3 to [-10, 10] "
                  "(torch.clamp: zero gradient where it clamps).",
             cases=[("fixed", None)]),
    ]
