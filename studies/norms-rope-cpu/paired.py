"""The three A/B runs' rounds paired (a round is one seed: the same rows on both sides):
after/before CPU time, geometric mean and 95% interval (t over the rounds):
`python studies/norms-rope-cpu/paired.py`."""
import math
import re
import statistics
from pathlib import Path

HERE = Path(__file__).parent
T_975 = {13: 2.160}  # Student's t, 97.5% quantile, by degrees of freedom

ratios, first = [], {"before": [], "after": []}  # by the side that ran first in the round
for name in ("output.txt", "output-second.txt", "output-third.txt"):
    lines = (HERE / name).read_text().splitlines()
    seconds = {side: [float(x) for x in re.findall(r"'([\d.]+)s/", line)]
               for line in lines for side in ("before", "after") if line.startswith(f"{side} [")}
    for round_, (before, after) in enumerate(zip(seconds["before"], seconds["after"])):
        ratios.append(after / before)
        first["before" if round_ % 2 == 0 else "after"].append(after / before)  # ab.py's order
logs = [math.log(ratio) for ratio in ratios]
mean, error = statistics.mean(logs), statistics.stdev(logs) / math.sqrt(len(logs))
t = T_975[len(logs) - 1]
print(f"{len(ratios)} rounds, after/before CPU time: geometric mean {math.exp(mean):.3f}, 95% "
      f"interval {math.exp(mean - t * error):.3f} to {math.exp(mean + t * error):.3f}")
for side, values in first.items():
    print(f"  the rounds where {side} ran first: after/before {statistics.geometric_mean(values):.3f}"
          f" ({len(values)} rounds)")
