"""Every figure docs/precision.md quotes from this folder and from the H200's kl_floor runs: each
option's sequence K1 and K3 beside the float64 truth, as a relative difference.

    python studies/precision-split/figures.py
"""
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNS = {"CPU (this folder)": ROOT / "studies/precision-split",
        "H200 (docs/gpu-runs/h200-2026-11-27)": ROOT / "docs/gpu-runs/h200-2026-11-27"}


def weight_sizes():
    """The 10th, 50th and 90th percentiles of |w| over the embedded model's matrices (1e6 drawn)."""
    import torch

    sys.path.insert(0, str(ROOT))
    from systems.model import load_model

    torch.manual_seed(0)
    model = load_model("smollm2-135m")
    w = torch.cat([p.detach().abs().flatten() for p in model.parameters() if p.dim() == 2])
    sample = w[torch.randperm(len(w))[:1_000_000]]
    return torch.quantile(sample, torch.tensor([0.1, 0.5, 0.9])).tolist()


def main():
    low, median, high = weight_sizes()
    print(f"|w| of the embedded model's matrices: 10th percentile {low:.3f}, median {median:.3f}, "
          f"90th {high:.3f}; a step of 1e-7 is 2^{math.log2(1e-7 / low):.1f} to "
          f"2^{math.log2(1e-7 / high):.1f} of them")
    for machine, folder in RUNS.items():
        for name, model in (("kl_floor.json", "embedded"), ("kl_floor_bf16grid.json", "bf16 grid")):
            path = folder / name
            if not path.exists():
                continue
            run = json.loads(path.read_text())
            truth = run["rows"]["float64 (the truth)"]
            print(f"\n{machine}, {model} model: {run['bf16_exact']:.1%} of the weights bf16 "
                  f"numbers, the step moved {run['moved']:.2%} across a bf16 boundary")
            print("| log-probs | std | K1 | K1 vs truth | K3 | K3 vs truth |")
            print("|---|---|---|---|---|---|")
            for option, row in run["rows"].items():
                # + 0.0 after rounding: no "-0.00%"
                k1, k3 = (round(row[k] / truth[k] - 1, 4) + 0.0 for k in ("k1", "k3"))
                print(f"| {option} | {row['std']:.3g} | {row['k1']:.4g} | {k1:+.2%} | "
                      f"{row['k3']:.4g} | {k3:+.2%} |")


if __name__ == "__main__":
    main()
