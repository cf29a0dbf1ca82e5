"""Where the default step's seconds go on this machine (issue 62, item 1): train.py's own run, its
functions timed where they are called.

Runs `train.main(ARGS)` (by default the README's run, `--kl k1 --place reward`, a few steps) with
timers around the functions each phase of a step calls, and prints a phase's seconds a step
(the mean over the steps after the first, which warms up), with the step's own sample_s and
train_s from its metrics.jsonl:
- sampling: prefill (rollout.cache_for_prompts), the decode steps' forward (rollout.decode) and
  their sampling (rollout.record_sample), the rest of rollout.generate
- reward: tokenizer.batch_decode and data.score (what is left of the step outside the others)
- the policy's no-grad log-prob pass, the reference's (logprobs.no_grad_logprobs, by model)
- the gradient pass's forward (logprobs.token_logprobs with grad), its backward (with --recompute
  full, every layer's forward again), the clip and AdamW step (optim.optimizer_step)
- other: the step's time outside every timed function
Nothing else changes: the run computes what train.py computes (its metrics land in --out).

`--flops` restates the step's floor (issue 62, item 1): a second run of the same command (the same
seed, so the same samples and shapes) counts each phase's matmul FLOPs as they run
(torch.utils.flop_counter.FlopCounterMode: GEMMs and attention, the masked part of attention
included; elementwise work left out; counting slows a run, so the times come from the first run);
a phase's floor is its FLOPs at this machine's GEMM rate (one 2048^3 GEMM in the run's dtype and
threads, the best of 5) and its share the floor over its measured seconds.

`--kernels` (with --flops) asks what this machine's kernels allow: the counting run also records
each phase's counted calls (their ops and their arguments' shapes, strides and dtypes), and each
step's calls are then run again alone, back to back, on random tensors of those layouts (one
buffer for each storage the run used, so a weight read by 30 steps is one tensor, read from memory
as in the run). A phase's kernels alone, with nothing between them, bound what the same kernels
allow: its floor over their seconds is the share of the floor it could reach with no other work in
the step (each replay the fastest of --replays, 2 unless given; the GEMM rate measured again
before and after each step's replay, the fastest of all used for every floor, since this machine's
speed drifts from minute to minute).

    python -m lab.profile_step --out /tmp/profile.json               # 4 steps of the default run
    python -m lab.profile_step --steps 3 -- --kl k3 --place loss     # another configuration
    python -m lab.profile_step --flops -- --kl k1 --place reward --dtype float32
    python -m lab.profile_step --flops --kernels --out /tmp/kernels.json
"""
import argparse
import collections
import contextlib
import dataclasses
import functools
import json
import platform
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

import logprobs
import rollout
import train
from systems import optim, runtime

TIMES = collections.defaultdict(float)  # phase -> seconds in the current step
FLOPS = collections.defaultdict(float)  # phase -> matmul FLOPs in the current step (--flops' run)
COUNTING = {"on": False, "kernels": False}  # --flops' second run: count FLOPs instead of timing
CALLS = collections.defaultdict(list)  # phase -> its counted kernels' calls this step (--kernels)
ENTRIES = collections.Counter()  # phase -> its function's calls this step (--kernels)
RECORDED = []  # --kernels: each step's (CALLS, ENTRIES)
# the CPU's fused attention kernels, which torch's flop counter has no formula for (it would count 0)
# (each formula is given the arguments' shapes)
ATTENTION_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
        lambda q, k, v, *args, out_shape=None, **kwargs: flop_counter.sdpa_flop_count(q, k, v),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda grad, q, k, v, *args, out_shape=None, **kwargs:
            flop_counter.sdpa_backward_flop_count(grad, q, k, v)}


def timed(module, name, phase_of):
    """Replace module.name by a wrapper adding its wall time to TIMES[phase_of(args)]; phase_of
    None: the time is not counted (a call inside another timed one)."""
    original = getattr(module, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        phase = phase_of(*args, **kwargs)
        if COUNTING["on"] and phase:
            recorder = contextlib.nullcontext()
            if COUNTING["kernels"] and phase in FLOP_PHASES:
                ENTRIES[phase] += 1
                recorder = KernelRecorder(CALLS[phase])
            with flop_counter.FlopCounterMode(display=False,
                                              custom_mapping=ATTENTION_FLOPS) as counter, recorder:
                result = original(*args, **kwargs)
            FLOPS[phase] += counter.get_total_flops()
            return result
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            if phase:
                TIMES[phase] += time.perf_counter() - start
    setattr(module, name, wrapper)
    return original


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A recorded tensor argument: its layout, and the storage it viewed (by address). A
    dataclass, not a namedtuple: tree_map_only must take it as one leaf, not a tuple to open."""
    shape: tuple
    stride: tuple
    offset: int
    dtype: torch.dtype
    storage: int

    @classmethod
    def of(cls, tensor):
        return cls(tuple(tensor.shape), tensor.stride(), tensor.storage_offset(), tensor.dtype,
                   tensor.untyped_storage().data_ptr())

    def elements(self):
        """The storage elements the view reaches, from the storage's start."""
        if 0 in self.shape:
            return self.offset
        reach = sum((size - 1) * step for size, step in zip(self.shape, self.stride))
        return self.offset + 1 + reach


# the ops the floor counts: torch's flop formulas' and the CPU's attention kernels
COUNTED_OPS = set(flop_counter.flop_registry) | set(ATTENTION_FLOPS)


class KernelRecorder(TorchDispatchMode):
    """Appends each counted op's call to `calls` as (op, args, kwargs), its tensors TensorSpecs."""

    def __init__(self, calls):
        super().__init__()
        self.calls = calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in COUNTED_OPS:
            self.calls.append((func, *tree_map_only(torch.Tensor, TensorSpec.of, (args, kwargs))))
        return func(*args, **kwargs)


def replayable(calls):
    """The recorded calls on random tensors of their layouts: one buffer for each (storage,
    dtype) the calls read, so calls that shared a tensor (a layer's weight, the KV cache) share
    one here."""
    specs = [spec for call in calls for spec in tensor_specs(call)]
    sizes = collections.defaultdict(int)
    for spec in specs:
        sizes[spec.storage, spec.dtype] = max(sizes[spec.storage, spec.dtype], spec.elements())
    buffers = {(storage, dtype): (torch.randn(size, dtype=dtype) if dtype.is_floating_point
                                  else torch.zeros(size, dtype=dtype))
               for (storage, dtype), size in sizes.items()}

    def view(spec):
        return buffers[spec.storage, spec.dtype].as_strided(spec.shape, spec.stride, spec.offset)
    return [(func, *tree_map_only(TensorSpec, view, (args, kwargs)))
            for func, args, kwargs in calls]


def tensor_specs(call):
    """A recorded call's TensorSpecs, in argument order."""
    found = []
    tree_map_only(TensorSpec, found.append, call[1:])
    return found


@torch.no_grad()
def replay_seconds(calls, repeats=2):
    """Wall seconds of the recorded calls run back to back (replayable's tensors, made first), by
    op ({op name: seconds}), the fastest of `repeats` runs: the first reads from memory inputs the
    step had just written into cache, and pays the kernels' first calls."""
    ready, runs = replayable(calls), []
    for _ in range(repeats):
        seconds = collections.defaultdict(float)
        for func, args, kwargs in ready:
            start = time.perf_counter()
            func(*args, **kwargs)
            seconds[func.overloadpacket.__name__] += time.perf_counter() - start
        runs.append(dict(seconds))
    return min(runs, key=lambda by_op: sum(by_op.values()))


def install(policy_ids, dtypes):
    """Timers on every phase; policy_ids: the ids of the models that are the policy (else the
    reference), filled once train.main has made them; dtypes: the policy's compute dtype."""
    timed(rollout, "generate", lambda *a, **k: "sampling: total")
    timed(rollout, "cache_for_prompts", lambda *a, **k: "sampling: prefill")
    timed(rollout, "decode", lambda *a, **k: "sampling: decode forward")
    timed(rollout, "record_sample", lambda *a, **k: "sampling: decode sampling")
    timed(logprobs, "no_grad_logprobs", lambda model, *a, **k: (
        "log-probs: policy, no grad" if id(model) in policy_ids else
        "log-probs: reference, no grad"))
    timed(logprobs, "token_logprobs", lambda *a, **k: (
        "update: gradient pass forward" if torch.is_grad_enabled() else None))
    timed(optim, "backward_over_ranks", lambda *a, **k: "update: backward")
    timed(optim, "optimizer_step", lambda *a, **k: "update: clip + AdamW")
    timed(runtime, "refresh_sampler", lambda *a, **k: "update: refresh sampler")
    wrap = runtime.wrap

    def wrap_and_note(model, *args, **kwargs):
        wrapped = wrap(model, *args, **kwargs)
        policy_ids.update({id(model), id(wrapped)})
        return wrapped
    runtime.wrap = wrap_and_note
    start = runtime.start

    def start_and_note(*args, **kwargs):
        started = start(*args, **kwargs)
        dtypes.add(started[3])  # (rank, world_size, device, dtype)
        return started
    runtime.start = start_and_note


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="steps of the run (the first warms)")
    parser.add_argument("--out", default=None, help="write the figures here as JSON")
    parser.add_argument("--flops", action="store_true",
                        help="a second run counts each phase's FLOPs: the floor and its share")
    parser.add_argument("--kernels", action="store_true",
                        help="with --flops: each phase's counted kernels run again alone, timed")
    parser.add_argument("--replays", type=int, default=2,
                        help="--kernels: each replay timed this many times, the fastest kept")
    parser.add_argument("train_args", nargs="*", help="train.py's flags after --")
    args = parser.parse_args(argv)
    train_args = args.train_args or ["--kl", "k1", "--place", "reward"]
    policy_ids, dtypes = set(), set()
    install(policy_ids, dtypes)
    wall = time.perf_counter()
    per_step = run(train_args, args.steps, TIMES)
    wall = time.perf_counter() - wall
    summary = summarize(per_step[1:] or per_step)
    result = {"argv": train_args, "steps": args.steps, "threads": torch.get_num_threads(),
              "machine": platform.processor() or platform.machine(), "wall_s": wall,
              "per_step": per_step, "mean_after_first": summary}
    for phase, seconds in summary.items():
        print(f"{phase:36s} {seconds:8.2f}")
    if args.flops:
        COUNTING.update(on=True, kernels=args.kernels)
        flop_steps = run(train_args, args.steps, FLOPS)
        (dtype,) = dtypes
        result.update(flops_per_step=flop_steps, gemm_dtype=str(dtype),
                      gemm_flops_per_s=gemm_rate(dtype), **floors(per_step, flop_steps))
        if args.kernels:  # the rate measured again around each step's replay: the fastest is used
            result.update(kernels_alone(RECORDED, flop_steps, dtype, args.replays),
                          replays=args.replays)
            result["gemm_flops_per_s"] = max(result["gemm_rates"] + [result["gemm_flops_per_s"]])
            print(f"the replayed kernels' FLOPs equal the count's: {result['replay_counted']}")
        print(f"GEMM rate {result['gemm_flops_per_s'] / 1e9:.1f} GFLOP/s ({dtype}); same "
              f"samples in both runs: {result['same_samples']}")
        for phase, row in floor_table(result).items():
            print(f"{phase:36s} {row['gflop']:8.1f} GFLOP  floor {row['floor_s']:6.2f} s  "
                  f"measured {row['seconds']:6.2f} s  share {row['share']:.3f}"
                  + (f"  kernels alone {row['kernels_s']:6.2f} s  their share "
                     f"{row['kernels_share']:.3f}" if "kernels_s" in row else ""))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


def run(train_args, steps, counts):
    """train.main(train_args) for `steps` steps; each step's `counts` (TIMES or FLOPS) and its
    metrics, a dict a step."""
    per_step = []
    # each step's counts: the metrics row is logged once a step, after its last phase
    step_end = train.checkpoint.log_row

    def log_row(path, row):
        step_end(path, row)
        per_step.append({"step": row["step"], "sample_s": row["sample_s"],
                         "train_s": row["train_s"], **counts,
                         "response_len": row["response_len"], "kl_k1": row.get("kl_k1")})
        if COUNTING["kernels"]:
            RECORDED.append((dict(CALLS), dict(ENTRIES)))
        TIMES.clear()
        FLOPS.clear()
        CALLS.clear()
        ENTRIES.clear()
    train.checkpoint.log_row = log_row
    try:
        with tempfile.TemporaryDirectory() as out:
            train.main(train_args + ["--steps", str(steps), "--out", str(Path(out) / "run")])
    finally:
        train.checkpoint.log_row = step_end
    return per_step


def gemm_rate(dtype, size=2048, repeats=5):
    """FLOP/s of one size^3 GEMM in `dtype` with this process's threads, the best of `repeats`."""
    a, b = (torch.randn(size, size).to(dtype) for _ in range(2))
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / best


def floors(time_steps, flop_steps):
    """Each phase's mean FLOPs a step over the steps after the first (as the times), and whether
    the two runs drew the same samples: the same mean response length at every step, and kl_k1
    equal to float rounding (1e-4 of itself: two runs of one command on a CPU need not sum in the
    same order; measured up to 8e-6 apart)."""
    steps = flop_steps[1:] or flop_steps
    same = all(a["response_len"] == b["response_len"]
               and abs(a["kl_k1"] - b["kl_k1"]) <= 1e-4 * abs(a["kl_k1"]) + 1e-9
               for a, b in zip(time_steps, flop_steps))
    return {"same_samples": same,
            "mean_flops_after_first": {phase: sum(step.get(phase, 0.0) for step in steps)
                                       / len(steps) for phase in FLOP_PHASES}}


FLOP_PHASES = ("sampling: prefill", "sampling: decode forward", "sampling: decode sampling",
               "log-probs: policy, no grad", "log-probs: reference, no grad",
               "update: gradient pass forward", "update: backward", "update: refresh sampler")


def kernels_alone(recorded, flop_steps, dtype, replays=2):
    """Each step's phases' recorded kernels replayed alone (the steps after the first, as the
    times): their mean seconds a step, by op, and the phases' calls a step (rollout.decode's: the
    decode steps); the GEMM rate before and after each step's replay (this machine's speed
    drifts); and whether the last step's replay counts the FLOPs its run counted (no counted call
    missed by the recorder). Each replay the fastest of `replays`."""
    recorded = recorded[1:] or recorded
    steps, rates = [], []
    for step, _ in recorded:
        rates.append(gemm_rate(dtype))
        steps.append({phase: replay_seconds(calls, replays) for phase, calls in step.items()})
        rates.append(gemm_rate(dtype))
    replayed = {}
    for phase, calls in recorded[-1][0].items():
        with flop_counter.FlopCounterMode(display=False, custom_mapping=ATTENTION_FLOPS) as counter:
            replay_seconds(calls, repeats=1)
        replayed[phase] = counter.get_total_flops()
    ops = sorted({op for step in steps for by_op in step.values() for op in by_op})

    def mean(values):
        return sum(values) / len(recorded)
    return {"kernels_per_step": steps, "gemm_rates": rates,
            "mean_kernels_after_first": {phase: mean(sum(step.get(phase, {}).values())
                                                     for step in steps) for phase in FLOP_PHASES},
            "mean_kernels_by_op": {phase: {op: mean(step.get(phase, {}).get(op, 0.0)
                                                    for step in steps) for op in ops}
                                   for phase in FLOP_PHASES},
            "mean_calls_after_first": {phase: mean(entries.get(phase, 0) for _, entries in recorded)
                                       for phase in FLOP_PHASES},
            "replay_counted": all(replayed.get(phase, 0) == flop_steps[-1].get(phase, 0)
                                  for phase in FLOP_PHASES)}


def floor_table(result):
    """{phase: gflop, floor_s, seconds, share} for each phase that runs FLOPs, and the step's (its
    phases' FLOPs summed, against the whole step's seconds)."""
    flops, seconds = result["mean_flops_after_first"], result["mean_after_first"]
    rate = result["gemm_flops_per_s"]
    rows = {phase: (flops[phase], seconds.get(phase, float("nan"))) for phase in FLOP_PHASES
            if flops.get(phase)}
    rows["step"] = (sum(f for f, _ in rows.values()), seconds["step"])
    table = {phase: {"gflop": f / 1e9, "floor_s": f / rate, "seconds": s, "share": f / rate / s}
             for phase, (f, s) in rows.items()}
    kernels = result.get("mean_kernels_after_first")
    if kernels:  # --kernels: the phases' kernels alone, and the share of the floor they reach
        kernels = {**kernels, "step": sum(kernels[phase] for phase in rows if phase != "step")}
        for phase, row in table.items():
            row.update(kernels_s=kernels[phase], kernels_share=row["floor_s"] / kernels[phase])
    return table


def summarize(steps):
    """Each phase's mean seconds a step, with the step's total and what no timer covered."""
    phases = sorted({k for step in steps for k in step} - {"step", "response_len", "kl_k1"})
    mean = {k: sum(step.get(k, 0.0) for step in steps) / len(steps) for k in phases}
    total = mean["sample_s"] + mean["train_s"]
    sampling = mean.get("sampling: total", 0.0)
    parts = [k for k in phases if k.startswith(("log-probs", "update"))]
    mean["sampling: other"] = sampling - sum(mean.get(k, 0.0) for k in (
        "sampling: prefill", "sampling: decode forward", "sampling: decode sampling"))
    mean["reward, shape, advantage, other"] = total - sampling - sum(mean[k] for k in parts)
    mean["step"] = total
    mean["response_len"] = sum(step["response_len"] for step in steps) / len(steps)
    return mean


if __name__ == "__main__":
    main()
