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

    python -m lab.profile_step --out /tmp/profile.json               # 4 steps of the default run
    python -m lab.profile_step --steps 3 -- --kl k3 --place loss     # another configuration
"""
import argparse
import collections
import functools
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

import logprobs
import rollout
import train
from systems import optim, runtime

TIMES = collections.defaultdict(float)  # phase -> seconds in the current step


def timed(module, name, phase_of):
    """Replace module.name by a wrapper adding its wall time to TIMES[phase_of(args)]; phase_of
    None: the time is not counted (a call inside another timed one)."""
    original = getattr(module, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        phase = phase_of(*args, **kwargs)
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            if phase:
                TIMES[phase] += time.perf_counter() - start
    setattr(module, name, wrapper)
    return original


def install(policy_ids):
    """Timers on every phase; policy_ids: the ids of the models that are the policy (else the
    reference), filled once train.main has made them."""
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="steps of the run (the first warms)")
    parser.add_argument("--out", default=None, help="write the figures here as JSON")
    parser.add_argument("train_args", nargs="*", help="train.py's flags after --")
    args = parser.parse_args(argv)
    train_args = args.train_args or ["--kl", "k1", "--place", "reward"]
    per_step = []
    policy_ids = set()
    install(policy_ids)
    # each step's TIMES: the loop's tqdm bar updates once a step; its postfix is set after the log
    step_end = train.checkpoint.log_row

    def log_row(path, row):
        step_end(path, row)
        per_step.append({"step": row["step"], "sample_s": row["sample_s"],
                         "train_s": row["train_s"], **TIMES,
                         "response_len": row["response_len"]})
        TIMES.clear()
    train.checkpoint.log_row = log_row
    with tempfile.TemporaryDirectory() as out:
        wall = time.perf_counter()
        train.main(train_args + ["--steps", str(args.steps), "--out", str(Path(out) / "run")])
        wall = time.perf_counter() - wall
    summary = summarize(per_step[1:] or per_step)
    result = {"argv": train_args, "steps": args.steps, "threads": torch.get_num_threads(),
              "machine": platform.processor() or platform.machine(), "wall_s": wall,
              "per_step": per_step, "mean_after_first": summary}
    for phase, seconds in summary.items():
        print(f"{phase:36s} {seconds:8.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


def summarize(steps):
    """Each phase's mean seconds a step, with the step's total and what no timer covered."""
    phases = sorted({k for step in steps for k in step} - {"step", "response_len"})
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
