"""The registered replication at step 20 (issue 36), judged by its rule (docs/kl_gradients.md, "Registered
now, before it runs", committed in 39ab71a and 3014bfe before the replication's first chunk):

- prediction: no truncated check (R = 10, 100; K3-in-loss and K3-in-reward; `layer` and `model`) excludes 0
  at the Bonferroni level, and the number of sequences drawing a token of ratio in (10, 100] lies in the
  central 95% that tail_bins.py prints for it;
- rule: if a truncated check excludes 0 at the Bonferroni level, the bug is reproduced (no sampled K3 row of
  this pi is reported at any step); if none does, seed 0's step 20 verdict stays "bug", read as not
  reproduced on fresh groups, and the replication's own tail verdicts decide whether its K3 rows are reported.

    python studies/kl-gradients-whole/replication.py studies/kl-gradients-whole/step20-seed1/results.json \\
        /work/runs/kl-gradients-whole/chunks-seed1/step_20 24

Written while the replication ran and before any of its statistics were read (its chunks' records were
only counted); the rule's own functions (verdicts.judge_tail, tail_bins.sequences_drawing) are the ones
committed before.
"""
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from tail_bins import mass, per_sequence, sequences_drawing  # noqa: E402
from verdicts import contains, judge_tail, sci  # noqa: E402

ROWS = {"k3_loss": "K3-in-loss", "k3_reward": "K3-in-reward"}


def main(results, chunk_dir, chunks=24):
    (dist,) = json.loads(Path(results).read_text())["distances"]
    assert dist["label"] == "step 20", dist["label"]
    print(f"## the replication: {dist['label']}, {dist['groups']} groups ({dist['sequences']} "
          f"sequences), pi {dist['pi_hash']}\n")
    print("| view | row | R | check | Bonferroni interval | excludes 0 |\n|---|---|---|---|---|---|")
    excluded = []
    for view_name in ("layer", "model"):
        view = dist["views"][view_name]
        for base, title in ROWS.items():
            for R in (10, 100):
                tail = view["grad_tail"][f"{base}_below_{R}"]
                out = not contains(tail["check_bonferroni"])
                excluded += [f"{view_name} {title} R = {R}"] * out
                print(f"| {view_name} | {title} | {R} | {sci(tail['check'])} | "
                      f"{sci(tail['check_bonferroni'])} | {'**yes**' if out else 'no'} |")

    s, read = per_sequence(Path(chunk_dir), int(chunks))
    count = s["tail_prob_10"] - s["tail_prob_100"]
    drawn = mass(s, "100", False) - mass(s, "10", False)
    hit = int((np.abs(drawn) > 1e-9).sum())
    low, high, p_at_most = sequences_drawing(count, hit)
    inside = low <= hit <= high
    print(f"\nSequences drawing a token of ratio in (10, 100] ({read} chunks, {len(drawn)} sequences): "
          f"{hit}, against {(1 - np.exp(-count)).sum():.1f} expected, central 95% [{low}, {high}], "
          f"P(at most {hit}) = {p_at_most:.4f}: {'inside' if inside else '**outside**'}")

    print("\nPrediction:", "holds" if not excluded and inside else "fails", "(" + (
        "no truncated check excludes 0 at the Bonferroni level" if not excluded else
        "excluding 0: " + "; ".join(excluded)) + f"; the count {'inside' if inside else 'outside'})")
    if excluded:
        print("Rule: the bug is REPRODUCED. No sampled K3 row of this pi is reported at any step.")
        return
    print("Rule: not reproduced on fresh groups; seed 0's step 20 verdict stays 'bug' in the record.")
    print("The replication's own tail verdicts (they decide whether its K3 rows are reported):")
    for view_name in ("layer", "model"):
        for base, title in ROWS.items():
            verdict = judge_tail(dist["views"][view_name], base)
            print(f"- {view_name}, {title}: {verdict}: "
                  f"{'withheld' if verdict == 'bug' else 'reported'}")


if __name__ == "__main__":
    main(*sys.argv[1:])
