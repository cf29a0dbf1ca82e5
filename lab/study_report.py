"""The report of a study (study.py): its table, figure and verdicts, from the runs' small outputs.

After its runs (or alone: --aggregate-only), from whatever seeds are done: STUDIES/PLAN/results.md
(a markdown table: final mean@k over seeds with its min and max and every seed's value, how many
seeds collapsed, the training metrics' last steps), aggregate.json (per step: each configuration's
mean, min and max over seeds; the final evaluation per seed), figure.png (one curve per
configuration, the band spanning its seeds; the final evaluation as bars with a dot per seed) and
the verdicts. The figure and the table are drawn here: plot.py draws single runs (its
read_metrics, eval_keys are reused).

Verdicts (studies/PREREGISTRATION.md, written before any run). A run collapsed at seed S if train.py
stopped it for non-finite updates, or if its final mean@k is below the base model's (evaluated with
the same --seed S) by more than two standard errors of the difference:
base - run > 2 sqrt(se_run^2 + se_base^2), each se over problems (eval.py's stderr). A finding names
a configuration X that the paper says is unstable and one Y that it says is not, and which of the
two the paper's claim is about. With n seeds and m = n // 2 + 1 (2 of 3): reproduced when X
collapsed in at least m seeds and Y in fewer than m. Otherwise, for a claim about X: not
reproduced when X collapsed in fewer than m seeds, inconclusive when both did (the setting breaks
both). For a claim about Y: not reproduced when both did (Y did not hold), inconclusive when X
collapsed in fewer than m (nothing to hold at this scale). The verdicts are over the plan's own
seeds (the pre-registered 0, 1, 2), whatever --seeds says, and wait for all of them for X, Y and
the base model ("incomplete").

The dose-response study of Fig. 7 (the second part of studies/PREREGISTRATION.md) adds two rules.
`unstable` and `chosen_lr` (fig7-calibration): no KL at a rate is unstable if its mean fall from the
base model over the seeds is at least 0.10 or at least one seed collapsed, and lr* is the lowest
unstable rate. `paired_verdict` (fig7-dose, findings "about": "paired"): per seed the contrast
d_S = KL_S - noKL_S of final mean@k (a diverged run scores 0), its mean over seeds with a 95% t
interval; inconclusive in this regime where no KL is not unstable or both collapse in a majority;
else reproduced where the interval lies above 0 and the KL collapsed in fewer seeds; not
reproduced where its top is below half of no KL's fall; inconclusive otherwise."""
import json
import math
from pathlib import Path


# ---------------------------------------------------------------- reading the outputs
def cpu_sessions(folder):
    """The sessions of FOLDER/machine.json that name a CPU (trained, resumed or evaluated there)."""
    path = folder / "machine.json"
    sessions = json.loads(path.read_text())["sessions"] if path.is_file() else []
    return [session for session in sessions if session.get("cpu")]


def read_rows(path):
    """metrics.jsonl's rows (plot.read_metrics: a truncated last line is dropped)."""
    from plot import read_metrics

    return read_metrics(path)


def read_result(folder, setting):
    """The final evaluation of the verdict task in FOLDER/EVAL_DIR/eval.json, {"diverged": message}
    for a diverged run, or None."""
    if (folder / "diverged.json").is_file():
        return {"diverged": json.loads((folder / "diverged.json").read_text())["message"]}
    path = folder / setting["eval_dir"] / "eval.json"
    if not path.is_file():
        return None
    results = {Path(task).stem if task.endswith(".jsonl") else task: result
               for task, result in json.loads(path.read_text()).items()}
    return results.get(setting["task"])


# ---------------------------------------------------------------- the rules
def collapsed(result, base):
    """The pre-registered rule: diverged, or the final mean@k below the base model's (same eval
    seed) by more than two standard errors of the difference."""
    if "diverged" in result:
        return True
    margin = 2 * math.sqrt(result["stderr"] ** 2 + base["stderr"] ** 2)
    return base["accuracy"] - result["accuracy"] > margin


# two-sided 95% quantiles of Student's t by the number of seeds (degrees of freedom + 1)
T95 = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571, 7: 2.447, 8: 2.365, 9: 2.306, 10: 2.262}


def accuracy(result):
    """A final mean@k; a diverged run scores 0 (it ends with no usable model)."""
    return 0.0 if "diverged" in result else result["accuracy"]


def contrast(results, x, y, seeds):
    """The paired contrast of fig7-dose: each seed's d_S = y_S - x_S, their mean, its 95% t interval
    over seeds, and D, the mean fall of x from the base model."""
    d = [accuracy(results[y][seed]) - accuracy(results[x][seed]) for seed in seeds]
    n, mean = len(d), sum(d) / len(d)
    se = math.sqrt(sum((v - mean) ** 2 for v in d) / (n - 1) / n)
    fall = sum(accuracy(results["base"][seed]) - accuracy(results[x][seed]) for seed in seeds) / n
    return {"d": d, "mean": mean, "se": se, "low": mean - T95[n] * se,
            "high": mean + T95[n] * se, "fall": fall}


def paired_verdict(x, y, results, seeds):
    """Stage 2's rule (fig7-dose; studies/PREREGISTRATION.md): does y (a KL) stabilize where x (no
    KL) is unstable? On the paired contrast's 95% interval and the collapse counts."""
    m = len(seeds) // 2 + 1
    counts = {name: sum(collapsed(results[name][seed], results["base"][seed]) for seed in seeds)
              for name in (x, y)}
    c = contrast(results, x, y, seeds)
    reason = (f"{y} - {x}: {c['mean']:+.3f} [{c['low']:+.3f}, {c['high']:+.3f}] (95% t interval "
              f"over {len(seeds)} seeds); {x} falls {c['fall']:.3f} from the base; collapsed: "
              f"{x} {counts[x]}, {y} {counts[y]} of {len(seeds)}")
    if c["fall"] < 0.10 and counts[x] == 0:
        return "inconclusive in this regime", reason + " (no KL is not unstable)"
    if counts[x] >= m and counts[y] >= m:
        return "inconclusive in this regime", reason + f" (both collapsed in >= {m})"
    if c["low"] > 0 and counts[y] < counts[x]:
        return "reproduced", reason
    if c["high"] < c["fall"] / 2:
        return "not reproduced", reason + " (recovers less than half of no KL's fall)"
    return "inconclusive", reason


def verdict(finding, results, seeds):
    """(verdict, reason) of a finding from results[name][seed] (a result, or None when missing)."""
    x, y = finding["collapses"], finding["holds"]
    missing = [f"{name} seed {seed}" for name in ("base", x, y) for seed in seeds
               if results[name].get(seed) is None]
    if missing:
        return "incomplete", "waiting for " + ", ".join(missing)
    if finding["about"] == "paired":
        return paired_verdict(x, y, results, seeds)
    m = len(seeds) // 2 + 1
    counts = {name: sum(collapsed(results[name][seed], results["base"][seed]) for seed in seeds)
              for name in (x, y)}
    reason = (f"{x} collapsed in {counts[x]} of {len(seeds)} seeds, {y} in {counts[y]} "
              f"(majority: {m})")
    if counts[x] >= m and counts[y] < m:
        return "reproduced", reason
    if finding["about"] == "collapses":
        return ("not reproduced" if counts[x] < m else "inconclusive"), reason
    return ("not reproduced" if counts[x] >= m else "inconclusive"), reason


def unstable(results, base, seeds):
    """Stage 1's rule (fig7-calibration): (unstable?, reason) of a configuration's results over
    seeds: the mean of base_S - run_S is at least 0.10, or at least 1 seed collapsed."""
    falls = [base[seed]["accuracy"] - results[seed]["accuracy"] for seed in seeds
             if "diverged" not in results[seed]]
    down = sum(collapsed(results[seed], base[seed]) for seed in seeds)
    mean_fall = sum(falls) / len(falls) if falls else math.inf
    return (mean_fall >= 0.10 or down >= 1,
            f"mean fall from the base {mean_fall:.3f}, collapsed in {down} of {len(seeds)}")


def chosen_lr(plan, studies, setting):
    """lr* of fig7-dose from the outputs of `plan` (fig7-calibration) in `studies`
    (studies/PREREGISTRATION.md, stage 1): (lr, reason), or (None, what it waits for)."""
    read = lambda name: {seed: read_result(studies / f"{name}-seed{seed}", setting)  # noqa: E731
                         for seed in plan["seeds"]}
    base, reasons = read("base"), []
    for lr in plan["rates"]:
        name = f"nokl-lag10-lr{lr:g}"
        results = read(name)
        missing = [f"{key} seed {seed}" for key, by_seed in (("base", base), (name, results))
                   for seed, result in by_seed.items() if result is None]
        if missing:
            return None, "waiting for " + ", ".join(missing) + " of fig7-calibration" + (
                f" (python -m lab.study fig7-calibration --only {name})"
                if plan["runs"][name].get("on_demand") else "")
        is_unstable, reason = unstable(results, base, plan["seeds"])
        reasons.append(f"lr {lr:g}: {reason}")
        if is_unstable:
            return lr, "; ".join(reasons) + f": lr* = {lr:g}, the lowest unstable rate"
    return 3e-5, "; ".join(reasons) + ": none unstable, lr* = 3e-05 (fig7: 3 of 3 collapsed)"


# ---------------------------------------------------------------- the table, the figure
def summary(values):
    """'mean [min, max]' of a list of numbers ('' when empty)."""
    if not values:
        return ""
    return f"{sum(values) / len(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


def eval_key(rows):
    from plot import eval_keys

    keys = eval_keys(rows)
    return keys[0] if keys else None


def curves(metrics, key):
    """{step: [each seed's value]} of one configuration (seeds that logged the step)."""
    by_step = {}
    for rows in metrics:
        for row in rows:
            value = row.get(key if key != "eval" else eval_key(rows) or "eval")
            if value is not None and math.isfinite(value):
                by_step.setdefault(row["step"], []).append(float(value))
    return dict(sorted(by_step.items()))


def share(c):
    """The share of no KL's fall D that a KL's mean contrast recovers, where no KL falls."""
    if c["fall"] <= 0:
        return f"- (no KL does not fall: {c['fall']:+.3f})"
    return f"{c['mean'] / c['fall']:.2f} (of {c['fall']:.3f})"


def aggregate(plan, args, seeds):
    """results.md, aggregate.json and figure.png in STUDIES/PLAN from what is there; returns the
    markdown (the table and the verdicts)."""
    setting = plan["scales"][args.scale]
    folders = {name: {seed: args.studies / f"{name}-seed{seed}" for seed in seeds}
               for name in plan["runs"]}
    results = {name: {seed: read_result(folder, setting) for seed, folder in by_seed.items()}
               for name, by_seed in folders.items()}
    metrics = {name: [read_rows(folder / "metrics.jsonl") for folder in by_seed.values()]
               for name, by_seed in folders.items()}
    keys = ("eval", "reward", "kl_k1", "kl_k3", "entropy", "grad_norm", "behaviour_kl_k1")
    table = aggregate_table(plan, setting, seeds, results, metrics)
    # the verdicts: over the plan's pre-registered seeds, whatever --seeds says
    registered = {name: {seed: read_result(args.studies / f"{name}-seed{seed}", setting)
                         for seed in plan["seeds"]} for name in plan["runs"]}
    verdicts = [(finding, *verdict(finding, registered, plan["seeds"]))
                for finding in plan["findings"]]
    lines = [f"# {plan['title']}", "", f"Seeds {','.join(map(str, seeds))}; `python -m lab.study "
             f"{args.plan}" + (f" --scale {args.scale}" if args.scale != "cpu" else "") + "`.",
             "", table, "", f"Verdicts (studies/PREREGISTRATION.md; seeds "
             f"{','.join(map(str, plan['seeds']))}):", ""]
    lines += [f"- **{label}**: {finding['name']}. {reason}." for finding, label, reason in verdicts]
    paired = [finding for finding in plan["findings"] if finding["about"] == "paired"]
    if paired and all(result for name in ("base", "nokl") for result in registered[name].values()):
        lines += ["", "| KL against no KL | each seed's d = KL - no KL | mean d [95% t interval] | "
                      "share of no KL's fall recovered |", "|---|---|---|---|"]
        for finding in paired:
            if all(registered[finding["holds"]].values()):
                c = contrast(registered, "nokl", finding["holds"], plan["seeds"])
                lines.append(f"| {plan['runs'][finding['holds']]['label']} | "
                             f"{', '.join(f'{v:+.3f}' for v in c['d'])} | {c['mean']:+.3f} "
                             f"[{c['low']:+.3f}, {c['high']:+.3f}] | {share(c)} |")
    if plan.get("choose_lr"):  # fig7-calibration: lr* and the lag-0 arm, by stage 1's rule
        lr, reason = chosen_lr(plan, args.studies, setting)
        lines += [f"- lr* for fig7-dose: {reason}."]
        lag0 = registered["nokl-lag0-lr2e-05"]
        if all(lag0.values()) and all(registered["base"].values()):
            is_unstable, why = unstable(lag0, registered["base"], plan["seeds"])
            lines += [f"- lag 0 at lr 2e-05 is {'' if is_unstable else 'not '}unstable: {why}."]
    if plan.get("one_kind_per_seed"):
        kinds = {seed: sorted({session["cpu"] for by_seed in folders.values()
                               for session in cpu_sessions(by_seed[seed])}) for seed in seeds}
        lines += ["", "CPU of each seed's runs: " + "; ".join(
            f"seed {seed}: {', '.join(kind) or '-'}" for seed, kind in kinds.items()) + "."]
    dtypes = sorted({session.get("train_dtype") for name, by_seed in folders.items()
                     for folder in by_seed.values() if (folder / "machine.json").is_file()
                     for session in json.loads((folder / "machine.json").read_text())["sessions"]}
                    - {None})
    if len(dtypes) > 1:
        lines += ["", f"Warning: the runs trained in different dtypes ({', '.join(dtypes)})."]
    markdown = "\n".join(lines) + "\n"
    args.studies.mkdir(parents=True, exist_ok=True)
    (args.studies / "results.md").write_text(markdown)
    (args.studies / "aggregate.json").write_text(json.dumps({
        "seeds": seeds,
        "curves": {name: {key: {str(step): {"mean": sum(v) / len(v), "min": min(v), "max": max(v),
                                            "n": len(v)}
                                for step, v in curves(metrics[name], key).items()}
                          for key in keys} for name in plan["runs"]},
        "final": {name: {str(seed): result for seed, result in by_seed.items()}
                  for name, by_seed in results.items()},
        "verdicts": [{"finding": finding["name"], "verdict": label, "reason": reason}
                     for finding, label, reason in verdicts]}, indent=1) + "\n")
    if any(rows for runs in metrics.values() for rows in runs) or any(
            r for by_seed in results.values() for r in by_seed.values()):
        figure(plan, setting, keys, results, metrics, args.studies / "figure.png")
    return markdown


def aggregate_table(plan, setting, seeds, results, metrics):
    """The markdown table: one row per configuration, over its seeds."""
    task, k = setting["task"], setting["eval"].get("samples")
    lines = [f"| configuration | {task}, mean@{k}: mean [min, max] over seeds | each seed "
             f"(± stderr over problems) | collapsed | held-out Pass@1 at the last evaluation | "
             f"train reward, last 5 steps | KL (K1), last 5 steps | max grad norm | skipped |",
             "|---" * 9 + "|"]
    for name, run in plan["runs"].items():
        finals = [results[name][seed] for seed in seeds]
        accuracies = [r["accuracy"] for r in finals if r and "accuracy" in r]
        each = ", ".join("diverged" if r and "diverged" in r else
                         f"{r['accuracy']:.3f} ± {r['stderr']:.3f}" if r else "-" for r in finals)
        if name == "base":
            down = ""
        else:
            judged = [collapsed(r, results["base"][seed]) for r, seed in zip(finals, seeds)
                      if r and results["base"].get(seed)]
            down = f"{sum(judged)} of {len(judged)}" if judged else ""
        runs = metrics[name]
        last_eval = [c[max(c)][0] for c in (curves([rows], "eval") for rows in runs) if c]
        last5 = lambda key: [sum(v) / len(v) for v in  # noqa: E731
                             ([row[key] for row in rows[-5:] if row.get(key) is not None]
                              for rows in runs) if v]
        grad = [max(row["grad_norm"] for row in rows) for rows in runs if rows]
        skipped = [sum(row.get("skipped", 0) for row in rows) for rows in runs if rows]
        lines.append(f"| {run['label']} | {summary(accuracies)} | {each} | {down} | "
                     f"{summary(last_eval)} | {summary(last5('reward'))} | "
                     f"{summary(last5('kl_k1'))} | {f'{max(grad):.1f}' if grad else ''} | "
                     f"{sum(skipped) if skipped else ''} |")
    return "\n".join(lines)


def figure(plan, setting, keys, results, metrics, path):
    """The curves (mean over seeds, the band spanning them) and the final evaluation's bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = {"eval": "held-out Pass@1 (during training)", "reward": "train reward",
              "kl_k1": "KL to the base, K1 (per sequence)", "kl_k3": "KL to the base, K3",
              "entropy": "entropy (per token)", "grad_norm": "gradient norm",
              "behaviour_kl_k1": "behaviour KL, K1 (sampler vs policy)"}
    colors = {name: "gray" if name == "base" else f"C{i}" for i, name in enumerate(plan["runs"])}
    fig, axes = plt.subplots(2, 4, figsize=(16, 7.5), layout="constrained")
    for axis, key in zip(axes.flat, keys):
        axis.set_title(titles[key], fontsize=11)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
        for name in plan["runs"]:
            by_step = curves(metrics[name], key)
            if not by_step:
                continue
            steps = list(by_step)
            mean = [sum(v) / len(v) for v in by_step.values()]
            axis.plot(steps, mean, color=colors[name], linewidth=1.5,
                      marker="o" if key == "eval" else None, markersize=3)
            axis.fill_between(steps, [min(v) for v in by_step.values()],
                              [max(v) for v in by_step.values()], color=colors[name], alpha=0.2)
        if key in ("grad_norm", "kl_k3") and axis.lines:
            axis.set_yscale("log")
        if not axis.lines:
            axis.text(0.5, 0.5, "no data", ha="center", va="center", transform=axis.transAxes,
                      color="gray")
    axis = axes.flat[-1]  # the final evaluation: a bar per configuration, a dot per seed
    for i, name in enumerate(plan["runs"]):
        finals = [r for r in results[name].values() if r and "accuracy" in r]
        if finals:
            values = [r["accuracy"] for r in finals]
            axis.bar(i, sum(values) / len(values), color=colors[name], alpha=0.6)
            axis.errorbar([i] * len(values), values, yerr=[r["stderr"] for r in finals], fmt="o",
                          color="black", markersize=3, capsize=2)
    axis.set_xticks(range(len(plan["runs"])), [run["label"] for run in plan["runs"].values()],
                    rotation=20, ha="right", fontsize=8)
    axis.set_title(f"final {setting['task']}, mean@{setting['eval'].get('samples')} "
                   f"(dots: seeds ± stderr)", fontsize=11)
    axis.grid(axis="y", alpha=0.3)
    handles = [matplotlib.lines.Line2D([], [], color=colors[name], linewidth=3)
               for name in plan["runs"]]
    fig.legend(handles, [run["label"] for run in plan["runs"].values()],
               loc="outside lower center", ncols=len(plan["runs"]), fontsize=11)
    fig.suptitle(plan["title"] + " (lines: mean over seeds; bands: their min to max)",
                    fontsize=12)
    fig.savefig(path, dpi=64)
    plt.close(fig)


