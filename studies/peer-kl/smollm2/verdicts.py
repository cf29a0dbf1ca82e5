"""The registered rules of PREREGISTRATION.md applied to results.json (the 12 presets on SmolLM2, step 20,
the last layer): one line per prediction, hit or miss, with the numbers that judge it.

    python studies/peer-kl/smollm2/verdicts.py [results.json]
"""
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
P1 = ("nemo-k3-before-2506", "verl-low-var-kl-loss", "openrlhf-k3-loss")
P2 = ("nemo-k3", "nemo-k3-onpolicy-approx")
P3 = ("openrlhf-k1-reward",)
SEQ_MEAN = ("slime-k1-loss", "slime-low-var-kl", "slime-unbiased-kl", "skyrl-k3-loss", "skyrl-k2-loss")


def label(distance):
    """"step 20": the run's label is its --policy folder's name, step_20 (this line added after
    the results: the registered script looked for "step 20" and found no distance)."""
    return distance["label"].replace("_", " ")


def fmt(x):
    return f"{x[0]:.3g} [{x[1]:.3g}, {x[2]:.3g}]"


def contains(interval, value):
    return interval[1] <= value <= interval[2]


def verdicts(results):
    """[(prediction, preset, hit, the numbers)] of the registered rules, from the distance "step 20"."""
    (dist,) = [d for d in results["distances"] if label(d) == "step 20"]
    layer = dist["views"]["layer"]
    terms = {name.removeprefix("preset:"): row for name, row in layer["terms"].items()}
    k3_loss = layer["rows"]["k3_loss"]["rel_bias"]
    out = []
    for preset in P1:
        row = terms[preset]
        hit = row["vs_parent_rel"][1] > 0.1 and row["rel_bias"][0] < k3_loss[0]
        out.append(("P1", preset, hit, f"vs p3 {fmt(row['vs_parent_rel'])} (lower > 0.1); rel_bias "
                                      f"{fmt(row['rel_bias'])} against K3-in-loss's {fmt(k3_loss)}"))
    for name, presets in (("P2", P2), ("P3", P3)):
        for preset in presets:
            row = terms[preset]
            out.append((name, preset, row["vs_parent_rel"][2] < 0.05,
                        f"vs its toy verdict's row {fmt(row['vs_parent_rel'])} (upper < 0.05)"))
    for preset in P1 + P2 + P3:
        row = terms[preset]
        out.append(("P4", preset, contains(row["check"], 0.0),
                    f"sampled - exact {fmt(row['check'])} (0 inside)"))
    for preset in SEQ_MEAN:
        row = terms[preset]
        out.append(("P5", preset, contains(row["vs_parent"], 0.0),
                    f"vs its toy verdict's row {fmt(row['vs_parent'])} (0 inside)"))
    row = terms["trl-grpo-k3-corrected-sequence"]
    out.append(("P5", "trl-grpo-k3-corrected-sequence",
                contains(row["cos"], 1.0) and contains(row["rel_bias"], 0.0),
                f"cos {fmt(row['cos'])} (1 inside), rel_bias {fmt(row['rel_bias'])} (0 inside)"))
    return dist, out


TOY = {"K3-in-loss": "K3-in-loss (p3)", "token-level reverse KL": "token-level reverse KL (p2)",
       "grad KL": "grad KL", "0": "0", None: "none"}


def markdown(results):
    """docs/peers.md's table of the 12 (added after the registration, before the results were
    read; the rules above unchanged): per preset its row, its toy verdict, cos and relative bias
    with grad KL, its distance from the toy verdict's row, and the sampled row's check."""
    (dist,) = [d for d in results["distances"] if label(d) == "step 20"]
    layer = dist["views"]["layer"]
    lines = ["| preset | row | toy verdict (near settings) | cos with grad KL | rel. bias | "
             "\|\|E - toy verdict's row\|\| / \|\|grad KL\|\| | sampled - exact |",
             "|---|---|---|---|---|---|---|"]
    for name, row in layer["terms"].items():
        parent = dist_parent(results, name)
        lines.append(f"| `{name.removeprefix('preset:')}` | {'exact' if row['exact'] else 'sampled'} "
                     f"| {TOY[parent]} | {fmt(row['cos'])} | {fmt(row['rel_bias'])} | "
                     f"{fmt(row['vs_parent_rel']) if 'vs_parent_rel' in row else '-'} | "
                     f"{fmt(row['check']) if 'check' in row else '-'} |")
    for name in ("k3_loss", "k2_loss"):  # the parents' own rows, for comparison
        row = layer["rows"][name]
        lines.append(f"| (this project's {name}) | exact | - | {fmt(row['cos'])} | "
                     f"{fmt(row['rel_bias'])} | - | {fmt(row['check'])} |")
    return "\n".join(lines)


def dist_parent(results, name):
    """The toy verdict the run recorded for a term row (its chunks' records, in results.json's
    flags: recomputed from the preset)."""
    sys.path.insert(0, str(HERE.parents[2]))
    from lab import kl_gradients
    spec = kl_gradients.preset_terms(name.removeprefix("preset:"))[name]
    return kl_gradients.term_parent(*spec)


def main(path=HERE / "results.json"):
    dist, rows = verdicts(json.loads(Path(path).read_text()))
    print(f"{dist['label']}: {dist['groups']} groups, KL {dist['kl'][0]:.3f} nats a sequence (exact), "
          f"pi {dist['pi_hash']}")
    for prediction, preset, hit, numbers in rows:
        print(f"{prediction} {preset:<32} {'hit ' if hit else 'MISS'}  {numbers}")
    hits = sum(hit for *_, hit, _ in rows)
    print(f"{hits} hits, {len(rows) - hits} misses of {len(rows)} registered tests")
    print()
    print(markdown(json.loads(Path(path).read_text())))


if __name__ == "__main__":
    main(*sys.argv[1:])
