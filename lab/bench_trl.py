"""Our step against TRL's GRPOTrainer on the same job, alternated on one machine (issue 62, item 5):
SmolLM2-135M-Instruct on arith, 8 prompts x 4 samples a step, at most 40 new tokens, temperature 1,
K3 in the loss at beta 0.05 (TRL: `beta=0.05, use_bias_correction_kl=False`; ours: `--kl k3
--place loss`), the PPO clip at 0.2, one update a batch, lr 1e-5, gradient norm clipped to 1, fp32,
the same prompts in the same order (our train.py's stream, seed 0).

Each run is a fresh process: ours is `python train.py --kl k3 --place loss --steps N`; TRL's is this
file's `--worker`, run by `--python` (an environment with TRL installed: TRL is this benchmark's
dependency only, `pip install trl`). A pair is one run of each, ours first. Per run: each step's
seconds (ours: sample_s + train_s of metrics.jsonl; TRL: a callback's wall time from step begin to
step end, its generation inside), the median over the steps after the first, and the peak resident
memory (os.wait4's ru_maxrss). What is TRL's own and left at its defaults: its sampler
(`model.generate`), its gradient checkpointing (GRPOConfig's default), the reference model a second
copy, micro-batches of 8 completions (`per_device_train_batch_size=8`, 4 accumulation steps: one
generation of 32 a step, as our --micro-batch 8), its advantage (`scale_rewards="none"`: r minus the
group's mean; ours RLOO's leave-one-out mean, the same FLOPs) and `loss_type="dapo"` (ours: the
batch's tokens, sec. 4.1).

    python -m lab.bench_trl --python /path/to/trl-venv/bin/python --pairs 2 --steps 5 --out trl.json
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lab.bench_step import peak_rss_gb

ROOT = Path(__file__).resolve().parents[1]
JOB = dict(prompts_per_step=8, group_size=4, max_new_tokens=40, beta=0.05, lr=1e-5, clip_eps=0.2,
           max_grad_norm=1.0, seed=0)


def run(command, log):
    """Run `command` from the repository's root; (its exit code, peak resident memory, GB)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    with open(log, "w") as stderr:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=stderr, stderr=stderr)
        _, status, usage = os.wait4(process.pid, 0)  # reaped here: its own rusage
    code = os.waitstatus_to_exitcode(status)
    if code:
        sys.exit(f"bench_trl: {command[1:3]} failed: {Path(log).read_text().strip()[-600:]}")
    return peak_rss_gb(usage)


def summary(step_s, peak_gb):
    later = step_s[1:] or step_s  # the first step warms up
    return {"step_s": step_s, "median_step_s": statistics.median(later), "peak_rss_gb": peak_gb}


def ours(steps, out):
    """train.py on the job: its metrics' seconds a step and its peak."""
    flags = ["--kl", "k3", "--place", "loss", "--beta", str(JOB["beta"]), "--lr", str(JOB["lr"]),
             "--clip-eps", str(JOB["clip_eps"]), "--max-grad-norm", str(JOB["max_grad_norm"]),
             "--prompts-per-step", str(JOB["prompts_per_step"]),
             "--group-size", str(JOB["group_size"]),
             "--max-new-tokens", str(JOB["max_new_tokens"]), "--seed", str(JOB["seed"]),
             "--dtype", "float32"]  # TRL's side is fp32 too (--dtype auto: bf16 where native)
    peak = run([sys.executable, "train.py", *flags, "--steps", str(steps), "--out", str(out)],
               f"{out}.log.txt")
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {**summary([row["sample_s"] + row["train_s"] for row in rows], peak),
            "response_len": [row["response_len"] for row in rows]}


def trl(python, steps, out):
    """This file's --worker under `python`: TRL's seconds a step and its peak."""
    peak = run([python, "-m", "lab.bench_trl", "--worker", "--steps", str(steps), "--out",
                str(out)], f"{out}.log.txt")
    worker = json.loads(Path(out).read_text())
    return {**summary(worker["step_s"], peak), "trl": worker["trl"],
            "response_len": worker["response_len"]}


def worker(steps, out):
    """GRPOTrainer on the job for `steps` steps; writes each step's seconds to `out`."""
    import datasets
    import torch
    import trl
    from transformers import TrainerCallback

    import data
    from systems import model as models

    path = models.resolve("smollm2-135m")
    examples = data.load_task("arith", split="train", seed=JOB["seed"])
    # our stream's prompts, in its order (train.py: prompt_batch from position 0, one rank)
    problems = data.prompt_batch(examples, 0, JOB["prompts_per_step"] * steps, JOB["seed"])
    example_of = {example["messages"][-1]["content"]: example for example in problems}
    dataset = datasets.Dataset.from_list([{"prompt": example["messages"]}
                                          for example in problems])

    def reward(prompts, completions, **_):
        return [data.score(example_of[prompt[-1]["content"]], completion[0]["content"])
                for prompt, completion in zip(prompts, completions)]

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.step_s, self.start = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.step_s.append(time.perf_counter() - self.start)

    lengths = []

    class Lengths(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    with tempfile.TemporaryDirectory() as tmp:
        config = trl.GRPOConfig(
            output_dir=tmp, max_steps=steps, learning_rate=JOB["lr"],
            per_device_train_batch_size=8, gradient_accumulation_steps=4,
            num_generations=JOB["group_size"], max_completion_length=JOB["max_new_tokens"],
            temperature=1.0, top_p=1.0, beta=JOB["beta"], use_bias_correction_kl=False,
            epsilon=JOB["clip_eps"], num_iterations=1, loss_type="dapo", scale_rewards="none",
            max_grad_norm=JOB["max_grad_norm"], shuffle_dataset=False, bf16=False, fp16=False,
            use_cpu=True, model_init_kwargs={"dtype": "float32"}, logging_steps=1,
            report_to="none", save_strategy="no", seed=JOB["seed"])
        times = StepTimes()
        trainer = trl.GRPOTrainer(model=path, reward_funcs=reward, args=config,
                                  train_dataset=dataset, callbacks=[times, Lengths()])
        trainer.train()
    Path(out).write_text(json.dumps({"step_s": times.step_s, "trl": trl.__version__,
                                     "response_len": lengths}) + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable,
                        help="the interpreter of an environment with TRL (default: this one)")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="steps a run (the first warms up)")
    parser.add_argument("--out", default=None, help="write the figures here as JSON")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.steps, args.out)
    if subprocess.run([args.python, "-c", "import trl"], capture_output=True).returncode:
        sys.exit(f"bench_trl: {args.python} cannot import trl; pip install trl in an environment "
                 "of its own and pass its interpreter as --python")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.strip()
    result = {"job": JOB, "steps": args.steps, "machine": platform.processor(),
              "cpus": os.cpu_count(), "ours": commit, "pairs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            mine = ours(args.steps, Path(tmp) / f"ours-{pair}")
            theirs = trl(args.python, args.steps, Path(tmp) / f"trl-{pair}.json")
            speedup = theirs["median_step_s"] / mine["median_step_s"]
            result["pairs"].append({"ours": mine, "trl": theirs, "speedup": speedup})
            print(f"pair {pair + 1}: ours {mine['median_step_s']:.1f} s, TRL "
                  f"{theirs['median_step_s']:.1f} s a step: {speedup:.2f}x; peak "
                  f"{mine['peak_rss_gb']:.2f} against {theirs['peak_rss_gb']:.2f} GB", flush=True)
    speedups = [pair["speedup"] for pair in result["pairs"]]
    result["speedup_median"], result["speedup_range"] = (statistics.median(speedups),
                                                         [min(speedups), max(speedups)])
    print(f"ours {commit} against TRL: {result['speedup_median']:.2f}x "
          f"(pairs {min(speedups):.2f}-{max(speedups):.2f})")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
