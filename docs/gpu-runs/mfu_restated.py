"""Every MFU the H200 runs recorded, restated over the attention pairs the mask allows (issue 55).

Until 2026-11-28 lab/bench_train.pass_flops counted attention over every (query, key) pair of a pack,
what SDPA computes under the block mask, not the model's work; the runs' files keep those figures
("mfu"). Each is restated here from the same time and the honest count: MFU x pass_flops(allowed) /
pass_flops(computed), the shapes and flags read from each file, the models built on the meta device.
The 2026-11-28 gradient pass recorded no MFU; it is computed from its time and the honest count.

    python docs/gpu-runs/mfu_restated.py
"""
import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
from lab import bench_train  # noqa: E402


def ratio(shape, flags, backward):
    """pass_flops over the allowed pairs / over every pair, at `shape` with the run's flags."""
    args = argparse.Namespace(**flags)
    model = bench_train.build(shape, "meta")
    rows = args.prompts * args.group_size
    return (bench_train.pass_flops(model, args, rows, backward)
            / bench_train.pass_flops(model, args, rows, backward, "computed"))


def restated(path):
    report = json.loads((HERE / path).read_text())
    flags, peak = report["flags"], report["machine"]["bf16_peak_flops"]
    for part, result in report["parts"].items():
        shape = result["shape"]
        allowed, every = bench_train.attention_pairs(argparse.Namespace(**flags))
        print(f"{path} {part}: the mask allows {allowed / every:.1%} of a pack's pairs")
        for phase, value in result.items():
            if not isinstance(value, dict):
                continue
            if value.get("mfu") is not None:
                backward = phase.startswith("update")
                print(f"  {phase}: recorded {value['mfu']:.1%} (every pair), "
                      f"honest {value['mfu'] * ratio(shape, flags, backward):.1%}")
            if phase == "block_mask" and "gradient_pass_s" in value:  # no MFU recorded: compute it
                args = argparse.Namespace(**flags)
                model = bench_train.build(shape, "meta")
                rows = args.prompts * args.group_size
                for pairs in ("computed", "allowed"):
                    mfu = bench_train.mfu(bench_train.pass_flops(model, args, rows, True, pairs),
                                          value["gradient_pass_s"], peak)
                    print(f"  {phase} gradient pass {value['gradient_pass_s']:.2f} s: MFU {mfu:.1%} "
                          f"over {'every pair' if pairs == 'computed' else 'the allowed pairs'}")


for path in ("h200-2026-11-27/bench_train.json", "h200-2026-11-27/bench_precision.json",
             "h200-2026-11-28/bench_precision.json", "h200-2026-11-28/bench_attention.json"):
    restated(path)


def training_floor():
    """The training phase at the 1.5B shape against its FLOP floor at the chosen precisions (the
    target registered in docs/benchmarks.md): two no-grad passes in bf16x6 (each linear layer six bf16
    products at the bf16 peak, attention in fp32 at the fp32 peak), the gradient pass in bf16 at the
    bf16 peak (model FLOPs: activation checkpointing's recomputation not counted), over the pairs the
    mask allows; the times of the 2026-11-28 runs (AdamW's step from 2026-11-27)."""
    flags = json.loads((HERE / "h200-2026-11-28/bench_attention.json").read_text())["flags"]
    args = argparse.Namespace(**flags)
    model = bench_train.build("1.5B", "meta")
    rows, config = args.prompts * args.group_size, model.config
    bf16_peak, fp32_peak = 989e12, 67e12  # H200 SXM, dense (NVIDIA's datasheet)
    attention = (rows // args.group_size) * 4 * bench_train.attention_pairs(args)[0] \
        * config.hidden_size * config.num_hidden_layers
    forward = bench_train.pass_flops(model, args, rows, False)
    nograd_floor = 6 * (forward - attention) / bf16_peak + attention / fp32_peak
    gradient_floor = 3 * forward / bf16_peak
    precision = json.loads((HERE / "h200-2026-11-28/bench_precision.json").read_text())
    nograd_s = precision["parts"]["precision/1.5B"]["bf16x6"]["s"]
    gradient_s = json.loads((HERE / "h200-2026-11-28/bench_attention.json").read_text())[
        "parts"]["attention/1.5B"]["block_mask"]["gradient_pass_s"]
    adamw_s = json.loads((HERE / "h200-2026-11-27/bench_train.json").read_text())[
        "parts"]["train/1.5B"]["update_checkpointing_True"]["optimizer_s"]
    floor, took = 2 * nograd_floor + gradient_floor, 2 * nograd_s + gradient_s + adamw_s
    print(f"training phase at 1.5B: floor {floor:.2f} s (no-grad passes {2 * nograd_floor:.2f} s, "
          f"{2 * nograd_floor / floor:.0%} of it; gradient pass {gradient_floor:.2f} s); took "
          f"{took:.2f} s (2 x {nograd_s:.2f} + {gradient_s:.2f} + {adamw_s:.2f}): {floor / took:.1%} "
          f"of the floor")


training_floor()
