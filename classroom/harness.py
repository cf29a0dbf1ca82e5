"""What the exercise checks (classroom/checks/) share: each case's parameters drawn from the seed,
and failure messages in two versions, public (with the values) and hidden (the case and the kind of
error, never an expected value), so that the hidden grade cannot be read back from its output."""
import math
import random

import torch

f64 = torch.float64


class Wrong(Exception):
    """A check that failed: `public` may print values, `hidden` never prints an expected one."""

    def __init__(self, public, hidden=None):
        super().__init__(public)
        self.public, self.hidden = public, public if hidden is None else hidden


def pick(seed, hidden, name, draw, public=2, secret=5):
    """The parameters of a test's cases: draw(rng) for each, rng seeded by (seed, name, i)."""
    return [draw(random.Random(f"{seed}:{name}:{i}")) for i in range(secret if hidden else public)]


def size_of_error(error, scale):
    """How far off, in words that do not give the expected value away: an order of magnitude of
    the relative error."""
    relative = error / scale if scale > 0 else math.inf
    for bound, words in ((1e-6, "under 1e-6"), (1e-3, "1e-6 to 0.1%"), (1e-2, "0.1% to 1%"),
                         (1e-1, "1% to 10%"), (1.0, "10% to 100%")):
        if relative < bound:
            return f"off by {words} of its size"
    return "off by more than its size"


def tensor(got, what, shape=None):
    """`got` as a tensor of `shape`, or Wrong."""
    if isinstance(got, dict) and "unreadable" in got:
        raise Wrong(f"{what}: returned a {got['unreadable']}, not a tensor")
    if not torch.is_tensor(got):
        raise Wrong(f"{what}: returned {type(got).__name__}, not a tensor")
    if shape is not None and tuple(got.shape) != tuple(shape):
        raise Wrong(f"{what}: shape {tuple(got.shape)}, expected {tuple(shape)}")
    return got


def close(got, want, what, tol):
    """Wrong unless tensor `got` has want's shape and max |got - want| <= tol."""
    got = tensor(got, what, want.shape).double()
    want = want.detach().double()
    if not torch.isfinite(got).all() and torch.isfinite(want).all():
        raise Wrong(f"{what}: not finite")
    error = (got - want).abs().max().item() if got.numel() else 0.0
    if not error <= tol:
        scale = want.abs().max().item() if want.numel() else 0.0
        show = lambda t: [round(v, 6) for v in t.flatten()[:8].tolist()]  # noqa: E731
        raise Wrong(f"{what}: off by {error:.2e} (got {show(got)}, want {show(want)})",
                    f"{what}: {size_of_error(error, scale)}")


def number(got, want, what, tol):
    """Wrong unless the scalar `got` is within tol of want."""
    got = tensor(got, what)
    if got.numel() != 1:
        raise Wrong(f"{what}: shape {tuple(got.shape)}, expected a scalar")
    close(got.reshape(()), torch.as_tensor(float(want), dtype=f64), what, tol)
