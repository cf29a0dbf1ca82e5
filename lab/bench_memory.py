"""Peak resident memory and step time of a training run (docs/benchmarks.md: memory).

Runs `torchrun train.py ARGS` (or `python train.py ARGS` with --procs 0) as a user launches it, all
20 steps by default, in a fresh output directory, and prints the peak resident set size of the
largest process (what GNU time's -v reports), the peak of each block of steps (read from /proc
every 0.2 s: a margin that shrinks as steps go on shows there), and the step times. The goal it
checks: the embedded default, `torchrun train.py --kl k1 --place reward`, under 4 GiB.

    python -m lab.bench_memory                                   # the default run, 20 steps
    python -m lab.bench_memory --worst-case --steps 3            # every response at its longest
    python -m lab.bench_memory --steps 3 --procs 2 -- --fsdp     # two ranks, FSDP2
    python -m lab.bench_memory -- --micro-batch 16 --dtype float32
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository
GOAL_GIB = 4.0

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--steps", type=int, default=20,
                    help="training steps (the default run's 20; the first one allocates AdamW)")
parser.add_argument("--procs", type=int, default=1,
                    help="torchrun --nproc_per_node; 0 = plain python")
parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each process")
parser.add_argument("--worst-case", action="store_true",
                    help="no stop ids: every response runs to --max-new-tokens, the longest batch "
                         "any step can meet, so its peak bounds every step of every run")
parser.add_argument("train_args", nargs="*", help="more train.py flags, after --")


def worst_case_worker(argv):
    """train.main(ARGV) with no stop ids (what --worst-case launches in each process)."""
    import train

    train.stop_token_ids = lambda *args, **kwargs: []
    train.main(argv)


def resident_gib(marker):
    """The largest resident set (VmRSS, GiB) among the processes whose command line has
    `marker`."""
    largest = 0.0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker in Path(f"/proc/{pid}/cmdline").read_text():
                status = Path(f"/proc/{pid}/status").read_text()
                kb = int(status.split("VmRSS:")[1].split()[0]) if "VmRSS:" in status else 0
                largest = max(largest, kb / 2**20)
        except (OSError, IndexError, ValueError):  # the process ended meanwhile
            continue
    return largest


def main(argv=None):
    args = parser.parse_args(argv)
    flags = ["--kl", "k1", "--place", "reward", "--steps", str(args.steps), *args.train_args]
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.procs}"]
    with tempfile.TemporaryDirectory() as out:
        run, metrics_path = Path(out) / "run", Path(out) / "run" / "metrics.jsonl"
        script = (["-m", "lab.bench_memory", "--as-worker"] if args.worst_case
                  else [str(ROOT / "train.py")])
        command = [sys.executable, *(launcher if args.procs else []), *script, *flags,
                   "--out", str(run)]
        print(" ".join(command[1:]), flush=True)
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True)
        by_step = {}  # steps done -> the largest resident set seen meanwhile
        while process.poll() is None:
            done = len(metrics_path.read_text().splitlines()) if metrics_path.exists() else 0
            by_step[done] = max(by_step.get(done, 0.0), resident_gib(str(run)))
            time.sleep(0.2)
        stderr = process.stderr.read()
        if process.returncode:
            sys.exit(stderr[-3000:])
        rows = [json.loads(line) for line in metrics_path.open()]
    # ru_maxrss of the children: the largest resident set of any process we waited for, in KiB
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    later = rows[1:] or rows  # step 1 is slower (first touches, AdamW state)
    mean = lambda key: sum(row[key] for row in later) / len(later)  # noqa: E731
    print(f"peak resident memory: {peak:.2f} GiB ({'under' if peak < GOAL_GIB else 'OVER'} the "
          f"{GOAL_GIB:.0f} GiB goal)")
    blocks = [range(first, min(first + 5, len(rows) + 1)) for first in range(1, len(rows) + 1, 5)]
    print("peak while running steps " + ", ".join(
        f"{block[0]}-{block[-1]}: {max(by_step.get(s - 1, 0.0) for s in block):.2f} GiB"
        for block in blocks))
    print(f"steps 2..{len(rows)}: sample {mean('sample_s'):.1f} s + train {mean('train_s'):.1f} s "
          f"per step, {mean('tokens_per_s'):.0f} tokens/s; mean response length up to "
          f"{max(row['response_len'] for row in rows):.1f} tokens")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--as-worker"]:
        worst_case_worker(sys.argv[2:])
    else:
        main()
