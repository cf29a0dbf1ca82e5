"""Every figure docs/benchmarks.md and docs/precision.md quote from this slot, recomputed from its
raw files: `python docs/gpu-runs/h200-2026-11-28/figures.py`."""
import json
from pathlib import Path

HERE = Path(__file__).parent
BEFORE = HERE.parent / "h200-2026-11-27"
load = lambda name, folder=HERE: json.loads((folder / name).read_text())  # noqa: E731

print("== decode, ms a step (median of 3), HBM floor, share of the floor")
for name in ("decode_compiled.json", "decode_7b.json", "decode_7b_compiled.json"):
    report = load(name)
    print(f"{name}: read bandwidth {report['read_bandwidth_GBps']:.0f} GB/s")
    for row in report["step_ms"]:
        if row.get("status"):
            print(f"  {row['model']} {row['batch']} {row['sampler']}: {row['status']}")
            continue
        ms = row["ms"]
        print(f"  {row['model']} {row['batch']} {row['sampler']}: "
              + (f"{ms:.2f} ms (repeats {', '.join(f'{x:.2f}' for x in row['ms_repeats'])}), "
                 f"floor {row['floor_ms']:.2f} ms, {row['floor_fraction']:.1%}"
                 if ms else "not timed")
              + f", warm-up {row['warmup_s']:.1f} s")
    steps = {row["sampler"]: row.get("ms") for row in report["step_ms"]}
    if steps.get("hf eager") and steps.get("ours graphed"):
        print(f"  hf eager / ours graphed: {steps['hf eager'] / steps['ours graphed']:.2f}x; "
              f"ours eager / ours graphed: {steps['ours eager'] / steps['ours graphed']:.2f}x")
    if report["syncs"]:
        print(f"  syncs: {report['syncs']}")

print("\n== the 7B step's kernels (graphed, batch 256), by kind, ms a step")
for profile in load("decode_7b.json")["profile"]:
    kinds = {}
    for kernel in profile["kernels"]:
        name, calls = kernel["kernel"], kernel["calls_per_step"]
        kind = ("GEMM" if "nvjet" in name or "cublas" in name or "gemm" in name.lower() else
                "attention" if "sdpa" in name or "fmha" in name or "flash" in name else
                "once a step (output layer's copy, sampling)" if calls < 28 else
                "elementwise and reductions, per layer")
        if kind == "GEMM" and calls < 28:
            kind = "GEMM, once a step (the output layer)"
        kinds[kind] = kinds.get(kind, 0) + kernel["ms_per_step"]
    print(f"  {profile['sampler']}: {profile['step_ms']:.2f} ms of kernels, "
          f"{profile['kernels_per_step']:.0f} kernels a step")
    for kind, ms in sorted(kinds.items(), key=lambda item: -item[1]):
        print(f"    {ms:6.2f} ms  {kind}")

profile = load("decode_7b.json")["profile"][0]
graphed = next(row for row in load("decode_7b.json")["step_ms"] if row["sampler"] == "ours graphed")
gemm = sum(k["ms_per_step"] for k in profile["kernels"] if "nvjet" in k["kernel"] or "cublas" in k["kernel"])
compute_floor = 2 * 7.07e9 * 256 / 989e12 * 1e3
print(f"  kernels / step: {profile['step_ms'] / graphed['ms']:.1%}; GEMMs {gemm:.2f} ms = "
      f"{gemm / graphed['floor_ms']:.2f}x the HBM floor, {gemm / compute_floor:.2f}x the compute floor "
      f"{compute_floor:.2f} ms ({compute_floor / gemm:.0%} of peak); the rest {profile['step_ms'] - gemm:.2f}"
      f" ms; 50% of the floor = {2 * graphed['floor_ms']:.2f} ms, leaving "
      f"{2 * graphed['floor_ms'] - gemm:.2f} ms beside the GEMMs")
print(f"  span at steps 16-96 of 128-token prompts: 256 slots; live {128 + (16 + 96) / 2:.0f} on average")


def kernel(part, calls):
    """The profile's one kernel whose name holds `part`, run `calls` times a step."""
    found = [k for k in profile["kernels"]
             if part in k["kernel"] and round(k["calls_per_step"]) == calls]
    assert len(found) == 1, (part, calls)
    return found[0]["ms_per_step"]


# Hugging Face's RMSNorm (57 a step: 2 a layer and the final one): the upcast, pow, mean, add,
# rsqrt, product and cast back (a kernel run 60 or 59 times a step shared by its calls), then the
# weight's product, one of the 169 bf16 products (the rest: rope's 112); rope: cat, neg, 2
# products, 1 sum each on q and k (half of the 112 bf16 sums; the others are the residuals)
seven = sum(kernel(part, calls) * 57 / calls for part, calls in (
    ("direct_copy_kernel_cuda", 60), ("pow_tensor_scalar", 57), ("MeanOps", 57),
    ("CUDAFunctorOnSelf_add<float>", 57), ("rsqrt_kernel", 57), ("MulFunctor<float> >", 57),
    ("bfloat16_copy_kernel", 59)))
products = kernel("gpu_kernel_impl_nocast<at::native::BinaryFunctor<c10::BFloat16", 169)
rope = (kernel("CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<2u>", 56)
        + kernel("neg_kernel", 56) + products * 112 / 169
        + kernel("CUDAFunctor_add<c10::BFloat16>", 112) / 2)
print(f"  RMSNorm: {seven + products * 57 / 169:.2f} ms a step ({seven:.2f} in its seven kernels, "
      f"the mean {kernel('MeanOps', 57):.2f}); rope {rope:.2f} ms")

print("\n== the no-grad pass at the 1.5B shape: fp32 against bf16x6 (the rule's speed half)")
part = load("bench_precision.json")["parts"]["precision/1.5B"]
fp32, six = part["float32"], part["bf16x6"]
print(f"  fp32 {fp32['s']:.2f} s ({fp32['tokens_per_s']:.0f} tok/s, MFU {fp32['mfu']:.1%}, "
      f"peak {fp32['peak_bytes'] / 1e9:.2f} GB); bf16x6 {six['s']:.2f} s "
      f"({six['tokens_per_s']:.0f} tok/s, MFU {six['mfu']:.1%}, peak {six['peak_bytes'] / 1e9:.2f} GB)")
print(f"  bf16x6 / fp32 = {six['s'] / fp32['s']:.3f} (registered: 0.5 to 0.85, centre 0.67); "
      f"peak + {(six['peak_bytes'] - fp32['peak_bytes']) / 1e9:.2f} GB")
old = load("bench_precision.json", BEFORE)["parts"]["precision/1.5B"]["float32"]["s"]
print(f"  fp32 then (2026-11-27, 122,624 positions): {old:.2f} s; now / then = {fp32['s'] / old:.3f}"
      f" (positions 84,480 / 122,624 = {84480 / 122624:.3f})")

print("\n== the rule's floor half: sequence K1, K3 against float64")
for name in ("kl_floor.json", "kl_floor_bf16grid.json"):
    rows = load(name)["rows"]
    truth = rows["float64 (the truth)"]
    print(f"  {name}: truth K1 {truth['k1']:.4f}, K3 {truth['k3']:.3g}")
    for option, row in rows.items():
        print(f"    {option:40s} K1 {row['k1'] / truth['k1'] - 1:+9.2%}   "
              f"K3 {row['k3'] / truth['k3'] - 1:+12.2%}")

print("\n== attention by segments against the block mask, 1.5B shape, checkpointing on")
attention = load("bench_attention.json")["parts"]["attention/1.5B"]
block, seg = attention["block_mask"], attention["segments"]
for key in ("nograd_s", "gradient_pass_s"):
    print(f"  {key}: block mask {block[key]:.2f} s, segments {seg[key]:.2f} s, "
          f"segments / block = {seg[key] / block[key]:.3f}")
print(f"  by segments, bf16x6: {seg['nograd_bf16x6_s']:.2f} s = "
      f"{seg['nograd_bf16x6_s'] / block['nograd_s']:.3f} of the block mask's fp32 pass, "
      f"{seg['nograd_bf16x6_s'] / six['s']:.3f} of the block mask's bf16x6 pass (precision part)")
print(f"  peaks: no-grad {block['nograd_peak_bytes'] / 1e9:.2f} / {seg['nograd_peak_bytes'] / 1e9:.2f}"
      f" GB, gradient {block['gradient_peak_bytes'] / 1e9:.2f} / "
      f"{seg['gradient_peak_bytes'] / 1e9:.2f} GB; ops {block['attention_ops_nograd']} / "
      f"{seg['attention_ops_nograd']}; largest |log-prob difference| "
      f"{attention['max_abs_logp_difference']:.1e}")
then = load("bench_train.json", BEFORE)["parts"]["train/1.5B"]
grad_then = then["update_checkpointing_True"]
mfu_now = grad_then["mfu"] * grad_then["gradient_pass_s"] / block["gradient_pass_s"]
print(f"  the gradient pass then: {grad_then['gradient_pass_s']:.2f} s, MFU {grad_then['mfu']:.1%}; now (same "
      f"FLOPs: pass_flops counts real tokens) {block['gradient_pass_s']:.2f} s, MFU {mfu_now:.1%}")

two = 2 * six["s"]
saved = 2 * (six["s"] - seg["nograd_bf16x6_s"])
print(f"  by segments in both no-grad passes: {saved:.2f} s saved of "
      f"{two + block['gradient_pass_s'] + 0.05:.2f} s = {saved / (two + block['gradient_pass_s'] + 0.05):.1%}")
print(f"  two bf16x6 passes against them + the gradient pass + AdamW's 0.05 s: "
      f"{two / (two + block['gradient_pass_s'] + 0.05):.1%}")

print("\n== memory_plan --measure (SmolLM2, 1 rank, CUDA), GB")
plan = load("memory_plan.json")
for phase, parts in plan["table"].items():
    planned, measured = sum(parts.values()), plan["measured"][phase]
    print(f"  {phase:15s} plan {planned / 1e9:.2f}, measured {measured / 1e9:.2f}, "
          f"+{(measured - planned) / 1e9:.2f} ({measured / planned - 1:+.1%})")

print("\n== derived since (2026-11-28, second session; docs/gpu.md, docs/benchmarks.md, rollout.py)")
MiB = 2**20
workspace = 33 * MiB  # 32 MiB cuBLAS on sm90 + 1 MiB cuBLASLt (lab/memory_plan.CUBLAS_WORKSPACE)
offsets = [plan["measured"][phase] - sum(parts.values()) for phase, parts in plan["table"].items()]
print(f"  offsets {min(offsets) / 1e9:.3f} to {max(offsets) / 1e9:.3f} GB; 13 workspaces "
      f"{13 * workspace / 1e9:.2f} GB, 32 side streams {32 * workspace / 1e9:.2f} GB, "
      f"3 kept {3 * workspace / 1e9:.2f} GB")
bandwidth = load("decode_7b.json")["read_bandwidth_GBps"] * 1e9
kernels = {k["kernel"]: k for k in profile["kernels"]}
for label, prefix, rows in (("k_proj and v_proj", "nvjet_sm90_tst_64x24", 512),
                            ("q_proj", "nvjet_sm90_tst_112x64", 3584),
                            ("o_proj", "nvjet_sm90_tst_128x64", 3584)):
    kernel = next(k for name, k in kernels.items() if name.startswith(prefix))
    seconds = kernel["ms_per_step"] / kernel["calls_per_step"] / 1e3
    weight = rows * 3584 * 2
    print(f"  {label}: {kernel['calls_per_step']:.0f} calls, {kernel['ms_per_step']:.3f} ms, "
          f"{seconds * 1e6:.2f} us a call, {weight / 1e6:.2f} MB at {weight / seconds / 1e12:.2f} TB/s "
          f"= {weight / seconds / bandwidth:.1%} of {bandwidth / 1e12:.2f} TB/s")
once = [k for k in profile["kernels"] if k["calls_per_step"] < 28
        and not ("nvjet" in k["kernel"] or "cublas" in k["kernel"])]
float64 = sum(k["ms_per_step"] for k in once if "scan" in k["kernel"]
              or ("direct_copy" in k["kernel"] and "(double)" in k["kernel"]))
divide = sum(k["ms_per_step"] for k in once if "BUnaryFunctor<float, float, float" in k["kernel"])
print(f"  once a step: {sum(k['ms_per_step'] for k in once):.2f} ms; the float64 copy and scan "
      f"{float64:.2f} ms; the division by the temperature {divide:.3f} ms")
