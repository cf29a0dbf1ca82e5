"""The pilot's table from each run's metrics.jsonl: held-out Pass@1 at each evaluation, and the last
5 steps' train reward, KL to the reference, behaviour KL (sampler vs current policy) and ratio;
a directory with only an eval.json (the base model) gives its accuracy.

    cd studies/async-pilot && python table.py */
"""
import json
import pathlib
import sys


def mean(values):
    """The mean as a table cell; "-" where the run logs no value (no reference without a KL)."""
    values = [v for v in values if v is not None]
    return f"{sum(values) / len(values):.2f}" if values else "-"


print("| run | lr | held-out Pass@1 at steps 5 / 10 / 15 / 20 | train reward, last 5 | "
      "KL to ref (K1), last 5 | behaviour KL (K1), last 5 | max ratio | max grad norm |")
print("|---|---|---|---|---|---|---|---|")
for run in sys.argv[1:]:
    run = pathlib.Path(run)
    if not (run / "metrics.jsonl").exists():  # the base model: eval.py's mean@8 on the same problems
        result = json.loads((run / "eval.json").read_text())["arith"]
        print(f"| {run.name} (eval.py, mean@{result['samples']}) | | "
              f"{result['accuracy']:.2f} ± {result['stderr']:.2f} | | | | | |")
        continue
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line]
    config = json.loads((run / "config.json").read_text())
    evals = " / ".join(f"{row['eval/arith/accuracy']:.2f}" for row in rows
                       if "eval/arith/accuracy" in row)
    last = rows[-5:]
    print(f"| {run.name} | {config['lr']:g} | {evals} | {mean(r['reward'] for r in last)} | "
          f"{mean(r['kl_k1'] for r in last)} | "
          f"{mean(r['behaviour_kl_k1'] for r in last)} | "
          f"{max(r['ratio_max'] for r in rows):.1f} | {max(r['grad_norm'] for r in rows):.2f} |")
