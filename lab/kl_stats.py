"""The statistics of kl_gradients.py: inner products of expected gradients as U-statistics over
i.i.d. units, with intervals from the U-statistics' Hoeffding decomposition (paper Table 1 measured
on an LLM; the method of docs/kl_gradients.md).

Units. n i.i.d. units k (a group of G sequences, or the mean of a batch of groups) give a vector
v_k for each base row v (a configuration's gradient at the kept coordinates). One Gram matrix per
pair of rows, K_kl = <a_k, b_l> (symmetrized), carries everything:

    U(a, b) = sum_{k != l} K_kl / (n (n - 1))   unbiased for E[a] . E[b]: no noise floor tr Cov / n
    D(a, b) = mean_k K_kk                        unbiased for E<a, b>
    tr Cov(sum_i alpha_i v_i) = sum_ij alpha_i alpha_j (D - U)(i, j)   (one sequence's: G times it)

Every quantity is a function of the vector of (U, D) statistics, most of them linear (`dot`,
`trace`) or ratios of linear ones.

Covariance (Hoeffding). U - theta = (2/n) sum_k (h1(v_k) - theta) + a degenerate part, so
Var U = [4 (n - 2) zeta_1 + 2 zeta_2] / (n (n - 1)) with zeta_1 = Var h1 (h1(x) = <x, E b>) and
zeta_2 = Var <a_k, b_l>. Both are estimated without bias by products of the kernels over distinct
indices (inclusion-exclusion over coincident ones: both shared, A2 = <K, K'>_F / (n)_2; one,
A3 = (r . r' - <K, K'>_F) / (n)_3; none, A4 = (S S' - 4 r . r' + 2 <K, K'>_F) / (n)_4 with S the
sum and r the row sums of the zero-diagonal K): zeta_1 = A3 - A4, zeta_2 = A2 - A4, jointly for all
statistics (a mean D's influence is its own term). Their sum is exactly U U' - A4, the unbiased
covariance; each is then projected onto the positive semi-definite matrices, since near a zero
mean zeta_1 is fitted to noise and an unbiased variance can fall below 0.

Intervals (95%).
- A squared norm ||E[sum alpha_i v_i]||^2 (`norm2`): a score interval, {theta : (U - theta)^2 <=
  z^2 Var(theta)}, the variance taken at the candidate theta, Var(theta) = [2 zeta_2 + 4 (n - 2)
  rho theta] / (n (n - 1)), rho = E[x_bar' Cov x_bar] / E||x_bar||^2 (the covariance along the mean,
  trCov^2 / trCov at a zero mean). A Wald interval (estimate +- z se) is too wide at a zero mean:
  the se then carries zeta_1's noise, which grows with U itself (98.5-100% coverage); the percentile
  bootstrap used before is 1.7x too wide there (Arcones and Gine 1992: resampling adds its own
  degenerate term), a plain jackknife ~1.4x (Efron and Stein 1981). tests/test_kl_gradients.py checks
  90-99% coverage at a zero mean, heavy tails included (the bootstrap's failure there was measured
  when it was replaced, issue 27; no test keeps a bootstrap).
- A ratio A / B of linear statistics (`ratio`): Fieller's, {r : (A - r B)^2 <= z^2 Var(A - r B)};
  unbounded where B is not resolved (B^2 < z^2 Var B). n* = tr Var / ||bias||^2 is the inverse of
  ||bias||^2 / tr Var's interval, a relative bias the square root of its square's.
- A cosine (`cosine`): the delta method on atanh(cos) (Fisher's z), mapped back, where both
  norms are resolved (their intervals exclude 0); [-1, 1] where not. At the edge of resolution
  the plug-in cosine is itself biased and no interval covers it well.
- Two views on the same units (`paired`: the last layer and the whole model, issue 36): the rows
  restricted to the layer's coordinates and to the rest's are rows of one moments() (disjoint
  coordinates: their cross inner products are 0, `dot`), so the model's cosine minus the layer's
  gets the delta method on one covariance (`smooth`; 94-97% coverage in tests/test_kl_gradients.py).

Table 1's quantities (`summarize`, per view: each block alone, and the layer, the blocks
reweighted; with --layers whole also every layer's attention, MLP, and the model). With
g = p2 + f = grad KL (eq. 29): ||grad KL||^2 (`resolved` if its interval excludes 0) and over
one sequence's variance of K1-in-reward (snr) and of g itself (snr_exact); f's share
f . g / ||g||^2 and ||f|| / ||g||; f's baseline, the variance without it over with it; the clamp's
shift ||E[verl] - E[K3-in-reward]|| / ||g||. Per sampled row: one sequence's variance, over
task_pg's; `check` = ||E[row] - E[its exact expectation]||^2 / var_ref (Table 1 holds: 0 inside);
its exact counterpart's variance over its own. Per biased row: cos(E[row], g), ||E[row] - g|| /
||g||, n* = tr Var / ||E[row] - g||^2. Per --grad-tail row (sampled K3 row over ratios <= R minus
its exact expectation): its check (also at Z_TAIL), and the whole row's check minus it (the
tokens above R).
`plot` draws them by distance: Table 1 as a measured column.
"""
import math
from pathlib import Path

import numpy as np
import torch

Z95 = 1.959963984540054  # the two-sided 95% normal quantile
# --grad-tail's checks at 95% / 8 (Bonferroni over a distance's 8: 2 rows x 2 ratios x 2 views)
Z_TAIL = 2.7343687865331767
NAN3 = [math.nan] * 3
# each sampled row's expectation in kl_gradients.py's exact rows (g = p2 + f = grad KL, eq. 29;
# eq. 45: K3-in-reward = grad KL - p3; K3-in-loss = p3, eq. 41; K1-in-loss = 0, eq. 13)
EXPECTED = {"k1_reward": {"g": 1}, "k1_loss": {}, "k1_both": {"g": 1},
            "k3_reward": {"g": 1, "p3": -1}, "k3_loss": {"p3": 1}, "k3_both": {"g": 1},
            "k2_loss": {"g": 1, "f": -1}, "k3_reward_verl": {"verl": 1}, "k1_to_go": {"g": 1}}
BIASED = ("k1_loss", "k3_reward", "k3_loss", "k2_loss", "k3_reward_verl")  # Table 1's biased rows


def gram(A, B=None):
    """K (n, n) float64, K_kl = <a_k, b_l> symmetrized (the covariance formulas need K = K')."""
    A = A.double()
    if B is None:
        return A @ A.T
    P = A @ B.double().T
    return (P + P.T) / 2


def key(a, b):
    """The Gram key of a pair of rows, in a fixed order."""
    return (a, b) if a <= b else (b, a)


def moments(grams, project=True):
    """{keys, n, est (2K,): U then D of each key, cov (2K, 2K), zeta1 (2K, 2K), zeta2 (K, K)} from
    `grams` {key(a, b): K (n, n)}; project=False leaves zeta_1, zeta_2 unprojected (cov is then the
    exactly unbiased U U' - A4 and its analogues: tests/test_kl_gradients.py)."""
    keys = list(grams)
    n, K = next(iter(grams.values())).shape[0], len(keys)
    if n < 4:
        raise ValueError(f"intervals need at least 4 units, got {n}")
    Kz = torch.stack([grams[k] for k in keys])  # (K, n, n)
    d = Kz.diagonal(dim1=1, dim2=2).clone()  # (K, n)
    Kz.diagonal(dim1=1, dim2=2).zero_()  # the pairs k != l only
    S, r = Kz.sum((1, 2)), Kz.sum(2)  # sums, (K, n) row sums
    n2, n3 = n * (n - 1), n * (n - 1) * (n - 2)
    flat = Kz.reshape(K, -1)
    frob = flat @ flat.T  # <K_i, K_j>_F, one product
    del Kz, flat
    # products of the kernels over distinct indices: both shared, one shared, none
    A2, A3 = frob / n2, (r @ r.T - frob) / n3
    A4 = (S[:, None] * S[None, :] - 4 * r @ r.T + 2 * frob) / (n3 * (n - 3))
    zeta1 = torch.zeros(2 * K, 2 * K, dtype=S.dtype)
    zeta1[:K, :K] = 4 * (A3 - A4)  # Cov of the influences 2 h1 of the U's
    # a mean D against a U: E[d_k h(v_k, v_l)] - E[d] theta over distinct k, l (, l')
    cross = 2 * (d @ r.T / n2 - d @ (S[:, None] - 2 * r).T / n3)
    zeta1[K:, :K], zeta1[:K, K:] = cross, cross.T
    zeta1[K:, K:] = d @ d.T / n - (d.sum(1)[:, None] * d.sum(1)[None, :] - d @ d.T) / n2
    zeta1, zeta2 = (psd(zeta1), psd(A2 - A4)) if project else (zeta1, A2 - A4)
    cov = zeta1 / n
    cov[:K, :K] = zeta1[:K, :K] * (n - 2) / n2 + 2 * zeta2 / n2  # Var U (module docstring)
    return {"keys": keys, "n": n, "est": torch.cat([S / n2, d.mean(1)]), "cov": cov,
            "zeta1": zeta1, "zeta2": zeta2}


def psd(C):
    """The nearest positive semi-definite matrix to the symmetric C (negative eigenvalues to 0)."""
    values, vectors = torch.linalg.eigh((C + C.T) / 2)
    return (vectors * values.clamp(min=0)) @ vectors.T


def part(name):
    """The coordinate set a row is restricted to: "L" for "g|L" (paired views), "" for "g"."""
    return name.rpartition("|")[2] if "|" in name else ""


def dot(m, alpha, beta):
    """Coefficients over the statistics of U(sum_i alpha_i v_i, sum_j beta_j v_j), the unbiased
    E[.] . E[.] of two combinations of rows ({row: coefficient}); rows restricted to disjoint
    coordinate sets (`part`) have inner product 0."""
    index = {k: i for i, k in enumerate(m["keys"])}
    c = torch.zeros(2 * len(index), dtype=torch.float64)
    for a, x in alpha.items():
        for b, y in beta.items():
            if part(a) == part(b):
                c[index[key(a, b)]] += x * y
    return c


def trace(m, alpha):
    """Coefficients of tr Cov(sum_i alpha_i v_i) = D - U of the combination with itself."""
    c = dot(m, alpha, alpha)
    K = len(m["keys"])
    return torch.cat([-c[:K], c[:K]])


def value(m, c):
    return float(c @ m["est"])


def linear(m, c, z=Z95):
    """[estimate, low, high] of a linear statistic c . stats, a normal interval."""
    est, se = value(m, c), math.sqrt(max(float(c @ m["cov"] @ c), 0.0))
    return [est, est - z * se, est + z * se]


def norm2(m, alpha, z=Z95):
    """[estimate, low, high] of ||E[sum_i alpha_i v_i]||^2: the score interval (docstring)."""
    c = dot(m, alpha, alpha)
    K, n = len(m["keys"]), m["n"]
    U, cu = value(m, c), c[:K]
    zeta1 = float(cu @ m["zeta1"][:K, :K] @ cu) / 4  # Var h1: the influence is 2 h1
    zeta2 = float(cu @ m["zeta2"] @ cu)
    tr = value(m, trace(m, alpha))
    n2 = n * (n - 1)
    rho = max((zeta1 + zeta2 / n) / max(U + tr / n, 1e-300), 0.0)
    a, b = z * z * 2 * zeta2 / n2, z * z * 4 * (n - 2) * rho / n2
    # (U - theta)^2 <= a + b theta for theta >= 0; a, the variance at theta = 0, below it
    centre = U + b / 2
    half = math.sqrt(max(centre * centre - U * U + a, 0.0))
    low = centre - half if centre - half >= 0 else U - math.sqrt(a)
    return [U, low, centre + half]


def ratio(m, ca, cb, z=Z95):
    """[A / B, low, high] for A = ca . stats, B = cb . stats: Fieller's interval; (-inf, inf)
    where B is not resolved."""
    A, B, C = value(m, ca), value(m, cb), m["cov"]
    va, vb, vab = float(ca @ C @ ca), float(cb @ C @ cb), float(ca @ C @ cb)
    est = A / B if B != 0 else math.nan
    # (A - r B)^2 - z^2 (va - 2 r vab + r^2 vb) <= 0: q2 r^2 - 2 q1 r + q0 <= 0
    q2, q1, q0 = B * B - z * z * vb, A * B - z * z * vab, A * A - z * z * va
    disc = q1 * q1 - q2 * q0
    if q2 <= 0 or disc < 0:
        return [est, -math.inf, math.inf]
    return [est, (q1 - math.sqrt(disc)) / q2, (q1 + math.sqrt(disc)) / q2]


def inverse(row):
    """1 / x's interval from x's: [1 / high, 1 / low], unbounded where x's low is <= 0."""
    inv = lambda x: 1 / x if x > 0 else math.inf  # noqa: E731
    est, low, high = row
    return [inv(est), inv(high) if high < math.inf else 0.0, inv(low)]


def root(row):
    """sqrt of an interval of a square, clipped at 0."""
    return [math.sqrt(max(x, 0.0)) if not math.isnan(x) else x for x in row]


def cosine(m, alpha, beta, z=Z95):
    """[cos, low, high] of the angle between E[sum alpha v] and E[sum beta v]: the delta method on
    Fisher's atanh(cos) (the plain delta method under-covers, 87-90% where the interval is
    0.2-0.4 wide; this one 93-97%). Where either squared norm's interval reaches 0 the angle is not
    resolved: [estimate (nan if a norm is estimated <= 0), -1, 1]."""
    v = m["est"].clone().requires_grad_()
    ab, aa, bb = (c @ v for c in (dot(m, alpha, beta), dot(m, alpha, alpha), dot(m, beta, beta)))
    raw = float((ab / (aa * bb).sqrt()).detach()) if aa > 0 and bb > 0 else math.nan
    if norm2(m, alpha)[1] <= 0 or norm2(m, beta)[1] <= 0 or not -1 < raw < 1:
        return [max(-1.0, min(1.0, raw)) if not math.isnan(raw) else raw, -1.0, 1.0]
    t = torch.atanh(ab / (aa * bb).sqrt())
    (grad,) = torch.autograd.grad(t, v)
    se = math.sqrt(max(float(grad @ m["cov"] @ grad), 0.0))
    t = float(t.detach())
    return [math.tanh(t), math.tanh(t - z * se), math.tanh(t + z * se)]


def smooth(m, fn, z=Z95):
    """[fn(est), low, high] of a smooth function of the statistics (fn: a torch function of the
    vector of U and D statistics): the delta method on their covariance."""
    v = m["est"].clone().requires_grad_()
    t = fn(v)
    (grad,) = torch.autograd.grad(t, v)
    se = math.sqrt(max(float(grad @ m["cov"] @ grad), 0.0))
    return [float(t.detach()), float(t.detach()) - z * se, float(t.detach()) + z * se]


def mean_interval(values, z=Z95):
    """[mean, low, high] of i.i.d. values, a normal interval."""
    values = torch.as_tensor(values, dtype=torch.float64).reshape(-1)
    se = float(values.std()) / math.sqrt(len(values)) if len(values) > 1 else math.nan
    mean = float(values.mean())
    return [mean, mean - z * se, mean + z * se]


# ---------------------------------------------------------------- Table 1's quantities

def needed_pairs(names, parents=None):
    """The Gram matrices every quantity of `summarize` needs: the exact basis g, p3, f, verl
    among themselves, f_plain, each sampled row (`names`) with itself and its expectation's
    terms, and each term row (`parents`: {row: its parent's exact terms or None}) with itself, g
    and its parent's terms."""
    basis = ("g", "p3", "f", "verl")
    pairs = {key(a, b) for i, a in enumerate(basis) for b in basis[i:]}
    pairs |= {key("f_plain", "f_plain"), key("f_plain", "f")}
    for name in names:
        pairs |= {key(name, name)} | {key(name, b) for b in EXPECTED.get(name, {})}
        base = tail_base(name)
        if base:  # a --grad-tail row, with its whole row and that row's expectation
            pairs |= {key(name, b) for b in (base, *EXPECTED[base])}
    for name, info in (parents or {}).items():
        expected = info["exact"] or name  # the term's exact row, else its sampled row
        pairs |= {key(name, name), key(expected, expected), key(expected, "g"), key(name, expected)}
        pairs |= {key(expected, b) for b in info["parent"] or {}}
    return sorted(pairs)


def tail_base(name):
    """The sampled row a --grad-tail row truncates ("k3_loss" for "k3_loss_below_10"), or None."""
    base, _, ratio = name.rpartition("_below_")
    return base if base in EXPECTED and ratio.isdigit() else None


def block_grams(rows, part, pairs):
    """{pair: Gram (n, n)} of the rows' coordinates `part` (a slice)."""
    return {(a, b): gram(rows[a][:, part], None if a == b else rows[b][:, part]) for a, b in pairs}


def view_grams(rows, sizes, weights, block_names, combos=None, parents=None):
    """Yields (view, {pair: Gram (n, n)}) from {row: (n, m)}: each block alone, then each
    combination of blocks (`combos` {view: [blocks]}; default "layer", all of them) weighted by
    their parameters per kept coordinate (kl_coords.choose_subsets). A block's Grams are freed
    once added to its combinations' sums."""
    rows = {**rows, "g": rows["p2"] + rows["f"]}  # grad KL (eq. 29)
    pairs = needed_pairs([name for name in rows if name in EXPECTED or name == "task_pg"
                          or tail_base(name)], parents)
    combos = combos or {"layer": list(block_names)}
    sums, start = {}, 0
    for name, size, w in zip(block_names, sizes, weights):
        grams = block_grams(rows, slice(start, start + size), pairs)
        start += size
        yield name, grams
        for view, members in combos.items():
            if name in members:
                sums[view] = {pair: sums[view][pair] + w * grams[pair] if view in sums
                              else w * grams[pair] for pair in pairs}
        del grams
    yield from sums.items()


def combine(alpha, beta, scale=1.0):
    return {k: alpha.get(k, 0.0) + scale * beta.get(k, 0.0) for k in {*alpha, *beta}}


def summarize(m, G, parents=None):
    """One view's quantities, from moments(its Grams). G: sequences per unit; `parents` {term row:
    its parent's exact terms, or None} (kl_gradients.py --presets)."""
    g = {"g": 1.0}
    gg = dot(m, g, g)
    var_ref = value(m, trace(m, {"k1_reward": 1.0})) * G  # K1-in-reward's, one sequence
    in_ref = lambda row: [x / var_ref if var_ref > 0 else math.nan for x in row]  # noqa: E731
    shift = {"verl": 1.0, "g": -1.0, "p3": 1.0}  # the clamp's: E[verl] - E[K3-in-reward]
    out = {"grad_kl": {"norm2": norm2(m, g), "snr": ratio(m, gg, G * trace(m, {
        "k1_reward": 1.0})), "snr_exact": ratio(m, gg, G * trace(m, g))},
        # f's share of grad KL: f . grad KL / ||grad KL||^2 (p2's is 1 minus it), and ||f|| / ||.||
        "f_share": ratio(m, dot(m, {"f": 1.0}, g), gg),
        "f_norm": root(ratio(m, dot(m, {"f": 1.0}, {"f": 1.0}), gg)),
        # the leave-one-out baseline: f_plain's variance over f's; E[f_plain - f] = 0
        "baseline_gain": ratio(m, trace(m, {"f_plain": 1.0}), trace(m, {"f": 1.0})),
        "baseline_check": in_ref(norm2(m, {"f_plain": 1.0, "f": -1.0})),
        "clamp_shift": root(ratio(m, dot(m, shift, shift), gg)), "rows": {}}
    out["grad_kl"]["resolved"] = out["grad_kl"]["norm2"][1] > 0
    for name in [*EXPECTED, "task_pg"]:
        s = {name: 1.0}
        row = {"var": linear(m, G * trace(m, s)),
               "var_ratio": ratio(m, trace(m, s), trace(m, {"task_pg": 1.0}))}
        if name in EXPECTED:
            expected = EXPECTED[name]
            # ||E[sampled] - E[exact]||^2 / var_ref: 0 within the interval (Table 1 holds)
            row["check"] = in_ref(norm2(m, combine(s, expected, -1.0)))
            if expected:  # the exact row's variance over the sampled row's
                row["exact_var_ratio"] = ratio(m, trace(m, expected), trace(m, s))
        if name in BIASED:
            bias = combine(EXPECTED[name], g, -1.0)
            bb = dot(m, bias, bias)
            row.update(cos=cosine(m, EXPECTED[name], g) if EXPECTED[name] else NAN3,
                       rel_bias=root(ratio(m, bb, gg)), bias_snr=in_ref(norm2(m, bias)),
                       # n* = tr Var / ||bias||^2, from the interval of its inverse
                       n_star=inverse(ratio(m, bb, G * trace(m, s))))
        out["rows"][name] = row
    # --presets: a term's expectation (its exact row where it has one, else its sampled row)
    # against grad KL, and against the exact row of its toy verdict
    for name, info in (parents or {}).items():
        s = {name: 1.0}
        expected = {info["exact"]: 1.0} if info["exact"] else s
        bias = combine(expected, g, -1.0)
        bb = dot(m, bias, bias)
        row = {"var": linear(m, G * trace(m, s)),
               "var_ratio": ratio(m, trace(m, s), trace(m, {"task_pg": 1.0})),
               "cos": cosine(m, expected, g), "rel_bias": root(ratio(m, bb, gg)),
               "n_star": inverse(ratio(m, bb, G * trace(m, s))), "exact": bool(info["exact"])}
        if info["exact"]:  # the sampled row against its exact expectation: 0 inside
            row["check"] = in_ref(norm2(m, combine(s, expected, -1.0)))
        if info["parent"] is not None:  # ||E[row] - E[parent]||^2 / var_ref: 0 inside, the toy holds
            apart = combine(expected, info["parent"], -1.0)
            row["vs_parent"] = in_ref(norm2(m, apart))
            # and its size: ||E[row] - E[parent]|| / ||grad KL||
            row["vs_parent_rel"] = root(ratio(m, dot(m, apart, apart), gg))
        out.setdefault("terms", {})[name] = row
    # --grad-tail: each sampled K3 row over the tokens of ratio <= R against its exact expectation
    # there (0 inside: no bug), and the part of the whole row's check from the tokens above R
    for name in sorted({a for k in m["keys"] for a in k if tail_base(a)}):
        base = tail_base(name)
        whole = combine({base: 1.0}, EXPECTED[base], -1.0)
        out.setdefault("grad_tail", {})[name] = {
            "check": in_ref(norm2(m, {name: 1.0})),
            "check_bonferroni": in_ref(norm2(m, {name: 1.0}, Z_TAIL)),
            "check_above": in_ref(norm2(m, combine(whole, {name: 1.0}, -1.0)))}
    return out


def analyze(rows, sizes, weights, block_names, G, combos=None, parents=None):
    """{view: summarize(...)} for each block and each combination of blocks (view_grams), from
    {row: (n, m)}; with combinations "layer" and "model" the model's view also holds "vs_layer",
    the two compared on the same units (`paired`)."""
    out, grams = {}, {}
    for view, view_gram in view_grams(rows, sizes, weights, block_names, combos, parents):
        out[view] = summarize(moments(view_gram), G, parents)
        if view in ("layer", "model") and combos and {"layer", "model"} <= set(combos):
            grams[view] = view_gram
    if len(grams) == 2:
        out["model"]["vs_layer"] = paired(grams["layer"], grams["model"])
    return out


def paired_moments(layer, model, names):
    """moments() of the rows `names` restricted to the layer's coordinates ("a|L") and to the rest
    of the model's ("a|R": the model's Grams minus the layer's), jointly: two disjoint coordinate
    sets, so a model inner product is the sum of its two parts' (dot) and any function of both
    views has the delta method's interval on one covariance (the same units: paired)."""
    grams = {}
    for i, a in enumerate(names):
        for b in names[i:]:
            pair = key(a, b)
            grams[key(f"{a}|L", f"{b}|L")] = layer[pair]
            grams[key(f"{a}|R", f"{b}|R")] = model[pair] - layer[pair]
    return moments(grams)


def compare(m, alpha, beta):
    """{layer, model: cos(E[alpha], E[beta]) in each view, diff: model minus layer} from
    paired_moments; the difference's interval by the delta method, [-2, 2] where a squared norm of
    either view is not resolved (its interval reaches 0)."""
    views = {"layer": lambda c: {f"{k}|L": x for k, x in c.items()},
             "model": lambda c: {**{f"{k}|L": x for k, x in c.items()},
                                 **{f"{k}|R": x for k, x in c.items()}}}
    out = {view: cosine(m, to(alpha), to(beta)) for view, to in views.items()}

    def cos(v, to):  # cos(E[alpha], E[beta]) in one view, from the statistics v
        ab, aa, bb = (dot(m, to(x), to(y)) @ v for x, y in ((alpha, beta), (alpha, alpha),
                                                            (beta, beta)))
        return ab / (aa * bb).sqrt()

    resolved = all(norm2(m, to(c))[1] > 0 for to in views.values() for c in (alpha, beta))
    diff = smooth(m, lambda v: cos(v, views["model"]) - cos(v, views["layer"]))
    out["diff"] = diff if resolved else [diff[0], -2.0, 2.0]
    return out


def paired(layer, model):
    """Per biased row with an expectation (BIASED but K1-in-loss): its cosine with grad KL in the
    last layer and in the whole model, and their difference (compare), on the same units."""
    m = paired_moments(layer, model, ["g", "p3", "f", "verl"])
    return {name: compare(m, EXPECTED[name], {"g": 1.0}) for name in BIASED if EXPECTED[name]}


def per_sequence(seqs, prefixes, G):
    """Means over groups (the i.i.d. unit) of the per-sequence sums, with intervals; quantiles of
    the per-prefix chi^2 and clamp deficits (issue 27, item 5)."""
    groups = {key: v.reshape(-1, G).mean(1) for key, v in seqs.items()}  # the i.i.d. unit
    out = {key: mean_interval(v[~np.isnan(v)]) for key, v in groups.items() if key != "chi2_max"}
    # K3's value against its exact expectation: whole (the tail included), and split at ratio R
    # into the tokens at most R and those above, on the same groups (the later chunks' records)
    whole = groups["k3"] - groups["kl"]
    out["check_k3"] = mean_interval(whole)
    ratios = [k.removeprefix("tail_prob_") for k in seqs if k.startswith("tail_prob_")]
    if ratios:  # every R is recorded by the same chunks: one set of groups
        kept = ~np.isnan(groups[f"tail_prob_{ratios[0]}"])
        out["check_k3_tail_groups"] = mean_interval(whole[kept])
        out["tail_groups"] = int(kept.sum())
    for R in ratios:
        below = (groups[f"k3_below_{R}"] - groups[f"k3_below_{R}_exact"])[kept]
        out[f"check_k3_below_{R}"] = mean_interval(below)
        out[f"check_k3_above_{R}"] = mean_interval(whole[kept] - below)
        out[f"tail_part_{R}"] = mean_interval((groups["kl"] - groups[f"k3_below_{R}_exact"])[kept])
    chi2, deficit = prefixes["chi2"], prefixes["clamp_deficit"]
    quantiles = (0.5, 0.9, 0.99, 0.999, 1.0)
    out["prefix_chi2"] = {f"q{q}": float(np.quantile(chi2, q)) for q in quantiles}
    out["prefix_chi2"].update({f"over_{t}": float((chi2 > t).mean()) for t in (1, 10, 1000)})
    out["prefix_clamp"] = {"max": float(deficit.max()),
                           "share_clamped": float((deficit > 0).mean())}
    out["prefixes"] = len(chi2)
    return out


# ---------------------------------------------------------------- tables and the figure

def fmt(row, digits=3):
    """'estimate [low, high]'."""
    return f"{row[0]:.{digits}g} [{row[1]:.{digits}g}, {row[2]:.{digits}g}]"


def report(label, groups, dist, tail_ratios):
    """Print one distance's headline: the KL, K3's value checks, and per view ("layer", and
    "model" where measured) each biased row's cosine, relative bias and n*; the model against the
    layer (paired) and the gradient rows' tail checks where measured."""
    layer = dist["views"]["layer"]
    print(f"{label}: {groups} groups, KL {dist['kl'][0]:.3f} (exact), {dist['k1'][0]:.3f} "
          f"(K1), {dist['k3'][0]:.3f} (K3) nats; ||grad KL||^2 interval "
          f"[{layer['grad_kl']['norm2'][1]:.3g}, {layer['grad_kl']['norm2'][2]:.3g}]; "
          f"f's share {fmt(layer['f_share'])}")
    tails = [f"ratio <= {R}: {fmt(dist[f'check_k3_below_{R}'])}" for R in tail_ratios
             if f"check_k3_below_{R}" in dist]
    print(f"{label}: sampled K3 - exact KL {fmt(dist['check_k3'])} nats a sequence" + (
        f"; on the {dist['tail_groups']} groups with K3's tail recorded "
        f"{fmt(dist['check_k3_tail_groups'])}, over the tokens of {', '.join(tails)}"
        if tails else ""))
    for view in [v for v in ("layer", "model") if v in dist["views"]]:
        table = dist["views"][view]
        for name in BIASED:
            row = table["rows"][name]
            print(f"{label:>9} {view:<5} {name:<15} cos {fmt(row['cos'])}  rel. bias "
                  f"{fmt(row['rel_bias'])}  n* {fmt(row['n_star'])}  check {fmt(row['check'])}")
        for name, row in table.get("terms", {}).items():
            parent = f"  vs its toy verdict {fmt(row['vs_parent'])}" if "vs_parent" in row else ""
            check = f"  check {fmt(row['check'])}" if "check" in row else "  (sampled)"
            print(f"{label:>9} {view:<5} {name:<15} cos {fmt(row['cos'])}  rel. bias "
                  f"{fmt(row['rel_bias'])}  n* {fmt(row['n_star'])}{check}{parent}")
        for name, row in table.get("vs_layer", {}).items():
            print(f"{label:>9} model - layer, {name:<15} cos {fmt(row['diff'])}")
        for name, row in table.get("grad_tail", {}).items():
            print(f"{label:>9} {view:<5} {name:<20} check {fmt(row['check'])}  above R "
                  f"{fmt(row['check_above'])}")


def write_csv(results, path):
    """One line per distance, view and sampled row: its quantities with their intervals."""
    keys = ("cos", "rel_bias", "n_star", "var_ratio", "check", "exact_var_ratio")
    header = ["distance", "kl_exact", "groups", "view", "config"] + [
        f"{k}{s}" for k in keys for s in ("", "_low", "_high")]
    lines = [",".join(header)]
    for dist in results["distances"]:
        for view, table in dist["views"].items():
            for name, row in {**table["rows"], **table.get("terms", {})}.items():
                values = [f"{x:.6g}" for k in keys for x in row.get(k, NAN3)]
                lines.append(",".join([dist["label"], f"{dist['kl'][0]:.4f}", str(dist["groups"]),
                                       view, name] + values))
    Path(path).write_text("\n".join(lines) + "\n")


def plot(results, path):
    """Table 1 as a measured column, by distance: each biased row's cosine with grad KL, its
    relative bias and its n*, with 95% intervals (the whole last layer, reweighted), and every
    sampled row's variance over the task policy gradient's."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dists = results["distances"]
    x = np.array([d["kl"][0] for d in dists])
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.2))
    names = [name for name in EXPECTED if name != "task_pg"]
    for i, name in enumerate(names):
        style = dict(color=f"C{i}", marker="o", ms=3, capsize=2, label=name,
                     ls="-" if name in BIASED else "--")
        shift = (i - len(names) / 2) * 0.01 * (x.max() - x.min() + 0.1)  # side by side
        keys = ("cos", "rel_bias", "n_star", "var_ratio") if name in BIASED else (
            None, None, None, "var_ratio")
        for ax, key in zip(axes, keys):
            if key is None:
                continue
            v = np.array([d["views"]["layer"]["rows"][name][key] for d in dists], dtype=float)
            v = np.where(np.isfinite(v), v, np.nan)
            ax.errorbar(x + shift, v[:, 0], yerr=[v[:, 0] - v[:, 1], v[:, 2] - v[:, 0]], **style)
    xlabel = "KL(pi || pi_ref), nats per sequence (exact)"
    axes[0].set(xlabel=xlabel, title="cos(E[g], grad KL)", ylim=(-1.05, 1.05))
    axes[1].set(xlabel=xlabel, title="||E[g] - grad KL|| / ||grad KL||")
    axes[2].set(xlabel=xlabel, yscale="log", title="n* = tr Var / ||bias||^2 (sequences)")
    axes[3].set(xlabel=xlabel, yscale="log", title="variance / task policy gradient's")
    axes[3].legend(fontsize=7, ncol=2)
    for ax in axes:  # one tick a distance, its label and its KL (after the scales are set)
        ax.set_xticks(x, [f"{d['label']}\n{k:.2f}" for d, k in zip(dists, x)])
    fig.suptitle(f"Table 1 on {results['model']}, last layer (attention and MLP reweighted), "
                 f"{', '.join(str(d['groups']) for d in dists)} groups of "
                 f"{results['group_size']}, beta = 1, 95% intervals (unbounded ones not drawn)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=70)
