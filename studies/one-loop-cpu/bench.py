"""The default run's whole train step (`python train.py --kl k1 --place reward`: SmolLM2-135M on
arith, 8 prompts x 4, 40 new tokens), its sampler decoding by compaction (`generate(static=False)`,
the CPU's default at e65e46a) against the fixed-shape loop (`static=True`), rollout.py at the
commit the tree is at. Each arm is a fresh process running train.py's main for `--steps` steps (one
thread); rounds alternate the arms' order (A B, B A, ...). A step is timed from the start of its
sampling to the end of its refresh_sampler (train.py's last call in a step): CPU seconds of the
process (time.process_time) and wall seconds; the sampling alone too.

    OMP_NUM_THREADS=1 python studies/one-loop-cpu/bench.py --rounds 4 --steps 2 \
        > studies/one-loop-cpu/output.txt
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARMS = {"compaction": False, "fixed": True}
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365}  # Student t, df

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--rounds", type=int, default=4)
parser.add_argument("--steps", type=int, default=2, help="train steps a process")
parser.add_argument("--arm", choices=ARMS, default=None, help="(internal) run one arm, print JSON")
args = parser.parse_args()


def run_arm(arm, steps):
    """One process: train.py's main with generate's loop pinned to `arm`; per-step timings."""
    sys.path.insert(0, str(ROOT))
    import torch
    import rollout
    import train
    from systems import runtime

    torch.set_num_threads(1)
    marks = []  # (event, cpu s, wall s)
    generate, refresh = rollout.generate, runtime.refresh_sampler

    def timed_generate(*a, **k):
        marks.append(("sample", time.process_time(), time.time()))
        out = generate(*a, static=ARMS[arm], **k)
        marks.append(("sampled", time.process_time(), time.time()))
        return out

    def timed_refresh(*a, **k):
        refresh(*a, **k)
        marks.append(("step end", time.process_time(), time.time()))

    rollout.generate, runtime.refresh_sampler = timed_generate, timed_refresh
    with tempfile.TemporaryDirectory() as out:
        train.main(["--kl", "k1", "--place", "reward", "--steps", str(steps), "--out", out])
    starts = [m for m in marks if m[0] == "sample"]
    sampled = [m for m in marks if m[0] == "sampled"]
    ends = [m for m in marks if m[0] == "step end"]
    return [{"step_cpu": e[1] - s[1], "step_wall": e[2] - s[2],
             "sample_cpu": d[1] - s[1], "sample_wall": d[2] - s[2]}
            for s, d, e in zip(starts, sampled, ends)]


if args.arm is not None:
    print("RESULT " + json.dumps(run_arm(args.arm, args.steps)), flush=True)
    sys.exit()

commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                        capture_output=True, text=True).stdout.strip()
print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, tree at {commit or '(copy)'}, "
      f"{args.rounds} rounds x {args.steps} steps, "
      f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
      f"machine shared with other jobs", flush=True)
totals = {arm: [] for arm in ARMS}
for round_ in range(args.rounds):
    order = list(ARMS) if round_ % 2 == 0 else list(ARMS)[::-1]
    for arm in order:
        proc = subprocess.run([sys.executable, __file__, "--arm", arm, "--steps", str(args.steps)],
                              capture_output=True, text=True, cwd=ROOT)
        line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        if not line:
            print(proc.stdout[-2000:], proc.stderr[-4000:])
            sys.exit(f"round {round_} {arm} failed")
        steps = json.loads(line[0][7:])
        totals[arm].append({key: sum(s[key] for s in steps) for key in steps[0]})
        print(f"round {round_} {arm}: " + "; ".join(
            f"step {i + 1} cpu {s['step_cpu']:.2f} s wall {s['step_wall']:.2f} s "
            f"(sampling cpu {s['sample_cpu']:.2f} wall {s['sample_wall']:.2f})"
            for i, s in enumerate(steps)), flush=True)

for key in ("step_cpu", "step_wall", "sample_cpu", "sample_wall"):
    ratios = [f[key] / c[key] for f, c in zip(totals["fixed"], totals["compaction"])]
    mean = statistics.mean(ratios)
    spread = statistics.stdev(ratios) if len(ratios) > 1 else float("nan")
    half = T975[len(ratios) - 1] * spread / len(ratios) ** 0.5 if len(ratios) > 1 else spread
    print(f"fixed / compaction, {key}: per round {' '.join(f'{r:.3f}' for r in ratios)}; "
          f"mean {mean:.3f}, sd {spread:.3f}, 95% interval {mean - half:.3f} to {mean + half:.3f}")
