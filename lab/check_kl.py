"""Is my KL term right? Its exact expected gradient on the paper's toy model (sec. 3.3, app. C),
on-policy and off-policy (sec. 3.2), against grad KL(pi || pi_ref) and Table 1's known gradients.

    python -m lab.check_kl FILE.py:FUNCTION --place loss|reward|reward-to-go|both \\
        [--aggregate token-mean|seq-mean|sum] [--ratio token|sequence|sequence-product|none]
        [--json | --show]
    python -m lab.check_kl --preset ID [--json]      # an entry of lab/kl_presets.py
    python -m lab.check_kl ... --model [MODEL]       # also measured on an LLM (SmolLM2 default)

FUNCTION(logp, ref_logp, old_logp, mask) returns the per-token term (B, T), differentiable in logp
as the user's library differentiates it (its detaches, clamps and ratios are inside it). All inputs
are float64; old_logp is log mu, the behaviour policy's (logp.detach() on-policy). The definitions
below, with a worked example: docs/check_kl.md.

The toy: binary tokens with p_t = sigmoid(a + b c_{t-1}) (eqs. 17-18), at a fixed length T, and with
a stop token (toy.toy_with_eos: EOS with probability sigmoid(e), lengths 1..T). SETTINGS gives
pi, mu and pi_ref, all different; in two of them far apart, so that clamps at +-10 act. beta = 1,
no task reward, every response enumerated, each weighted by its probability under the sampling
policy s (s = pi on-policy, s = mu off-policy):

  place loss:          E_s[ sum_t w_t grad term_t ]                              (eq. 9)
  place reward:        E_s[ sum_t w_t K grad rho_t ],  K = sum_t sg[term_t]      (eqs. 7-8)
  place reward-to-go:  E_s[ sum_t w_t K_t grad rho_t ], K_t = sum_{t'>=t} sg[term_t']
  place both:          loss + reward
  In reward places the term is taken at the rollout: term(old_logp, ref_logp, old_logp, mask).
  rho_t is the policy loss's surrogate (--ratio): "token" pi_t/mu_t (PPO, clip inactive),
  "sequence" exp(mean_t log pi_t/mu_t) on every token (GSPO), "sequence-product" pi(y)/mu(y) once
  a sequence (TRL's RLOO: exp(sum_t log pi_t/mu_t) / T_y on each token), "none" log pi_t
  (REINFORCE). On-policy each sums over the tokens to the gradient grad log pi(y).
  w_t is the aggregation with its constant undone: "sum" 1; "token-mean" 1 (the batch's token count
  is B E_s[T] for a large batch: the constant E_s[T] is undone); "seq-mean" E_s[T] / T_y (the same
  constant undone; at a fixed length w_t = 1, with EOS lengths no constant removes 1 / T_y).

The known gradients, each (a, b[, e]) at the current pi:
  "grad KL"                 grad KL(pi || pi_ref), sequence level, at pi whatever s is  (eq. 23)
  "0"                       zero                                                        (eq. 13)
  "K3-in-loss"              sum_t E_{y<t ~ s}[grad KL(pi_ref(.|y<t) || pi(.|y<t))]      (eq. 41)
  "K3-in-reward"            grad KL + E_pi[sum_t r_t grad log pi(y)] - grad E_pi[T]     (eq. 15)
  "token-level reverse KL"  sum_t E_{y<t ~ s}[grad KL(pi(.|y<t) || pi_ref(.|y<t))]
  The two token-level ones hold the prefixes fixed, drawn from the batch's policy s (mu
  off-policy: what a per-token ratio pi_t/mu_t can correct); eq. 15 is a sequence-level
  expectation, taken at pi (-grad E[T]: test_kl.py, EOS-ended lengths).

`equals` names the first known gradient that the term's E[g] equals to TOL in every setting (else
None); `cos` (the smallest) and `rel_bias` = ||E[g] - grad KL|| / ||grad KL|| (the largest) are
over the settings; `equals_at_fixed_length` is the verdict over the fixed-length settings only;
`equals_by_setting` each setting's first match (SETTING_NAMES: where a verdict fails).
"""
import argparse
import contextlib
import importlib
import importlib.util
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import toy

f64 = torch.float64
TOL = 1e-9  # test_kl.py's
PLACES = ("loss", "reward", "reward-to-go", "both")
AGGREGATES = ("token-mean", "seq-mean", "sum")
RATIOS = ("token", "sequence", "sequence-product", "none")
KNOWN = ("grad KL", "0", "K3-in-loss", "K3-in-reward", "token-level reverse KL")
# T, eos, and the parameters of pi, mu and pi_ref: (a, b) of eq. 17, and e (the stop logit).
# The last two are far apart, so that the libraries' clamps act: pi_ref(1 | y<t) ~ e^-10, so on most
# of pi's responses some token has K1_t > 10 and K3_t > 10 (either side of r); off-policy
# mu(1 | 0) ~ 0.05, so pi_t / mu_t > 10 on some of mu's responses (14% at fixed T = 3), and K3 of
# mu > 10 on a few.
SETTINGS = [(3, False, (0.5, -0.2), (0.1, 0.3), (0.0, -0.3)),
            (5, False, (-0.7, 0.4), (-0.3, 0.1), (0.2, 0.3)),
            (3, True, (0.5, -0.2, -0.8), (0.2, 0.1, -0.5), (0.0, -0.3, -1.5)),
            (5, True, (-0.7, 0.4, -1.2), (-0.4, 0.2, -0.9), (0.2, 0.3, -0.6)),
            (3, False, (2.0, 0.5), (-3.0, 2.0), (-9.5, -1.0)),
            (3, True, (2.0, 0.5, -1.5), (-3.0, 2.0, -0.5), (-9.5, -1.0, 1.0))]
SETTING_NAMES = ["T=3", "T=5", "EOS<=3", "EOS<=5", "T=3 far", "EOS<=3 far"]  # --json's settings


class TermError(ValueError):
    """The term broke the contract (raised, wrong shape, no gradient, NaN): a one-line message."""


def responses(T, eos, theta, ref):
    """Every response of the toy model: dict(params, mask, dist, ref_dist, logp, ref_logp) as
    toy.toy_with_eos returns it; at a fixed length, all 2^T binary sequences (toy.all_sequences)."""
    if eos:
        return toy.toy_with_eos(T, theta, ref)
    y, _ = toy.all_sequences(T)
    params = [torch.tensor(v, dtype=f64, requires_grad=True) for v in theta]

    def next_token_logp(a, b):
        # eq. 17: p_t = sigmoid(a + b c_{t-1}); (2^T, T, 2): log P(token 0, 1 | prefix)
        z = toy.toy_logits(a, b, y)
        return torch.stack([F.logsigmoid(-z), F.logsigmoid(z)], -1)

    dist, ref_dist = next_token_logp(*params), next_token_logp(*ref)
    pick = lambda d: d.gather(-1, y.long()[..., None])[..., 0]  # noqa: E731
    return dict(params=params, mask=torch.ones_like(y), dist=dist, ref_dist=ref_dist,
                logp=pick(dist), ref_logp=pick(ref_dist))


def one_line(error):
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200]}" if text else type(error).__name__


def call_term(term, logp, ref_logp, old_logp, mask, differentiable):
    """term(...) (B, T), checked, 0 after each response's end."""
    try:
        out = term(logp, ref_logp.clone(), old_logp.clone(), mask.clone())
    except Exception as error:  # the user's code: any exception is its own one-line verdict
        raise TermError(f"the term raised {one_line(error)}") from None
    if not isinstance(out, torch.Tensor):
        raise TermError(f"the term returned a {type(out).__name__}, not a (B, T) tensor")
    if tuple(out.shape) != tuple(logp.shape):
        raise TermError(f"the term returned shape {tuple(out.shape)}, not (B, T) = "
                        f"{tuple(logp.shape)}")
    if out.dtype != f64:
        raise TermError(f"the term returned {str(out.dtype).replace('torch.', '')}: keep float64 "
                        "inside it (the verdicts are to 1e-9)")
    response = mask > 0
    if not torch.isfinite(out[response]).all():
        raise TermError("the term returned NaN or inf on a response token")
    if differentiable and not out.requires_grad:
        raise TermError("the term has no gradient in logp (detached?), and a loss place "
                        "differentiates it")
    # a term of each sequence alone: the same rows from half the batch (no batch statistic)
    half = len(logp) // 2
    try:
        with torch.no_grad():
            alone = term(*(x[:half].detach().clone() for x in (logp, ref_logp, old_logp, mask)))
    except Exception as error:
        raise TermError(f"the term raised {one_line(error)} on half the batch") from None
    same = (isinstance(alone, torch.Tensor) and alone.shape == out[:half].shape
            and torch.allclose(torch.where(response[:half], alone.to(f64), 0.0),
                               torch.where(response[:half], out[:half].detach(), 0.0),
                               rtol=1e-12, atol=1e-12))
    if not same:
        raise TermError("the term of a sequence depends on the other sequences of the batch (a "
                        "batch statistic): the checker needs each row's term from its own row")
    return torch.where(response, out, torch.zeros((), dtype=f64))


def surrogate(logp, old_logp, mask, ratio):
    """rho_t, the policy loss's surrogate: its gradient weights the score term."""
    if ratio == "token":  # PPO: pi_t / mu_t, clip inactive
        return torch.exp(logp - old_logp)
    if ratio == "sequence":  # GSPO: exp(mean_t log pi_t / mu_t), broadcast onto every token
        mean_log_ratio = (mask * (logp - old_logp)).sum(-1, keepdim=True) / mask.sum(-1, True)
        return torch.exp(mean_log_ratio).expand_as(logp)
    if ratio == "sequence-product":  # TRL's RLOO: exp(sum_t log pi_t / mu_t) = pi(y) / mu(y)
        log_ratio = (mask * (logp - old_logp)).sum(-1, keepdim=True)
        return torch.exp(log_ratio).expand_as(logp) / mask.sum(-1, True)
    return logp  # REINFORCE: -A log pi_t


def gradient(m, loss):
    grads = torch.autograd.grad(loss, m["params"], retain_graph=True, allow_unused=True)
    return torch.stack([torch.zeros((), dtype=f64) if g is None else g for g in grads])


def token_losses(term, place, ratio, logp, ref_logp, old_logp, mask, group_size=None):
    """(B, T): each token's loss where `place` puts the term (beta 1, no task reward), before the
    aggregation's weights: the term itself in the loss places (eq. 9); in the reward places -A rho_t
    (eq. 8), A the return -sum_t sg[term_t] taken at the rollout (eq. 7; to go: the sum from t on).
    group_size G: RLOO's baseline on the sequence return (rows in groups of G, the mean of the
    other G - 1 subtracted: unbiased, lab/kl_gradients.py's samples); None: no baseline (exact)."""
    token_loss = torch.zeros_like(logp)
    if place in ("loss", "both"):
        # eq. 9: the term in the loss, path-wise through logp
        token_loss = token_loss + call_term(term, logp, ref_logp, old_logp, mask, True)
    if place in ("reward", "reward-to-go", "both"):
        # eq. 7 with R = 0, beta = 1: the term at the rollout, detached, in the return
        kl = call_term(term, old_logp.clone(), ref_logp, old_logp, mask, False).detach()
        if place == "reward-to-go":  # token t's return: -sum_{t' >= t} sg[term_t']
            advantage = -kl.flip(-1).cumsum(-1).flip(-1)
        else:
            advantage = -kl.sum(-1, keepdim=True)
            if group_size and group_size > 1:  # RLOO: minus the mean of the group's others
                groups = advantage.reshape(-1, group_size)
                others = (groups.sum(-1, keepdim=True) - groups) / (group_size - 1)
                advantage = (groups - others).reshape(-1, 1)
        # eq. 8: the score-function term, -A rho_t per token
        token_loss = token_loss - advantage * surrogate(logp, old_logp, mask, ratio)
    return token_loss


def expected_gradient(term, place, aggregate, ratio, m, sample_logp):
    """E_s[grad of the term's loss], exactly (module docstring); s's per-token log-probs given."""
    logp, ref_logp, mask = m["logp"], m["ref_logp"].detach(), m["mask"]
    old_logp = sample_logp.detach()
    prob = old_logp.sum(-1).exp()  # s(y): the weighted sum over every response is E_s
    lengths = mask.sum(-1, keepdim=True)
    if aggregate == "seq-mean":  # each sequence's mean, E_s[T] undone (no constant at EOS lengths)
        weight = mask * (prob[:, None] * lengths).sum() / lengths
    else:  # sum, or token-mean with the large batch's constant E_s[T] undone
        weight = mask
    token_loss = token_losses(term, place, ratio, logp, ref_logp, old_logp, mask)
    g = gradient(m, (prob[:, None] * weight * token_loss).sum())
    if not torch.isfinite(g).all():
        raise TermError("the term's gradient is NaN or inf")
    return g


def known_gradients(m, sample_logp):
    """The known gradients (module docstring), each a (params,) tensor; prefixes weighted by s."""
    logp, ref_logp, mask = m["logp"], m["ref_logp"].detach(), m["mask"]
    seq_logp, seq_ref = logp.sum(-1), ref_logp.sum(-1)
    pi = seq_logp.exp()
    prefix = sample_logp.detach().sum(-1).exp()[:, None] * mask  # P_s(y<t), each prefix once
    p_dist, q_dist = m["dist"], m["ref_dist"].detach()
    # eq. 20: KL(pi || pi_ref) = E_pi[log pi(y) / pi_ref(y)]; eq. 23: its gradient, pi not detached
    true = gradient(m, (pi * (seq_logp - seq_ref)).sum())
    # token-level KLs at each prefix, over the whole vocabulary
    forward = (q_dist.exp() * (q_dist - p_dist)).sum(-1)  # KL(pi_ref(.|y<t) || pi(.|y<t))
    reverse = (p_dist.exp() * (p_dist - q_dist)).sum(-1)  # KL(pi(.|y<t) || pi_ref(.|y<t))
    r = (ref_logp - logp).detach().exp() * mask  # r_t = pi_ref / pi on response tokens
    # eq. 19's term, E_pi[sum_t r_t grad log pi(y)], and grad E_pi[T] (lengths varying)
    eq19 = gradient(m, (pi.detach() * r.sum(-1) * seq_logp).sum())
    length = gradient(m, (pi * mask.sum(-1)).sum())
    return {"grad KL": true, "0": torch.zeros_like(true),
            "K3-in-loss": gradient(m, (prefix * forward).sum()),  # eq. 41
            "K3-in-reward": true + eq19 - length,  # eq. 15, with -grad E[T]
            "token-level reverse KL": gradient(m, (prefix * reverse).sum())}


def exact_gradients(term, place, aggregate="token-mean", ratio="token", off_policy=False):
    """[(setting, E[g], known gradients)] per setting of SETTINGS: the numbers behind check()."""
    rows = []
    for T, eos, theta, mu, ref in SETTINGS:
        m = responses(T, eos, theta, ref)
        sample_logp = responses(T, eos, mu, ref)["logp"] if off_policy else m["logp"]
        rows.append(((T, eos, theta, mu, ref),
                     expected_gradient(term, place, aggregate, ratio, m, sample_logp),
                     known_gradients(m, sample_logp.detach())))
    return rows


def matches(g, known):
    """The known gradients that g equals to TOL, in KNOWN's order."""
    return [name for name in KNOWN if (g - known[name]).abs().max().item() < TOL]


def verdict(rows):
    """{"equals", "cos", "rel_bias"} over the rows (worst over the settings)."""
    equals = next((name for name in KNOWN
                   if all(name in matches(g, known) for _, g, known in rows)), None)
    cos, rel_bias = 1.0, 0.0
    for _, g, known in rows:
        true = known["grad KL"]
        norm = g.norm().item()
        # a gradient that is 0 (to TOL) has no direction: cos 0
        cos = min(cos, (g @ true).item() / (norm * true.norm().item()) if norm > TOL else 0.0)
        rel_bias = max(rel_bias, ((g - true).norm() / true.norm()).item())
    return {"equals": equals, "cos": cos, "rel_bias": rel_bias}


def check(term, place, aggregate="token-mean", ratio="token"):
    """The term's exact verdict, on-policy and off-policy:
    {"on_policy": {"equals", "cos", "rel_bias", "equals_at_fixed_length"}, "off_policy": {...}}.
    Raises TermError (one line) where the term breaks the contract, ValueError on bad options."""
    for value, name, choices in ((place, "place", PLACES), (aggregate, "aggregate", AGGREGATES),
                                 (ratio, "ratio", RATIOS)):
        if value not in choices:
            raise ValueError(f"unknown {name} {value!r}: choose one of {', '.join(choices)}")
    return {regime: regime_verdict(exact_gradients(term, place, aggregate, ratio, off_policy))
            for regime, off_policy in (("on_policy", False), ("off_policy", True))}


def regime_verdict(rows):
    """One regime's entry of check() from exact_gradients' rows."""
    fixed = verdict([row for row in rows if not row[0][1]])
    # each setting's first match: where a verdict fails (a clamp acts only at the far ones)
    by_setting = {name: (matches(g, known) or [None])[0]
                  for name, (_, g, known) in zip(SETTING_NAMES, rows)}
    return {**verdict(rows), "equals_at_fixed_length": fixed["equals"],
            "equals_by_setting": by_setting}


DESCRIBE = {"grad KL": "unbiased", "0": "zero in expectation (eq. 13)",
            "K3-in-loss": "equals K3-in-loss (eq. 41)",
            "K3-in-reward": "equals K3-in-reward (eq. 15)",
            "token-level reverse KL": "equals the token-level reverse KL (prefixes held fixed)"}


def describe(row):
    """One regime's plain verdict."""
    numbers = f"cos {row['cos']:.4g}, relative bias {row['rel_bias']:.2g}"
    if row["equals"] == "grad KL":
        return "unbiased"
    text = f"biased: {numbers}"
    if row["equals"]:
        text = f"{DESCRIBE[row['equals']]}; {text}"
    if row["equals_at_fixed_length"] not in (None, row["equals"]):
        text += f" (at a fixed length: {DESCRIBE[row['equals_at_fixed_length']]})"
    elif row["equals"] is None:
        by_setting = row.get("equals_by_setting", {})
        held = {name for name in by_setting.values() if name}
        if len(held) == 1:  # one known gradient, failing at some settings only (a clamp, 1/T_y)
            name = held.pop()
            failed = [s for s, name_at in by_setting.items() if name_at != name]
            text += f" ({DESCRIBE[name]} except at {', '.join(failed)})"
    return text


# ---------------------------------------------------------------- the command line

parser = argparse.ArgumentParser(
    prog="python -m lab.check_kl",
    description="The exact expected gradient of a KL term on the paper's toy model, on- and "
                "off-policy, against grad KL(pi || pi_ref) (docs/check_kl.md).")
parser.add_argument("target", nargs="?", help="FILE.py:FUNCTION, FUNCTION(logp, ref_logp, "
                                              "old_logp, mask) -> the per-token term (B, T)")
parser.add_argument("--place", choices=PLACES,
                    help="where the library puts the term: the loss (path-wise), the sequence's "
                         "reward, the per-token reward summed to go, or both")
parser.add_argument("--aggregate", choices=AGGREGATES,
                    help="how the loss sums its tokens (default token-mean)")
parser.add_argument("--ratio", choices=RATIOS,
                    help="reward places: the policy loss's ratio pi/mu (default token)")
parser.add_argument("--preset", metavar="ID", help="a configuration of lab/kl_presets.py")
parser.add_argument("--json", action="store_true", help="print one JSON object")
parser.add_argument("--show", action="store_true",
                    help="also print each setting's E[g] beside grad KL (plain output only)")
group = parser.add_argument_group("on an LLM (lab/kl_gradients.py, docs/check_kl.md)")
group.add_argument("--model", nargs="?", const="smollm2-135m", default=None,
                   help="also measure the term on an LLM (pi_ref; default SmolLM2-135M-Instruct): "
                        "its sampled gradient at pi, a no-KL policy, against grad KL")
group.add_argument("--policy", default=None,
                   help="pi (a model directory; default step 20 of --train-dir, trained first "
                        "if absent: ~20 min on 2 CPU cores)")
group.add_argument("--train-dir", default="runs/kl-gradients/no-kl-seed0",
                   help="the no-KL run whose step 20 is pi (lab/kl_gradients.py's)")
group.add_argument("--groups", type=int, default=64,
                   help="groups of 4 responses sampled from pi (~5-10 CPU-s a group)")
group.add_argument("--chunks", default="runs/check-kl",
                   help="where the samples are saved (a rerun with more --groups extends them)")
group.add_argument("--model-args", default="",
                   help="more flags of lab/kl_gradients.py, in one string")


class InputError(Exception):
    """A bad command line: its one-line message."""


def load_function(target):
    """FILE.py:FUNCTION -> the function, or InputError naming the problem."""
    path, colon, name = target.rpartition(":")
    if not colon or not path or not name:
        raise InputError(f"expected FILE.py:FUNCTION, got {target!r}")
    file = Path(path)
    if not file.is_file():
        raise InputError(f"{path}: no such file")
    spec = importlib.util.spec_from_file_location(f"check_kl_target_{file.stem}", file)
    if spec is None:
        raise InputError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(file.resolve().parent))  # its own imports of its neighbours
    try:
        spec.loader.exec_module(module)
    except BaseException as error:  # SyntaxError, ImportError, SystemExit, ...: one line
        raise InputError(f"{path} does not import: {one_line(error)}") from None
    finally:
        sys.path.pop(0)
    function = getattr(module, name, None)
    if function is None:
        raise InputError(f"{path} has no function {name!r}")
    if not callable(function):
        raise InputError(f"{path}:{name} is not a function")
    return function


def load_preset(preset_id):
    """An entry of lab.kl_presets.PRESETS (imported only here), or InputError."""
    try:
        kl_presets = importlib.import_module("lab.kl_presets")
    except ModuleNotFoundError as error:
        if error.name == "lab.kl_presets":
            raise InputError("no presets here: lab/kl_presets.py is absent") from None
        raise InputError(f"lab/kl_presets.py does not import: {one_line(error)}") from None
    except Exception as error:
        raise InputError(f"lab/kl_presets.py does not import: {one_line(error)}") from None
    if preset_id not in kl_presets.PRESETS:
        raise InputError(f"unknown preset {preset_id!r}: choose one of "
                         f"{', '.join(kl_presets.PRESETS)}")
    return kl_presets.PRESETS[preset_id]


def run(args):
    """The verdict of the command line's term; InputError or TermError on bad input."""
    if args.preset and args.target:
        raise InputError("give FILE.py:FUNCTION or --preset ID, not both")
    if args.preset:
        preset = load_preset(args.preset)
        term, label = preset["term"], f"preset {args.preset}"
        place = args.place or preset["place"]
        aggregate = args.aggregate or preset.get("aggregate") or "token-mean"
        ratio = args.ratio or preset.get("ratio") or "token"
    elif args.target:
        if not args.place:
            raise InputError("--place is required: loss, reward, reward-to-go or both")
        term, label = load_function(args.target), args.target
        place, aggregate, ratio = args.place, args.aggregate or "token-mean", args.ratio or "token"
    else:
        raise InputError("give FILE.py:FUNCTION (with --place) or --preset ID")
    try:
        result = check(term, place, aggregate, ratio)
    except TermError as error:
        raise TermError(f"{label}: {error}") from None
    if args.model is not None:
        result["model"] = measure_on_model(term, place, aggregate, ratio, args)
    return label, (place, aggregate, ratio, term), result


def measure_on_model(term, place, aggregate, ratio, args):
    """The term as a sampled row of lab/kl_gradients.py on --model (its last layer, --groups
    groups at pi, on-policy): cos with grad KL, relative bias and, where the term equals a known
    gradient on the toy, its distance from that gradient's exact row (`vs_toy_verdict`: 0 inside
    the interval when the toy's verdict holds on the LLM). Each a [estimate, low, high] 95%."""
    import shlex
    from lab import kl_gradients
    if args.groups < 4:
        raise InputError(f"--groups {args.groups}: at least 4 (the intervals' U-statistics need "
                         "4 groups)")
    name = "term"
    fingerprint = kl_gradients.term_fingerprint(term, place, aggregate, ratio)
    chunk_groups = min(args.groups, 16)
    argv = ["--model", args.model, "--train-dir", args.train_dir, "--steps", "20",
            "--groups", str(args.groups), "--chunk-groups", str(chunk_groups),
            "--chunks", str(Path(args.chunks) / fingerprint / "chunks"),
            "--out", str(Path(args.chunks) / fingerprint), "--figure", ""]
    argv += ["--policy", args.policy] if args.policy else []
    argv += shlex.split(args.model_args)
    print(f"measuring on {args.model}: {args.groups} groups (lab/kl_gradients.py "
          f"{shlex.join(argv)})")
    try:
        results = kl_gradients.main(argv, terms={name: (term, place, aggregate, ratio)})
    except SystemExit as error:  # kl_gradients' own one-line refusals
        raise InputError(f"--model: {error}") from None
    (dist,) = results["distances"]
    row = dist["views"]["layer"]["terms"][name]
    parent = kl_gradients.term_parent(term, place, aggregate, ratio)
    return {"model": args.model, "policy": dist["policy"], "groups": dist["groups"],
            "view": "layer", "kl": dist["kl"], "cos": row["cos"], "rel_bias": row["rel_bias"],
            "toy_verdict": parent, "vs_toy_verdict": row.get("vs_parent")}


def main(argv=None):
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # tiny tensors: threads only add overhead
    try:
        # what the user's file prints goes to stderr: stdout is the verdict (one JSON object)
        with contextlib.redirect_stdout(sys.stderr):
            label, (place, aggregate, ratio, term), result = run(args)
    except (InputError, TermError, ValueError) as error:
        print(f"check_kl: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
        return 0
    settings = f"{len(SETTINGS)} settings of the toy model, fixed and EOS-ended lengths"
    print(f"{label}: --place {place} --aggregate {aggregate} --ratio {ratio} (exact, {settings})")
    print(f"on-policy:  {describe(result['on_policy'])}")
    print(f"off-policy: {describe(result['off_policy'])}")
    if "model" in result:
        print(describe_model(result["model"]))
    if args.show:
        with contextlib.redirect_stdout(sys.stderr):
            rows = {off: exact_gradients(term, place, aggregate, ratio, off)
                    for off in (False, True)}
        show(rows)
    return 0


def describe_model(row):
    """The LLM measurement's line."""
    interval = lambda x: f"{x[0]:.3g} [{x[1]:.3g}, {x[2]:.3g}]"  # noqa: E731
    text = (f"on {row['model']} (pi: {row['policy']}, {row['groups']} groups, last layer, "
            f"on-policy, 95%): cos {interval(row['cos'])}, relative bias "
            f"{interval(row['rel_bias'])}")
    if row["toy_verdict"]:
        low, high = row["vs_toy_verdict"][1:]
        held = "holds (0 inside)" if low <= 0 <= high else "does not hold (0 outside)"
        text += (f"; the toy's verdict ({row['toy_verdict']}) {held}: ||E[g] - its row||^2 / var "
                 f"{interval(row['vs_toy_verdict'])}")
    return text


def show(rows):
    """Each setting's exact E[g] beside grad KL, in the toy's parameters (a, b[, e])."""
    vector = lambda g: "(" + ", ".join(f"{x:+.6f}" for x in g.tolist()) + ")"  # noqa: E731
    for regime, off_policy in (("on-policy", False), ("off-policy", True)):
        for (T, eos, *_), g, known in rows[off_policy]:
            lengths = "EOS-ended lengths <= " if eos else "fixed length "
            print(f"  {regime:<11} {lengths}{T}: E[g] {vector(g)}, "
                  f"grad KL {vector(known['grad KL'])}")


if __name__ == "__main__":
    sys.exit(main())
