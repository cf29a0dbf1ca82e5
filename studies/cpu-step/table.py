"""docs/benchmarks.md's tables of the default CPU step (issue 62), from this folder's JSON files:
`python studies/cpu-step/table.py` prints them (markdown)."""
import json
import statistics
from pathlib import Path

HERE = Path(__file__).parent
PROFILES = {"6f36863 (two policy passes, --recompute full)": "profile_6f36863.json",
            "857d9d6 (one policy pass, --recompute none)": "profile_857d9d6.json",
            "0d07eab (and the prompts' common prefix once)": "profile_0d07eab.json",
            "673e1c0 (the sampler's prefix once, trim once a step; machine B)":
                "profile_673e1c0.json",
            "e92925c (and huge pages; machine C)": "profile_e92925c_machine_c.json"}
ROWS = [("sampling: prefill", ["sampling: prefill"]),
        ("sampling: decode forward", ["sampling: decode forward"]),
        ("sampling: the rest", ["sampling: decode sampling", "sampling: other"]),
        ("log-probs: the policy's no-grad pass", ["log-probs: policy, no grad"]),
        ("log-probs: the reference's no-grad pass", ["log-probs: reference, no grad"]),
        ("the gradient pass's forward", ["update: gradient pass forward"]),
        ("its backward", ["update: backward"]),
        ("clip and AdamW", ["update: clip + AdamW"]),
        ("reward, shape, advantage, the rest", ["reward, shape, advantage, other",
                                                "update: refresh sampler"]),
        ("**the step**", ["step"])]


def markdown(header, rows):
    """Print a markdown table: its header's cells, a separator, each row's cells."""
    print("| " + " | ".join(header) + " |")
    print("|---" * len(header) + "|")
    for cells in rows:
        print("| " + " | ".join(cells) + " |")


def profiles():
    means = {name: json.loads((HERE / file).read_text())["mean_after_first"]
             for name, file in PROFILES.items()}
    rows = []
    for label, keys in ROWS:
        cells = []
        for mean in means.values():
            present = [k for k in keys if k in mean]
            cells.append(f"{sum(mean[k] for k in present):.2f}" if present else "-")
        rows.append([label, *cells])
    markdown(["phase (s a step, mean of steps 2-4)", *means], rows)


def step_parts(run):
    return (f"{run['median_step_s']:.1f} ({run['median_sample_s']:.1f} + "
            f"{run['median_train_s']:.1f})")


def pairs(file):
    result = json.loads((HERE / file).read_text())
    print()
    markdown(["pair", f"{result['ours']}: median step (sample + train), s", result["against"],
              "ratio", "peak resident, GB (ours, against)"],
             [[str(i), step_parts(pair["ours"]), step_parts(pair["against"]),
               f"{pair['ratio']:.3f}",
               f"{pair['ours']['peak_rss_gb']:.2f}, {pair['against']['peak_rss_gb']:.2f}"]
              for i, pair in enumerate(result["pairs"], 1)])
    ratios = [pair["ratio"] for pair in result["pairs"]]
    trains = [p["ours"]["median_train_s"] / p["against"]["median_train_s"] for p in result["pairs"]]
    samples = [p["ours"]["median_sample_s"] / p["against"]["median_sample_s"]
               for p in result["pairs"]]
    print(f"\nthe step: median of the pairs' ratios {statistics.median(ratios):.3f} "
          f"(pairs {min(ratios):.3f}-{max(ratios):.3f}); the training part alone "
          f"{statistics.median(trains):.3f} ({min(trains):.3f}-{max(trains):.3f}); the sampling "
          f"part alone {statistics.median(samples):.3f} ({min(samples):.3f}-{max(samples):.3f})")


def against_trl(file):
    result = json.loads((HERE / file).read_text())
    print()
    version = result["pairs"][0]["trl"]["trl"]
    rows = []
    for i, pair in enumerate(result["pairs"], 1):
        ours, trl = pair["ours"], pair["trl"]
        lengths = [f"{statistics.mean(run['response_len']):.1f}" for run in (ours, trl)]
        rows.append([str(i), f"{ours['median_step_s']:.1f}", f"{trl['median_step_s']:.1f}",
                     f"{pair['speedup']:.2f}x",
                     f"{ours['peak_rss_gb']:.2f}, {trl['peak_rss_gb']:.2f}", ", ".join(lengths)])
    markdown(["pair", f"{result['ours']}: median step, s", f"TRL {version}", "ours faster by",
              "peak resident, GB (ours, TRL)", "mean response tokens (ours, TRL)"], rows)
    low, high = result["speedup_range"]
    print(f"\nmedian of the pairs' speedups {result['speedup_median']:.2f}x "
          f"(pairs {low:.2f}-{high:.2f})")


def floor(file):
    """The step against its restated floor: each phase's FLOPs at the measured GEMM rate."""
    import sys
    sys.path.insert(0, str(HERE.parents[1]))
    from lab.profile_step import floor_table

    result = json.loads((HERE / file).read_text())
    print()
    markdown(["phase (a step, mean of steps 2-4)", "GFLOP", "floor, s", "measured, s",
              "share of the floor"],
             [[phase, f"{row['gflop']:.1f}", f"{row['floor_s']:.2f}", f"{row['seconds']:.2f}",
               f"{row['share']:.3f}"] for phase, row in floor_table(result).items()])
    print(f"\nGEMM rate {result['gemm_flops_per_s'] / 1e9:.1f} GFLOP/s ({result['gemm_dtype']}); "
          f"the same samples in both runs: {result['same_samples']}")


def kernels(file, llamacpp_file):
    """The step against its floor and against its own kernels run alone (profile_step --kernels),
    and decode's kernels a step against llama.cpp's F32 decode step (bench_llamacpp)."""
    import sys
    sys.path.insert(0, str(HERE.parents[1]))
    from lab.profile_step import FLOP_PHASES, floor_table

    result = json.loads((HERE / file).read_text())
    table = floor_table(result)
    print()
    markdown(["phase (a step, mean of steps 2-4)", "GFLOP", "floor, s", "measured, s",
              "kernels alone, s", "share of the floor: measured", "kernels alone"],
             [[phase, f"{row['gflop']:.1f}", f"{row['floor_s']:.2f}", f"{row['seconds']:.2f}",
               f"{row['kernels_s']:.2f}", f"{row['share']:.3f}", f"{row['kernels_share']:.3f}"]
              for phase, row in table.items()])
    rate = result["gemm_flops_per_s"]
    # each replayed step (the steps after the first) against its own FLOPs
    each = [sum(step_flops.get(phase, 0.0) for phase in FLOP_PHASES) / rate
            / sum(sum(by_op.values()) for by_op in step.values())
            for step, step_flops in zip(result["kernels_per_step"], result["flops_per_step"][1:])]
    print(f"\nGEMM rate {rate / 1e9:.1f} GFLOP/s, the fastest of "
          f"{', '.join(f'{r / 1e9:.1f}' for r in [*result['gemm_rates']])} (around the replays) "
          f"and the counting run's; the replay counts the run's FLOPs: {result['replay_counted']}; "
          f"the step's kernels' share, step by step: {', '.join(f'{x:.3f}' for x in each)}")
    decode = "sampling: decode forward"
    steps = result["mean_calls_after_first"][decode]
    by_op = result["mean_kernels_by_op"][decode]
    gemm = sum(seconds for op, seconds in by_op.items() if "attention" not in op)
    attention = sum(seconds for op, seconds in by_op.items() if "attention" in op)
    llamacpp = json.loads((HERE / llamacpp_file).read_text())
    theirs = llamacpp["rows"] / llamacpp["runs"]["llama.cpp F32"]["decode_tokens_per_s"]
    ours = llamacpp["rows"] / llamacpp["runs"]["ours fp32"]["decode_tokens_per_s"]
    print(f"decode, a step ({steps:.1f} steps a training step): its GEMMs alone "
          f"{gemm / steps * 1e3:.1f} ms, its attention alone {attention / steps * 1e3:.1f} ms, "
          f"measured {table[decode]['seconds'] / steps * 1e3:.1f} ms; at bench_llamacpp's shape "
          f"ours {ours * 1e3:.1f} ms, llama.cpp F32 {theirs * 1e3:.1f} ms")


def twenty_steps():
    """The whole default run at two commits: minutes of steps, peak resident (GB, KiB * 1024 / 1e9
    as bench_step), the first step whose metrics differ."""
    peaks = json.loads((HERE / "twenty_steps_peaks.json").read_text())
    runs = {commit: [json.loads(line) for line in
                     (HERE / f"twenty_steps_{commit}.metrics.jsonl").read_text().splitlines()]
            for commit in ("6853a1d", "71a97a7")}
    print()
    markdown(["commit", "steps", "minutes of steps", "peak resident, GB", "mean reward"],
             [[commit, str(len(rows)),
               f"{sum(r['sample_s'] + r['train_s'] for r in rows) / 60:.2f}",
               f"{peaks[commit]['max_rss_kib'] * 1024 / 1e9:.2f}",
               f"{statistics.mean(r['reward'] for r in rows):.4f}"]
              for commit, rows in runs.items()])
    ours, theirs = runs.values()
    apart = [a["step"] for a, b in zip(ours, theirs) if a["kl_k1"] != b["kl_k1"]]
    same = all(a["reward"] == b["reward"] and a["response_len"] == b["response_len"]
               for a, b in zip(ours, theirs))
    ratio = peaks["6853a1d"]["max_rss_kib"] / peaks["71a97a7"]["max_rss_kib"]
    print(f"\npeak ratio {ratio:.4f}; rewards and lengths equal at every step: {same}; "
          f"kl_k1 first apart at step {apart[0] if apart else None}")
    rerun = [json.loads(line) for line in
             (HERE / "twenty_steps_8a93315_rerun.metrics.jsonl").read_text().splitlines()]
    apart = [a["step"] for a, b in zip(ours, rerun) if a["kl_k1"] != b["kl_k1"]]
    same = all(a["reward"] == b["reward"] for a, b in zip(ours, rerun))
    print(f"the same code run again (8a93315): rewards equal at every step: {same}; kl_k1 first "
          f"apart from 6853a1d's at step {apart[0] if apart else None}")


if __name__ == "__main__":
    profiles()
    pairs("bench_step_09486f1.json")
    pairs("bench_step_09486f1_673e1c0.json")
    against_trl("bench_trl_673e1c0.json")
    floor("floor_d5a4fa9.json")
    for file in ("bench_step_thp.json", "bench_step_own_memory.json",
                 "bench_step_response_rows.json", "bench_step_09486f1_bf562d8.json"):
        if (HERE / file).exists():  # machine C
            pairs(file)
    for file in ("bench_step_onednn.json", "bench_step_heap_kept.json",
                 "bench_step_09486f1_heap_kept.json"):
        if (HERE / file).exists():  # machine A
            pairs(file)
    if (HERE / "twenty_steps_peaks.json").exists():  # machine A
        twenty_steps()
    for file in ("bench_step_prefix_attention.json", "bench_step_freed_kept.json",
                 "bench_step_09486f1_freed_kept.json"):
        if (HERE / file).exists():  # machine A, 2026-12-03 (third session)
            pairs(file)
    if (HERE / "floor_2d531f1_b.json").exists():  # machine B, 2026-12-03 (fourth session)
        floor("floor_2d531f1_b.json")
        pairs("bench_step_09486f1_b.json")
        against_trl("bench_trl_2d531f1_b.json")
    if (HERE / "kernels_b.json").exists():  # machine B, 2026-12-04 (fifth session)
        kernels("kernels_b.json", "decode_llamacpp_avx2_kernels_b.json")
    if (HERE / "kernels_b_replays5.json").exists():  # the same, each replay the best of 5
        kernels("kernels_b_replays5.json", "decode_llamacpp_avx2_kernels_b.json")
