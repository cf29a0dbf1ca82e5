"""E4: advantage.rloo and advantage.policy_loss (sec. 4.1, eq. 4)."""
import itertools

import torch

from classroom.harness import Wrong, close, f64, number, pick
from classroom.reference import toy, toy_params
from classroom.standins import policy_loss

OWN, OTHERS, PATCH = ["advantage"], [], []


def draw_returns(rng):
    G, groups = rng.randint(2, 6), rng.randint(1, 4)
    return [rng.choice([0.0, 1.0, rng.uniform(-2, 2)]) for _ in range(G * groups)], G


def rloo_values(c, run):
    """A_i = R_i - mean of the other samples of its group."""
    returns, G = c
    got = run("rloo", returns=torch.tensor(returns, dtype=f64), group_size=G)["value"]
    want = [R - (sum(returns[k - k % G:k - k % G + G]) - R) / (G - 1)
            for k, R in enumerate(returns)]
    close(got, torch.tensor(want, dtype=f64), f"G = {G}: advantages", 1e-9)


def draw_groups(rng):
    T, G = rng.choice([(1, 2), (1, 3), (2, 2), (2, 3), (3, 2)])
    return T, G, toy_params(rng)[1:], rng.randrange(2**31)


def baseline(c, run):
    """Every group of G samples of the toy model enumerated: E[grad] with RLOO = without. The
    on-policy gradient of the PPO loss (num_tokens = G) is -(1/G) sum_i A_i grad log pi(y_i)."""
    T, G, (theta, ref), seed = c
    m = toy(T, theta, ref)
    scores = torch.rand(2**T, dtype=f64, generator=torch.Generator().manual_seed(seed))
    groups = torch.tensor(list(itertools.product(range(2**T), repeat=G))).reshape(-1)
    # grad_(a, b) log pi(y) = sum_t (y_t - p_t) (1, c_{t-1}), per sequence
    score = ((m["y"] - torch.sigmoid(m["z"].detach()))[..., None]
             * torch.stack([torch.ones_like(m["c"]), m["c"]], -1)).sum(1)
    group_prob = m["logp"].sum(-1).exp().detach()[groups].reshape(-1, G).prod(-1)
    advantages = close_shape(run("rloo", returns=scores[groups], group_size=G)["value"],
                             groups.shape)

    def grad(adv):
        per_sample = adv.double()[:, None] * score[groups] / G
        return -(group_prob[:, None] * per_sample.reshape(-1, G, 2).sum(1)).sum(0)

    close(grad(advantages), grad(scores[groups]), f"T = {T}, G = {G}: E[grad] with the baseline",
          1e-9)


def close_shape(got, shape):
    if not torch.is_tensor(got) or tuple(got.shape) != tuple(shape):
        raise Wrong(f"rloo: returned {tuple(getattr(got, 'shape', ()))}, expected {tuple(shape)}")
    return got


def draw_ppo(rng):
    B, T = rng.randint(2, 6), rng.randint(1, 8)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    logits = torch.randn(B, T, 7, dtype=f64, generator=g)
    tokens = torch.randint(0, 7, (B, T), generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    adv = torch.randn(B, dtype=f64, generator=g)
    per_token = rng.random() < 0.3
    return dict(logits=logits, tokens=tokens, mask=(torch.arange(T) < lengths[:, None]).to(f64),
                old_logp=(logits.log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
                          + 0.4 * torch.randn(B, T, dtype=f64, generator=g)),
                advantages=adv[:, None] * torch.linspace(1, -1, T, dtype=f64) if per_token else adv,
                clip_eps=rng.choice([0.1, 0.2, 0.3]),
                num_tokens=float(lengths.sum()) + rng.randint(0, 9))


def reference_loss(c, old_logp):
    logits = c["logits"].clone().requires_grad_()
    logp = logits.log_softmax(-1).gather(-1, c["tokens"][..., None])[..., 0]
    old = logp.detach() if old_logp is None else old_logp
    loss, frac = policy_loss(logp, old, c["advantages"], c["mask"], c["num_tokens"], c["clip_eps"])
    (grad,) = torch.autograd.grad(loss, logits)
    return loss.item(), frac.item(), grad


def compare_losses(c, on_policy):
    old = None if on_policy else c["old_logp"]

    def check(run):
        got = run("policy_loss", logits=c["logits"], tokens=c["tokens"], old_logp=old,
                  advantages=c["advantages"], mask=c["mask"], num_tokens=c["num_tokens"],
                  clip_eps=c["clip_eps"])
        loss, frac, grad = reference_loss(c, old)
        number(got["value"], loss, "loss", 1e-9)
        if got["grad"] is None:
            raise Wrong("no gradient reaches the logits")
        close(got["grad"], grad, "gradient (which tokens are clipped?)", 1e-9)
        number(got["clip_frac"], frac, "clip_frac", 1e-9)
    return check


def tests(seed, hidden):
    draws = lambda name, fn, **n: list(enumerate(pick(seed, hidden, name, fn, **n)))  # noqa: E731
    return [
        dict(name="rloo_values", points=2, seconds=20, check=rloo_values,
             hint="A_i = R_i - (sum of the group's returns - R_i) / (G - 1): the mean of the G - 1 "
                  "others, not divided by G.",
             cases=draws("e4-rloo", draw_returns, public=3, secret=6)),
        dict(name="rloo_baseline_adds_no_expected_gradient", points=2, seconds=30, check=baseline,
             hint="The baseline of sample i must not depend on sample i.",
             cases=draws("e4-baseline", draw_groups)),
        dict(name="policy_loss_on_policy", points=1, seconds=20,
             check=lambda c, run: compare_losses(c, True)(run),
             hint="On-policy the ratio is 1: the loss is -sum mask A / num_tokens, nothing "
                  "clipped; advantages may be (B,) or per token (B, T).",
             cases=draws("e4-on-policy", draw_ppo)),
        dict(name="policy_loss_clipping", points=2, seconds=20,
             check=lambda c, run: compare_losses(c, False)(run),
             hint="Per token, the clipped branch is active where it is the larger of the two "
                  "losses (eq. 4's min of the objectives); clip_frac counts those tokens.",
             cases=draws("e4-clip", draw_ppo, public=3, secret=6)),
    ]
