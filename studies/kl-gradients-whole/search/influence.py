"""Post-hoc influence diagnostic of kl_gradients.py's --grad-tail checks (read-only on the run).

A --grad-tail row (e.g. k3_loss_below_10) is already the per-group difference
d_k = sampled_k - exact_k (kl_gradients.row_outputs: one VJP of sampled minus exact), and its
`check` is kl_stats.norm2(m, {row: 1}) / var_ref, var_ref = G * tr Cov(k1_reward) (summarize).

Step 1 (prep, cached): load the chunks with the run's own loader (lab.kl_gradients.load_distance),
build every view's Grams with kl_stats.view_grams (the view weights exactly as the run), keep the
"layer" and "model" views (all 47 Gram keys: moments() projects zeta_1, zeta_2 jointly onto the PSD
cone, so the check's interval depends on every key), and for the bootstrap the Grams of each tail
row centred over groups (its pairs with every other row, recomputed from the data, same weights).
Step 2 (analyze): reproduce results.json, then influence, drop-top-j, split halves, bootstrap.

    OMP_NUM_THREADS=1 nice -n 10 python influence.py --seed-dir DIR --results R.json \
        --view layer --row k3_loss_below_10 [--bootstrap 400]
"""
import argparse
import json
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

SRC = "/work/runs/kl-gradients-whole/src-771afac-order"
sys.path.insert(0, SRC)
from lab import kl_stats as S  # noqa: E402

HERE = Path(__file__).resolve().parent
torch.set_num_threads(1)


def prep(chunks_root, cache):
    """Load the step_20 chunks (the project's loader), compute the layer and model views' Grams
    (kl_stats.view_grams) and the centred tail rows' Grams (layer and model); save to `cache`."""
    import lab.kl_gradients as KG
    t0 = time.time()
    args = SimpleNamespace(chunks=str(chunks_root), groups=768, chunk_groups=32)
    rows, seqs, prefixes, record, seconds, chunks = KG.load_distance("step 20", args)
    G = record["key"]["flags"]["group_size"] * record["key"]["flags"]["batch_groups"]
    sizes, weights, blocks, combos = (record["sizes"], record["weights"], record["blocks"],
                                      record.get("views"))
    print(f"loaded {chunks} chunks, n = {len(rows['k1_reward'])}, {time.time() - t0:.0f} s",
          flush=True)
    views = {}
    for view, grams in S.view_grams(rows, sizes, weights, blocks, combos):
        if view in ("layer", "model"):
            views[view] = grams
        print(f"  view {view}: {time.time() - t0:.0f} s", flush=True)
    # centred tail rows: d_k - mean_k d, its pairs recomputed from the data with the same weights
    full = {**rows, "g": rows["p2"] + rows["f"]}
    pairs = list(views["layer"])
    tails = [name for name in rows if S.tail_base(name)]
    centred = {}
    for view in ("layer", "model"):
        members = combos[view]
        for name in tails:
            dc = full[name] - full[name].double().mean(0).float()
            mine = [p for p in pairs if name in p]
            out, start = {}, 0
            for block, size, w in zip(blocks, sizes, weights):
                part = slice(start, start + size)
                start += size
                if block not in members:
                    continue
                for a, b in mine:
                    other = b if a == name else a
                    K = S.gram(dc[:, part]) if a == b else S.gram(dc[:, part], full[other][:, part])
                    out[(a, b)] = out[(a, b)] + w * K if (a, b) in out else w * K
            centred[(view, name)] = out
        print(f"  centred {view}: {time.time() - t0:.0f} s", flush=True)
    torch.save({"views": views, "centred": centred, "seqs": seqs, "G": G,
                "chunks": chunks, "groups_per_chunk": record["groups"]}, cache)
    print(f"prep {time.time() - t0:.0f} s -> {cache}", flush=True)


def prompts_of(chunks_root, n_chunks, per_chunk, prompts_per_batch=8):
    """Each group's prompt index in data.load_task("arith", "test"), redrawn as measure_chunk
    draws them (random.Random(chunk seed).choice per group, batch_groups = 1: no reordering)."""
    import random
    import data
    examples = data.load_task("arith", split="test")
    out = []
    for chunk in range(n_chunks):
        record = json.loads((Path(chunks_root) / "step_20" / f"chunk_{chunk:05d}.json").read_text())
        assert record["key"]["flags"]["batch_groups"] == 1
        rng = random.Random(record["seed"])
        ids = {id(e): i for i, e in enumerate(examples)}
        out += [ids[id(rng.choice(examples))] for _ in range(per_chunk)]
    return np.array(out), examples


def check(grams, row, G, idx=None):
    """(check 95%, check Bonferroni, var_ref) as summarize() computes them, on the units idx."""
    if idx is not None:
        idx = torch.as_tensor(idx)
        grams = {k: g[idx][:, idx] for k, g in grams.items()}
    m = S.moments(grams)
    var_ref = S.value(m, S.trace(m, {"k1_reward": 1.0})) * G
    f = lambda r: [x / var_ref for x in r]  # noqa: E731
    return f(S.norm2(m, {row: 1.0})), f(S.norm2(m, {row: 1.0}, S.Z_TAIL)), var_ref


def r_from_k3(v):
    """The ratio r > 1 with r - 1 - log r = v (one token carrying all of v)."""
    lo, hi = 1.0, max(2.0, v + 10)
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mid - 1 - math.log(mid) < v else (lo, mid)
    return lo


def analyze(cache, results, view, row, bootstrap, seed, chunks_root):
    t0 = time.time()
    c = torch.load(cache, weights_only=False)
    grams, G, seqs = c["views"][view], c["G"], c["seqs"]
    n = next(iter(grams.values())).shape[0]
    fmt = S.fmt
    print(f"# {cache.name}: view {view}, row {row}, n = {n} groups, G = {G}")
    # 1. reproduction
    ref = json.loads(Path(results).read_text())["distances"][0]
    assert ref["label"] == "step 20" and ref["groups"] == n
    ref = ref["views"][view]["grad_tail"][row]
    full = S.summarize(S.moments(grams), G)["grad_tail"][row]
    c95, cbf, var_ref = check(grams, row, G)
    print("\n## 1. reproduction (results.json vs kl_stats.summarize on our Grams vs check())")
    print(f"  results.json  check {fmt(ref['check'])}  Bonferroni {fmt(ref['check_bonferroni'])}")
    print(f"  summarize     check {fmt(full['check'])}  Bonferroni {fmt(full['check_bonferroni'])}")
    print(f"  check()       check {fmt(c95)}  Bonferroni {fmt(cbf)}   var_ref {var_ref:.4g}")
    rel = max(abs(a - b) / max(abs(b), 1e-300) for a, b in
              zip(c95 + cbf, ref["check"] + ref["check_bonferroni"]))
    print(f"  max relative difference to results.json: {rel:.2e}")
    # only the two keys the check reads (no joint PSD projection): how much the other keys matter
    two = {k: grams[k] for k in (S.key(row, row), S.key("k1_reward", "k1_reward"))}
    t95, tbf, _ = check(two, row, G)
    print(f"  (moments over only the 2 keys it reads: {fmt(t95)}, Bonferroni {fmt(tbf)})")

    # 2. influence
    K = grams[S.key(row, row)]
    diag = K.diagonal().clone()
    ck = K.sum(1) - diag  # c_k = sum_{l != k} K_kl
    total = float(ck.sum())
    U = total / (n * (n - 1))
    print(f"\n## 2. influence: U = {U:.4g} (check x var_ref = {c95[0] * var_ref:.4g}); "
          f"sum c_k = {total:.4g}; median ||d_k||^2 = {float(diag.median()):.4g}, "
          f"mean {float(diag.mean()):.4g}")
    print(f"  share of sum c_k held by the positive c_k: "
          f"{float(ck.clamp(min=0).sum()) / total:.2f}, by the negative ones: "
          f"{float(ck.clamp(max=0).sum()) / total:.2f}")
    order = torch.argsort(ck, descending=True)
    gpc = c["groups_per_chunk"]
    P, examples = prompts_of(chunks_root, c["chunks"], gpc)
    draws = np.bincount(P, minlength=len(examples))
    seq = lambda key: seqs[key].reshape(-1, G)  # noqa: E731  (n, G) per group
    above = {R: seq("k3") - seq(f"k3_below_{R}") for R in (10, 100, 1000)}
    print("  sampled token ratios r = pi_ref/pi are not stored per token; per sequence the chunks "
          "hold k3 and k3_below_R (R = 10, 100, 1000),\n  so 'r_max' is the bracket of the group's "
          "largest sampled r (K3 above R > 0.5 nats means a token over R), 'r1' the r of one token "
          "carrying\n  all K3 above 10 (an upper bound on r_max when several tokens exceed 10); "
          "chi2max: max over the group's prefixes of chi^2(pi_ref||pi) (exact)")
    print(f"  prompts: {len(examples)} held-out arith problems, {len(set(P.tolist()))} drawn; "
          f"'prompt' = index (times drawn among the n groups)")
    print(f"  {'rank':>4} {'group':>5} {'chunk':>5} {'prompt':>8} {'c_k share':>9} {'cum':>6} "
          f"{'||d||^2/med':>11} {'r_max':>12} {'r1':>9} {'K3>10':>7} {'chi2max':>9}")
    cum = 0.0
    for rank, k in enumerate(order[:10].tolist(), 1):
        share = float(ck[k]) / total
        cum += share
        hits = [R for R in (10, 100, 1000) if float(above[R][k].max()) > 0.5]
        bracket = (f"> {hits[-1]}" if hits else "<= 10")
        a10 = float(above[10][k].sum())
        r1 = f"{r_from_k3(a10):.3g}" if a10 > 0.5 else "-"
        print(f"  {rank:>4} {k:>5} {k // gpc:>5} {f'{P[k]}({draws[P[k]]})':>8} {share:>9.3f} {cum:>6.3f} "
              f"{float(diag[k] / diag.median()):>11.3g} {bracket:>12} {r1:>9} {a10:>7.3g} "
              f"{float(seq('chi2_max')[k].max()):>9.3g}")
    tail_groups = int((above[10].max(1) > 0.5).sum())
    print(f"  groups with a sampled token r > 10: {tail_groups} of {n}; r > 100: "
          f"{int((above[100].max(1) > 0.5).sum())}; r > 1000: "
          f"{int((above[1000].max(1) > 0.5).sum())}")
    # coincident groups: d_k = d_l exactly (||d_k - d_l||^2 = K_kk + K_ll - 2 K_kl ~ 0), the same
    # prompt drawn again with the same G responses (a point mass of the i.i.d. distribution)
    dist2 = diag[:, None] + diag[None, :] - 2 * K
    same = (dist2.abs() <= 1e-5 * (diag[:, None] + diag[None, :]).clamp(min=1e-30))  # float rounding
    same.fill_diagonal_(False)
    seen, clusters = set(), []
    for k in range(n):
        if k in seen or not same[k].any():
            continue
        members = [k] + same[k].nonzero().flatten().tolist()
        seen.update(members)
        clusters.append(members)
    tied = sum(float(K[m][:, m].sum() - K[m][:, m].diagonal().sum()) for m in clusters)
    print(f"  coincident groups (d_k equal up to float rounding, ||d_k - d_l||^2 <= 1e-5 (||d_k||^2 + ||d_l||^2); so the same prompt and the same {G} responses): "
          f"{len(clusters)} clusters, sizes {sorted((len(m) for m in clusters), reverse=True)[:12]}")
    for m in sorted(clusters, key=lambda m: -float(K[m[0], m[0]]) * len(m) * (len(m) - 1))[:4]:
        print(f"    groups {m}: ||d||^2 = {float(K[m[0], m[0]]):.4g}, its pairs' share of "
              f"sum c_k {float(K[m][:, m].sum() - K[m][:, m].diagonal().sum()) / total:.3f}, "
              f"prompts {sorted(set(P[m].tolist()))} (drawn {draws[P[m[0]]]}x), records equal up to order: "
              f"{all(np.allclose(np.sort(seq(x)[m[0]]), np.sort(seq(x)[j]), rtol=1e-4, atol=1e-5) for x in ('length', 'k1', 'k3') for j in m)}")
    print(f"  all within-cluster pairs (k != l, d_k ~ d_l) hold {tied / total:.3f} of sum c_k; "
          f"U without them (the other pairs only): "
          f"{(total - tied) / (n * (n - 1)):.4g} vs U = {U:.4g}")
    Pt = torch.as_tensor(P)
    samep = (Pt[:, None] == Pt[None, :]) & ~torch.eye(n, dtype=torch.bool)
    within = float(K[samep].sum())
    print(f"  pairs of groups with the same prompt ({int(samep.sum()) // 2} pairs): share of "
          f"sum c_k {within / total:.3f}; U over different-prompt pairs only "
          f"{(total - within) / float((~samep).sum() - n):.4g} (/var_ref "
          f"{(total - within) / float((~samep).sum() - n) / var_ref:.3g}), over same-prompt pairs "
          f"{within / float(samep.sum()):.4g} (both 0 in expectation under the null: E[d | prompt] = 0)")
    rk = torch.argsort(torch.argsort(diag, descending=True))
    print(f"  ranks of the top-5 c_k groups by ||d_k||^2: {[int(rk[k]) + 1 for k in order[:5]]}")

    print("\n  the check with the top-j groups by c_k removed (all Grams, var_ref included):")
    print(f"  {'j':>3} {'removed':>22} {'check [95%]':>34} {'Bonferroni':>24} {'var_ref':>9}")
    for j in (0, 1, 2, 3, 5):
        drop = set(order[:j].tolist())
        keep = [k for k in range(n) if k not in drop]
        a, b, v = check(grams, row, G, keep)
        print(f"  {j:>3} {str(sorted(drop)):>22} {fmt(a):>34} [{b[1]:.3g}, {b[2]:.3g}]"
              f"{'  excl. 0' if b[1] > 0 else '':>9} {v:.4g}")

    print("\n  split halves (chunks 0-11 vs 12-23):")
    half = n // 2
    for name, idx in (("chunks 0-11", range(half)), ("chunks 12-23", range(half, n))):
        a, b, v = check(grams, row, G, list(idx))
        print(f"  {name:>13}: check {fmt(a)}  Bonferroni [{b[1]:.3g}, {b[2]:.3g}]  "
              f"var_ref {v:.4g}")
    print(f"  (analysis {time.time() - t0:.0f} s)")

    if bootstrap:
        # 4. calibration: the tail row centred over groups (its pairs recomputed from the centred
        # data), n groups resampled with replacement, every Gram (var_ref's too) on the same indices
        t1 = time.time()
        cg = {**grams, **c["centred"][(view, row)]}
        a, b, _ = check(cg, row, G)
        print(f"\n## 4. calibration: {bootstrap} resamples of the centred groups "
              f"(centred data's own check {a[0]:.3g}, Bonferroni [{b[1]:.3g}, {b[2]:.3g}])")
        rng = np.random.default_rng(seed)
        ex95 = exbf = exneg = 0
        lows = []
        for i in range(bootstrap):
            idx = rng.integers(0, n, n)
            a, b, _ = check(cg, row, G, idx)
            ex95 += a[1] > 0
            exbf += b[1] > 0
            exneg += b[1] > 0 and b[0] < 0  # a significantly negative U: the score set is then > 0
            lows.append(b[1])
            if (i + 1) in (400,):
                print(f"  after {i + 1}: Bonferroni excludes 0 in {exbf} ({exneg} of them with "
                      f"a negative estimate), 95% in {ex95}", flush=True)
            if (i + 1) % 100 == 0:
                print(f"  {i + 1}: Bonferroni excludes 0 in {exbf}, 95% in {ex95} "
                      f"({time.time() - t1:.0f} s)", flush=True)
        print(f"  of the {exbf} Bonferroni exclusions, {exneg} have a negative estimate (|U| "
              f"beyond z sqrt(a): norm2's score set then lies above 0)")
        q = np.quantile(np.array(lows), [0.5, 0.9, 0.99])
        print(f"  Bonferroni low end over resamples: median {q[0]:.3g}, q90 {q[1]:.3g}, q99 {q[2]:.3g}")
        for label, x, nominal in (("Bonferroni (95%/8)", exbf, 0.05 / 8),
                                  ("95%", ex95, 0.05)):
            lo, hi = clopper_pearson(x, bootstrap)
            print(f"  {label}: {x}/{bootstrap} = {x / bootstrap:.4f} exclude 0, "
                  f"exact binomial 95% [{lo:.4f}, {hi:.4f}] (nominal <= {nominal:.4g}: a one-sided "
                  f"false positive needs the low end > 0, at most half the two-sided level)")
        print(f"  ({time.time() - t1:.0f} s, seed {seed})")


def clopper_pearson(x, n, alpha=0.05):
    from scipy.stats import beta
    lo = 0.0 if x == 0 else beta.ppf(alpha / 2, x, n - x + 1)
    hi = 1.0 if x == n else beta.ppf(1 - alpha / 2, x + 1, n - x)
    return float(lo), float(hi)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--chunks", required=True, help="the run's --chunks (holds step_20)")
    p.add_argument("--cache", required=True)
    p.add_argument("--results")
    p.add_argument("--view", default="layer")
    p.add_argument("--row", default="k3_loss_below_10")
    p.add_argument("--bootstrap", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prep-only", action="store_true")
    a = p.parse_args()
    cache = HERE / a.cache
    if not cache.exists():
        prep(a.chunks, cache)
    if not a.prep_only:
        analyze(cache, a.results, a.view, a.row, a.bootstrap, a.seed, a.chunks)
