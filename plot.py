"""Pictures of runs: training curves (as the paper's Fig. 2-4) and final evaluation bars (Fig. 5-6).

    python plot.py runs/a runs/b ... --out fig.png

A run directory holds what train.py and eval.py write there:
- metrics.jsonl: one JSON object per step (step, reward, kl_k1, kl_k3, entropy, response_len,
  grad_norm, and at --eval-every steps eval/<task>/accuracy); missing keys leave a gap, NaN
  (a skipped step) too;
- config.json: train.py's flags, for the label "k1-in-reward β=0.1" (else the directory name);
- eval.json: `python eval.py --model RUN/final --out RUN ...`, for the bar chart
  (mean@k ± stderr per task); also RUN/*/eval.json (one eval.py --out per setting,
  e.g. RUN/eval-math500), all tasks merged.
Each run gets one colour in every panel.
"""
import argparse
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt

parser = argparse.ArgumentParser(description="training curves and final evaluation of RL runs, "
                                             "as one PNG")
parser.add_argument("runs", nargs="+",
                    help="run directories (metrics.jsonl, config.json, eval.json)")
parser.add_argument("--out", default="fig.png", help="output PNG path")
parser.add_argument("--dpi", type=int, default=100,
                    help="resolution of the PNG (the figure is 16 x 10.5 inches)")
parser.add_argument("--smooth", type=float, default=0.0,
                    help="EMA weight in [0, 1) for curves; 0 = raw")

CURVES = [  # (metrics.jsonl key, panel title); "eval" stands for every eval/<task>/accuracy key
    ("reward", "train reward"),
    ("eval", "eval accuracy (Pass@1)"),
    ("kl_k1", "KL, K1 estimate (per sequence)"),
    ("kl_k3", "KL, K3 estimate (per sequence)"),
    ("entropy", "entropy (per token)"),
    ("response_len", "response length (tokens)"),
    ("grad_norm", "gradient norm"),
    ("behaviour_kl_k1", "behaviour KL, K1 (sampler vs policy)"),
]
LINESTYLES = ["-", "--", ":", "-."]  # one per eval task


def read_metrics(path):
    """The rows of a metrics.jsonl; a truncated last line (a run still writing) is dropped."""
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines):
                raise ValueError(f"{path}:{number}: not a JSON object") from None
    return rows


def run_label(run):
    """'k1-in-reward β=0.1' (and ', lag 10' under --async-lag) from the run's config.json
    (train.py's flags), else the directory name."""
    config_path = run / "config.json"
    if not config_path.is_file():
        return run.name
    config = json.loads(config_path.read_text())
    lag = f", lag {config['async_lag']}" if config.get("async_lag") else ""
    if config.get("place") == "none" or config.get("beta") == 0:
        return "no KL" + lag
    return f"{config.get('kl')}-in-{config.get('place')} β={config.get('beta')}" + lag


def read_evals(run):
    """{task: result} from RUN/eval.json and RUN/*/eval.json; a .jsonl task is named by its file
    stem."""
    results = {}
    for path in [run / "eval.json", *sorted(run.glob("*/eval.json"))]:
        if path.is_file():
            results.update({Path(task).stem if task.endswith(".jsonl") else task: result
                            for task, result in json.loads(path.read_text()).items()})
    return results


def ema(values, weight):
    """Exponential moving average that skips NaN (a skipped step stays a gap)."""
    smoothed, last = [], None
    for value in values:
        if value is not None and math.isfinite(value):
            last = value if last is None else weight * last + (1 - weight) * value
        smoothed.append(last if value is not None and math.isfinite(value) else float("nan"))
    return smoothed


def series(rows, key):
    """(steps, values) of the rows that have `key`; the step is the row's 'step', else its
    position."""
    pairs = [(row.get("step", i), row[key]) for i, row in enumerate(rows)
             if row.get(key) is not None]
    return [step for step, _ in pairs], [float(value) for _, value in pairs]


def eval_keys(rows):
    """The eval accuracy keys of a run's rows (eval/<task>/accuracy), sorted."""
    return sorted({key for row in rows for key in row
                   if key.startswith("eval") and key.endswith("accuracy")})


def main(argv=None):
    args = parser.parse_args(argv)
    if not 0 <= args.smooth < 1:
        parser.error("--smooth must be in [0, 1)")
    runs = [Path(run) for run in args.runs]
    for run in runs:
        if not run.is_dir():
            parser.error(f"{run} is not a directory")
    labels = [run_label(run) for run in runs]
    labels = [label if labels.count(label) == 1 else f"{label} ({run.name})"
              for label, run in zip(labels, runs)]
    metrics = [read_metrics(run / "metrics.jsonl") for run in runs]
    evals = [read_evals(run) for run in runs]
    colors = [f"C{i % 10}" for i in range(len(runs))]

    has_bars = any(evals)
    figure = plt.figure(figsize=(16, 10.5 if has_bars else 7), layout="constrained")
    grid = figure.add_gridspec(3 if has_bars else 2, 4)
    for panel, (key, title) in enumerate(CURVES):
        axis = figure.add_subplot(grid[panel // 4, panel % 4])
        axis.set_title(title, fontsize=11)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
        all_eval_keys = eval_keys([row for rows in metrics for row in rows])
        for rows, color in zip(metrics, colors):
            for curve_key in all_eval_keys if key == "eval" else [key]:
                steps, values = series(rows, curve_key)
                style = LINESTYLES[all_eval_keys.index(curve_key) % 4] if key == "eval" else "-"
                axis.plot(steps, ema(values, args.smooth), color=color, linestyle=style,
                          linewidth=1.5, marker="o" if key == "eval" else None, markersize=3)
        if key == "eval" and all_eval_keys:  # name the eval tasks by their line style
            for style, eval_key in zip(LINESTYLES * len(all_eval_keys), all_eval_keys):
                axis.plot([], [], color="gray", linestyle=style,
                          label=eval_key.removesuffix("/accuracy"))
            axis.legend(fontsize=8)
        if not any(len(line.get_xdata()) for line in axis.lines):
            axis.text(0.5, 0.5, "no data", ha="center", va="center", transform=axis.transAxes,
                      color="gray")
    handles = [matplotlib.lines.Line2D([], [], color=color, linewidth=3) for color in colors]
    figure.legend(handles, labels, loc="outside upper center", ncols=min(len(runs), 6), fontsize=11)

    if has_bars:  # Fig. 5-6: final mean@k ± stderr per task, one bar per run
        axis = figure.add_subplot(grid[2, :])
        tasks = list(dict.fromkeys(task for results in evals for task in results))
        evaluated = [(results, label, color) for results, label, color in zip(evals, labels, colors)
                     if results]
        width = 0.8 / len(evaluated)
        for r, (results, label, color) in enumerate(evaluated):
            xs = [t + (r - (len(evaluated) - 1) / 2) * width for t, task in enumerate(tasks)
                  if task in results]
            heights = [results[task]["accuracy"] for task in tasks if task in results]
            errors = [results[task].get("stderr", 0.0) for task in tasks if task in results]
            axis.bar(xs, heights, width, yerr=errors, capsize=3, color=color, label=label)
        samples = sorted({results[task].get("samples") for results in evals for task in results}
                         - {None})
        axis.set_ylabel(f"mean@{samples[0]} accuracy" if len(samples) == 1 else "mean@k accuracy")
        axis.set_xticks(range(len(tasks)), tasks)
        axis.set_title("final evaluation (± standard error over problems)", fontsize=11)
        axis.grid(axis="y", alpha=0.3)
    figure.savefig(args.out, dpi=args.dpi)
    print(f"wrote {args.out}")
    print(table(labels, metrics, evals))


def table(labels, metrics, evals, last=5):
    """A markdown table: each run's final eval (mean@k ± stderr per task) and its last `last`
    training steps."""
    tasks = list(dict.fromkeys(task for results in evals for task in results))
    keys = [("reward", "train reward"), ("kl_k1", "KL (K1)"), ("kl_k3", "KL (K3)"),
            ("entropy", "entropy")]
    lines = ["| run | " + " | ".join(tasks + [f"{name}, last {last} steps"
                                              for _, name in keys]) + " | skipped |",
             "|---" * (len(tasks) + len(keys) + 2) + "|"]
    for label, rows, results in zip(labels, metrics, evals):
        cells = [f"{results[task]['accuracy']:.3f} ± {results[task].get('stderr', 0):.3f}"
                 if task in results else "" for task in tasks]
        for key, _ in keys:
            values = [v for v in series(rows, key)[1][-last:] if math.isfinite(v)]
            cells.append(f"{sum(values) / len(values):.3f}" if values else "")
        cells.append(str(sum(row.get("skipped", 0) for row in rows)) if rows else "")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
