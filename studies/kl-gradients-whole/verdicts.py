"""The whole-model run's verdicts (issue 36), by the rules committed before it ran
(docs/kl_gradients.md, "Whole model (issue 36)"), from results.json: the cosines, verdicts, blocks'
shares and tail checks that docs/kl_gradients.md quotes about this run, and its table's rows.

    python studies/kl-gradients-whole/verdicts.py [results.json]

Written before the run's results were read, and checked then on a synthetic file of the same shape.
Changed after: the table of blocks (shares and cosines) was added, and the blocks' shares now include
each block's weight (a block's view is unweighted); the secondary verdict, a comparison of two
ratios, is the same either way.
"""
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# The predicted ranges of the cosine with grad KL: (layer's range, d = model - layer's range), per step
RANGES = {
    "step 20": {"k3_loss": ((0.05, 0.6), (-0.25, 0.1)), "k3_reward": ((0.0, 0.4), (-0.25, 0.1)),
                "k2_loss": ((0.85, 1.0), (-0.1, 0.05)),
                "k3_reward_verl": ((0.3, 0.85), (-0.3, 0.1))},
    "step 5": {"k3_loss": ((0.45, 0.95), (-0.4, -0.05)), "k3_reward": ((-0.3, 0.4), (-0.3, 0.1)),
               "k2_loss": ((0.85, 1.0), (-0.1, 0.05)),
               "k3_reward_verl": ((-0.3, 0.85), (-0.3, 0.1))},
}
NAMES = {"k1_reward": "K1-in-reward", "k1_loss": "K1-in-loss", "k3_reward": "K3-in-reward",
         "k3_loss": "K3-in-loss", "k1_both": "K1-both", "k3_both": "K3-both",
         "k1_to_go": "K1 to go (OpenRLHF)", "k2_loss": "K2-in-loss",
         "k3_reward_verl": "K3-in-reward, verl's clamp"}
WIDE = ("k3_loss", "k3_reward", "k2_loss")  # the rows whose model-view width sizes the run


def fmt(v, digits=2):
    return f"{v[0]:.{digits}f} [{v[1]:.{digits}f}, {v[2]:.{digits}f}]"


# the cell formats of docs/kl_gradients.md's table (its snippet's sci, dec and big)
def table_sci(v):
    return [f"{x:.1e}".replace("e-0", "e-") for x in v]


def sci(v):
    return "{} [{}, {}]".format(*table_sci(v))


def dec(v, near=math.inf):  # 2 decimals; 3 for a point above `near` or a value under 0.01
    if all(math.isnan(x) for x in v):
        return ["undefined (E = 0)"]
    if v[1] == v[2]:
        return [f"{v[0]:g} (exact)"]
    d = 3 if abs(v[0]) > near else 2
    return [f"{x:.{3 if 0 < abs(x) < 0.01 else d}f}" for x in v]


def big(v):
    return [f"{x:.0f}" if x < 1000 else "inf" if math.isinf(x) else f"{float(f'{x:.2g}'):,.0f}"
            for x in v]


def contains(v, x=0.0):
    return v[1] <= x <= v[2]


def judge_range(v, low, high):
    """Confirmed if the interval lies inside the range, refuted if wholly outside it."""
    if low <= v[1] and v[2] <= high:
        return "confirmed"
    if v[2] < low or v[1] > high:
        return "refuted"
    return "undecided"


def judge_pair(d):
    """Model against layer from d's paired 95% interval ([-2, 2]: a squared norm not resolved)."""
    if (d[1], d[2]) == (-2.0, 2.0):
        return "undecided (a squared norm not resolved)"
    inside = -0.2 < d[1] and d[2] < 0.2
    if contains(d):
        return "agrees" if inside else "undecided"
    if inside:
        return "differs by under 0.2"
    return "differs (model higher)" if d[0] > 0 else "differs (model lower)"


def judge_tail(view, base):
    """A bug if a truncated check excludes 0 at the Bonferroni level; tail, not a bug, if the whole
    row's check excludes 0 while both truncated checks contain 0; open otherwise."""
    tails = [view["grad_tail"][f"{base}_below_{R}"] for R in (10, 100)]
    if any(not contains(t["check_bonferroni"]) for t in tails):
        return "bug"
    whole = view["rows"][base]["check"]
    if contains(whole):
        return "open (the whole row's check contains 0: no gap to explain)"
    if all(contains(t["check"]) for t in tails):
        return "tail, not a bug"
    return "open (a truncated check excludes 0 at 95%, not at the Bonferroni level: borderline)"


def main(path=HERE / "results.json"):
    run = json.loads(Path(path).read_text())
    for dist in run["distances"]:
        label, views = dist["label"], dist["views"]
        layer, model = views["layer"], views["model"]
        print(f"\n## {label}: {dist['groups']} groups ({dist['sequences']} sequences), pi "
              f"{dist['pi_hash']}, exact KL {fmt(dist['kl'])} nats a sequence")
        print(f"grad KL's squared norm resolved: layer {layer['grad_kl']['resolved']}, "
              f"model {model['grad_kl']['resolved']}; f's share: layer {fmt(layer['f_share'])}, "
              f"model {fmt(model['f_share'])}")

        print("\n| configuration | view | sampled = its exact expectation? | cos with grad KL | "
              "rel. bias | n* |")
        print("|---|---|---|---|---|---|")
        for name, title in NAMES.items():
            for view_name, view in (("layer", layer), ("model", model)):
                row = view["rows"][name]
                cells = []
                for key, f in (("check", table_sci), ("cos", lambda v: dec(v, 0.95)),
                               ("rel_bias", dec), ("n_star", big)):
                    s = f(row[key]) if key in row else ["-"]
                    cells.append(s[0] if len(s) == 1 else f"{s[0]} [{s[1]}, {s[2]}]")
                cells[0] += ": yes" if contains(row["check"]) else ": **no**"
                print(f"| {title if view_name == 'layer' else ''} | {view_name} | "
                      + " | ".join(cells) + " |")

        print("\nPredictions (ranges: the 95% interval inside the range; d: paired, model - layer):")
        for name, ((lo, hi), (dlo, dhi)) in RANGES[label].items():
            pair = model["vs_layer"][name]
            d = pair["diff"]
            print(f"- {NAMES[name]}: layer cos {fmt(pair['layer'])} vs {lo}-{hi}: "
                  f"{judge_range(pair['layer'], lo, hi)}; model cos {fmt(pair['model'])}; d "
                  f"{fmt(d)} vs {dlo} to {dhi}: {judge_range(d, dlo, dhi)}; model against layer: "
                  f"{judge_pair(d)}")

        # secondary, by points. A block's view is its kept coordinates, unweighted; times its
        # weight (parameters per kept coordinate) it estimates the block's squared norm, and its
        # share of ||p3||^2 is its share of ||grad KL||^2 times (its rel. bias of K3-in-reward over
        # the model's)^2, since ||p3|| = rel_bias * ||grad KL|| (eq. 45: E = grad KL - p3)
        blocks = list(views)[:len(dist["weights"])]
        gm, rbm = model["grad_kl"]["norm2"][0], model["rows"]["k3_reward"]["rel_bias"][0]
        share = {}
        print("\n| block | share of ||grad KL||^2 | share of ||p3||^2 | cos K3-in-loss | "
              "cos K3-in-reward |")
        print("|---|---|---|---|---|")
        for block, weight in zip(blocks, dist["weights"]):
            rows = views[block]["rows"]
            g = weight * views[block]["grad_kl"]["norm2"][0] / gm
            share[block] = (g, g * (rows["k3_reward"]["rel_bias"][0] / rbm) ** 2)
            print(f"| {block} | {g:.4f} | {share[block][1]:.4f} | {rows['k3_loss']['cos'][0]:.2f} "
                  f"| {rows['k3_reward']['cos'][0]:.2f} |")
        share_g, share_p3 = share["embed"]
        rb = {v: views[v]["rows"]["k3_reward"]["rel_bias"][0] for v in ("model", "layer")}
        print(f"- secondary: embed's share of ||p3||^2 {share_p3:.4f} against its share of "
              f"||grad KL||^2 {share_g:.4f}: {'as predicted' if share_p3 > share_g else 'not'}")
        print(f"- secondary: K3-in-reward's relative bias, model {rb['model']:.2f} against layer "
              f"{rb['layer']:.2f}: {'as predicted' if rb['model'] > rb['layer'] else 'not'}")

        print("\nThe gradient rows' tail (95% / Bonferroni 95%/8), per view:")
        for view_name, view in (("layer", layer), ("model", model)):
            for base in ("k3_loss", "k3_reward"):
                parts = [f"whole {sci(view['rows'][base]['check'])}"]
                for R in (10, 100):
                    t = view["grad_tail"][f"{base}_below_{R}"]
                    parts.append(f"<= {R}: {sci(t['check'])}, Bonferroni "
                                 f"{sci(t['check_bonferroni'])}, above {sci(t['check_above'])}")
                print(f"- {view_name}, {NAMES[base]}: {judge_tail(view, base)}; " + "; ".join(parts))

        widths = {NAMES[n]: model["rows"][n]["cos"][2] - model["rows"][n]["cos"][1] for n in WIDE}
        extend = any(w > 0.5 for w in widths.values())
        print("\nWidths of the model view's cosine intervals: "
              + ", ".join(f"{k} {w:.2f}" for k, w in widths.items())
              + (": wider than 0.5, extend once to 1,536 groups" if extend else ": all within 0.5"))
        print(f"K3's value: check {fmt(dist['check_k3'], 3)}; tokens of ratio over 1,000 drawn: "
              f"k3_below_1000 {fmt(dist['k3_below_1000'], 3)} against k3 {fmt(dist['k3'], 3)}; "
              f"tail probability over 1,000 a sequence {fmt(dist['tail_prob_1000'], 3)}")


if __name__ == "__main__":
    main(*sys.argv[1:])
