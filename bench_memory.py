"""Peak resident memory and step time of a training run (docs/benchmarks.md: memory).

Runs `torchrun train.py ARGS` (or `python train.py ARGS` with --procs 0) for a few steps in a fresh
output directory and prints the peak resident set size of the largest process (what GNU time's -v
reports), the accounting of the fixed part (weights, gradients, AdamW state, reference, sampler),
and the step times. The goal it checks: the embedded default,
`torchrun train.py --kl k1 --place reward`, under 4 GB.

    python bench_memory.py                                   # the default run, 3 steps
    python bench_memory.py --procs 2 -- --fsdp               # two ranks, FSDP2
    python bench_memory.py -- --micro-batch 16 --dtype float32
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).parent
GOAL_GB = 4.0

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--steps", type=int, default=3,
                    help="training steps (the first one allocates AdamW)")
parser.add_argument("--procs", type=int, default=1,
                    help="torchrun --nproc_per_node; 0 = plain python")
parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each process")
parser.add_argument("train_args", nargs="*", help="more train.py flags, after --")


def main(argv=None):
    args = parser.parse_args(argv)
    flags = ["--kl", "k1", "--place", "reward", "--steps", str(args.steps), *args.train_args]
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.procs}"]
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, *(launcher if args.procs else []), str(ROOT / "train.py"),
                   *flags, "--out", str(Path(out) / "run")]
        print(" ".join(command[1:]), flush=True)
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        result = subprocess.run(command, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
        if result.returncode:
            sys.exit(result.stderr[-3000:])
        rows = [json.loads(line) for line in (Path(out) / "run" / "metrics.jsonl").open()]
    # ru_maxrss of the children: the largest resident set of any process we waited for, in
    # KB (Linux)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1e6
    later = rows[1:] or rows  # step 1 is slower (first touches, AdamW state)
    mean = lambda key: sum(row[key] for row in later) / len(later)  # noqa: E731
    print(f"peak resident memory: {peak:.2f} GB ({'under' if peak < GOAL_GB else 'OVER'} the "
          f"{GOAL_GB:.0f} GB goal)")
    print(f"steps 2..{len(rows)}: sample {mean('sample_s'):.1f} s + train {mean('train_s'):.1f} s "
          f"per step, {mean('tokens_per_s'):.0f} tokens/s; reward "
          f"{[round(row['reward'], 3) for row in rows]}")


if __name__ == "__main__":
    main()
