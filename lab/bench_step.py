"""The default run's step, one commit against another, alternated on one machine (issue 62, item 5):
each run is `python train.py ARGS --steps N` in a fresh process, each commit's in a git worktree of
its own (made and removed here: edits to the checkout during the runs change nothing), and a pair is
one run of each, in turn, A B A B...

Per run: the step's seconds (sample_s + train_s of metrics.jsonl), the median over the steps after
the first (which warms up), its parts, and the process's peak resident memory (os.wait4's
ru_maxrss). Per pair: --ours' median over --against's; the summary takes the median of the pairs'
ratios and their range (the machine's speed drifts between pairs, not within one).

    python -m lab.bench_step --against 09486f1 --pairs 2 --steps 4 --out bench_step.json
    python -m lab.bench_step --against 09486f1 -- --kl k3 --place loss   # another configuration
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_once(checkout, train_args, steps, out):
    """One train.py run in `checkout`: its per-step seconds and peak resident memory."""
    command = [sys.executable, "train.py", *train_args, "--steps", str(steps), "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    log = Path(f"{out}.stderr.txt")  # beside OUT: train.py refuses a non-empty --out
    start = time.perf_counter()
    with open(log, "w") as stderr:
        process = subprocess.Popen(command, cwd=checkout, env=env, stdout=subprocess.DEVNULL,
                                   stderr=stderr)
        _, status, usage = os.wait4(process.pid, 0)  # reaped here: its own rusage
        process.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    if process.returncode:
        last = log.read_text().strip().splitlines()[-1:]
        sys.exit(f"bench_step: the run in {checkout} failed: {last}")
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    later = rows[1:] or rows
    return {"step_s": [row["sample_s"] + row["train_s"] for row in rows],
            "median_step_s": statistics.median(row["sample_s"] + row["train_s"] for row in later),
            "median_sample_s": statistics.median(row["sample_s"] for row in later),
            "median_train_s": statistics.median(row["train_s"] for row in later),
            "kl_k1": [row["kl_k1"] for row in rows], "wall_s": wall,
            "peak_rss_gb": peak_rss_gb(usage)}


def peak_rss_gb(usage):
    """The finished child's peak resident memory, GB (ru_maxrss is in KiB on Linux)."""
    return usage.ru_maxrss * 1024 / 1e9


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, help="the commit to time against")
    parser.add_argument("--ours", default="HEAD", help="the commit timed (its committed files)")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="steps a run (the first warms up)")
    parser.add_argument("--out", default=None, help="write the figures here as JSON")
    parser.add_argument("train_args", nargs="*", help="train.py's flags after --")
    args = parser.parse_args(argv)
    train_args = args.train_args or ["--kl", "k1", "--place", "reward"]
    commit = lambda name: subprocess.run(  # noqa: E731
        ["git", "rev-parse", "--short", name], cwd=ROOT, capture_output=True, text=True,
        check=True).stdout.strip()
    result = {"argv": train_args, "steps": args.steps, "machine": platform.processor(),
              "cpus": os.cpu_count(), "ours": commit(args.ours), "against": commit(args.against),
              "pairs": []}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {name: Path(tmp) / name for name in ("ours", "against")}
        for name, tree in trees.items():
            subprocess.run(["git", "worktree", "add", "--detach", str(tree), result[name]],
                           cwd=ROOT, check=True, capture_output=True)
        try:
            for pair in range(args.pairs):
                ours = run_once(trees["ours"], train_args, args.steps, Path(tmp) / f"ours-{pair}")
                theirs = run_once(trees["against"], train_args, args.steps,
                                  Path(tmp) / f"theirs-{pair}")
                ratio = ours["median_step_s"] / theirs["median_step_s"]
                result["pairs"].append({"ours": ours, "against": theirs, "ratio": ratio})
                print(f"pair {pair + 1}: {ours['median_step_s']:.1f} s against "
                      f"{theirs['median_step_s']:.1f} s a step, ratio {ratio:.3f}", flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                               capture_output=True)
    ratios = [pair["ratio"] for pair in result["pairs"]]
    result["ratio_median"], result["ratio_range"] = statistics.median(ratios), [min(ratios),
                                                                               max(ratios)]
    print(f"{result['ours']} / {result['against']}: {result['ratio_median']:.3f} "
          f"(pairs {min(ratios):.3f}-{max(ratios):.3f})")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
