"""One-off (machine A, 2026-12-03, third session, at e4130b8's code): the default run, 4 steps,
under glibc's environment variables, one run a variant in the order given (ABCBA was run): A as it
was, B every block from the heap and never trimmed, C that and no huge pages (what runtime.start
now sets itself). Its printed lines (variant, median step, sample, train, peak GB, each step's
seconds, kl_k1): freed_kept_env.txt (the last A ran beside a 23 s test).
`python studies/cpu-step/freed_kept_env.py ABCBA` runs the checkout's code: from 6828d36 on, A is
what C was (start's own settings), and B and C keep their variables (start leaves glibc as the
environment sets it)."""
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from lab import bench_step  # noqa: E402

KEEP = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**40)}
VARIANTS = {"A": {}, "B": KEEP, "C": {**KEEP, "THP_MEM_ALLOC_ENABLE": "0"}}
base = dict(os.environ)
for name in sys.argv[1]:
    os.environ.clear()
    os.environ.update({**base, **VARIANTS[name]})
    r = bench_step.run_once(str(ROOT), ["--kl", "k1", "--place", "reward"], 4,
                            tempfile.mkdtemp() + "/run")
    print(name, round(r["median_step_s"], 1), round(r["median_sample_s"], 1),
          round(r["median_train_s"], 1), round(r["peak_rss_gb"], 2),
          [round(x, 1) for x in r["step_s"]], r["kl_k1"], flush=True)
