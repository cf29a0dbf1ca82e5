"""Studies: a figure of the paper run over seeds with one command, aggregated, with verdicts.

    python -m lab.study fig3 --seeds 0,1,2 --lanes 2     # train, evaluate, aggregate, judge
    python -m lab.study fig3                             # a fresh clone: the committed outputs only
    python -m lab.study fig3 --print                     # the shell commands instead
    python -m lab.study fig3 --scale paper --print       # the paper's flags (docs/gpu.md), 8 GPUs

A plan (PLANS) is data: its configurations (a name, a label, train.py flags; `base` evaluates the
base model and trains nothing), the flags each scale adds (`cpu`: SmolLM2-135M on arith, the CPU
study's defaults; `paper`: docs/gpu.md's 8-GPU recipe), the final evaluation's eval.py flags, the
committed seed-0 runs it may reuse, and its findings. Every (configuration, seed) is a job; --lanes
jobs run at a time, each a subprocess with OMP_NUM_THREADS = cores // lanes. A job:
  1. is skipped if STUDIES/PLAN/NAME-seedS/ holds its final eval.json (or diverged.json);
  2. else, if the plan names a committed run to reuse for it, copies that run's small outputs when
     `reuse_problem` finds none (the same run-defining flags, steps and evaluation, and the same
     compute dtype as this machine resolves; studies/PREREGISTRATION.md states the rule);
  3. else trains into RUNS/PLAN/NAME-seedS/ with --save-every and --resume (train.py continues an
     interrupted run from its newest checkpoint, or starts), runs eval.py on its final checkpoint
     with --seed S, and copies config.json, metrics.jsonl, machine.json and EVAL_DIR/eval.json
     into STUDIES (eval.json last: its presence means done). Checkpoints stay under RUNS, of a
     finished run final/ only (--keep-checkpoints: all). A run that train.py stops for non-finite
     updates gets diverged.json instead of an evaluation (it counts as collapsed).
machine.json gets one entry per session (train, resume, eval): the CPU model and its bf16/AMX
flags, the GPU, torch and transformers versions, the dtype --dtype resolves to, threads, the git
commit and the tracked files modified, the time.

Then (or alone: --aggregate-only) study_report.py aggregates whatever seeds are done into
STUDIES/PLAN/results.md, aggregate.json and figure.png, with the verdicts of the rule registered
before the runs (studies/PREREGISTRATION.md): its docstring says how.

Plans `fig7-calibration` and `fig7-dose` (issue 28) are one dose-response study: the first finds
lr*, the lowest rate at which no KL at lag 10 is unstable; the second runs at that lr* (main
refuses it until the first has decided) with five seeds, reuses the first's no-KL runs at lr*, and
keeps each seed's runs on one kind of CPU (other_kind refuses a job on another).
"""
import argparse
import datetime
import json
import os
import platform
import queue
import shutil
import subprocess
import sys
import threading
from pathlib import Path

from lab.study_report import aggregate, chosen_lr, cpu_sessions, read_result, read_rows

ROOT = Path(__file__).resolve().parents[1]  # the repository

# ---------------------------------------------------------------- the scales and the plans (data)
CPU = {  # the CPU study's defaults (studies/cpu-small), written out so a default change shows
    "train": {"model": "smollm2-135m", "task": "arith", "steps": 20, "lr": 1e-5,
              "prompts-per-step": 8, "group-size": 4, "max-new-tokens": 40,
              "eval-every": 5, "eval-limit": 50, "save-every": 5,
              "micro-batch": 16},  # the CPU study's (train.py's default is 8 since aef40f8)
    "eval": {"tasks": "arith", "samples": 2, "max-new-tokens": 40, "dtype": "bfloat16",
             "batch-size": 64},
    "eval_dir": "eval-arith", "task": "arith", "launcher": ["python"], "threads": True,
}
PAPER = {  # docs/gpu.md: Qwen2.5-7B on MATH, 8 GPUs, FSDP2; mean@32 in and out of domain
    "train": {"model": "Qwen/Qwen2.5-7B", "task": "math", "eval-tasks": "math500",
              "eval-every": 25, "group-size": 5, "prompts-per-step": 256, "minibatches": 1,
              "micro-batch": 4, "lr": 1e-6, "max-new-tokens": 1024, "temperature": 1.0,
              "top-p": 1.0, "steps": 250, "fsdp": True, "save-every": 50},
    "eval": {"tasks": "math500,math2,mmlu-college-physics,mmlu-college-chemistry,"
                      "mmlu-college-biology", "samples": 32},
    "eval_dir": "eval-paper", "task": "math500", "launcher": ["torchrun", "--nproc_per_node=8"],
    "threads": False,
}


def scale(base, train=(), **rest):
    """A scale of a plan: `base` (CPU or PAPER) with the plan's own train flags on top."""
    return {**base, "train": {**base["train"], **dict(train)}, **rest}


BASE = {"label": "base model", "flags": None}
# fig7's setting without its rate and beta: prime-rl's loss and Dr. GRPO at lag 10 (sec. 4.2)
FIG7_CPU = {"async-lag": 10, "loss": "truncated", "advantage": "drgrpo"}
CALIBRATION_RATES = (1e-5, 1.5e-5, 2e-5)
K1_REWARD_1 = {"label": "K1-in-reward, beta 1", "flags": {"kl": "k1", "place": "reward", "beta": 1}}
PLANS = {
    "fig3": {
        "title": "Fig. 3: K3 in the reward collapses (beta 1)",
        "seeds": [0, 1, 2],
        "runs": {
            "base": BASE,
            "k1-reward-1": K1_REWARD_1,
            "k3-reward-1": {"label": "K3-in-reward, beta 1",
                            "flags": {"kl": "k3", "place": "reward", "beta": 1}},
            "k3-reward-1-verl": {"label": "K3-in-reward, beta 1, verl clamp",
                                 "flags": {"kl": "k3", "place": "reward", "beta": 1,
                                           "kl-clamp": "verl"}},
        },
        "scales": {
            # seed 0 of each: the CPU study's runs, if reuse_problem finds nothing against them
            "cpu": scale(CPU, reuse={name: {0: f"studies/cpu-small/{name}"} for name in
                                     ("k1-reward-1", "k3-reward-1", "k3-reward-1-verl")}),
            "paper": scale(PAPER),
        },
        "findings": [
            {"name": "Fig. 3 (sec. 4.1, Observation 2): K3-in-reward collapses",
             "collapses": "k3-reward-1", "holds": "k1-reward-1", "about": "collapses"},
            {"name": "Fig. 3 with verl's clamp (our inference of how the paper ran K3): "
                     "K3-in-reward collapses",
             "collapses": "k3-reward-1-verl", "holds": "k1-reward-1", "about": "collapses"},
        ],
    },
    "fig2c": {
        "title": "Fig. 2 centre and Fig. 11: 4 minibatches per batch, K1-in-loss against "
                 "K1-in-reward (beta 1)",
        "seeds": [0, 1, 2],
        "runs": {
            "base": BASE,
            "k1-reward-1": K1_REWARD_1,
            "k1-loss-1": {"label": "K1-in-loss, beta 1",
                          "flags": {"kl": "k1", "place": "loss", "beta": 1}},
        },
        "scales": {
            "cpu": scale(CPU, {"minibatches": 4}),
            "paper": scale(PAPER, {"prompts-per-step": 1024, "minibatches": 4}),
        },
        "findings": [
            {"name": "Fig. 2 centre (sec. 4.1): K1-in-loss with 4 minibatches collapses",
             "collapses": "k1-loss-1", "holds": "k1-reward-1", "about": "collapses"},
            {"name": "Fig. 11 (app. D.2): K1-in-reward with 4 minibatches stays stable",
             "collapses": "k1-loss-1", "holds": "k1-reward-1", "about": "holds"},
        ],
    },
    # issue 28: Fig. 7 as a dose-response study (studies/PREREGISTRATION.md, second part).
    # Stage 1 finds lr*, the lowest rate where no KL at lag 10 is unstable (chosen_lr)
    "fig7-calibration": {
        "title": "Fig. 7, calibration: no KL at lag 10 by learning rate, and lag 0 at 2e-5",
        "seeds": [0, 1, 2],
        "runs": {
            "base": BASE,
            **{f"nokl-lag10-lr{lr:g}": {"label": f"no KL, lag 10, lr {lr:g}",
                                        "flags": {"kl": "k1", "place": "none", "lr": lr}}
               for lr in CALIBRATION_RATES},
            # trained only when the three rates above leave lr* undecided (chosen_lr says so)
            "nokl-lag10-lr2.5e-05": {"label": "no KL, lag 10, lr 2.5e-05", "on_demand": True,
                                     "flags": {"kl": "k1", "place": "none", "lr": 2.5e-5}},
            "nokl-lag0-lr2e-05": {"label": "no KL, lag 0, lr 2e-05",
                                  "flags": {"kl": "k1", "place": "none", "lr": 2e-5,
                                            "async-lag": 0}},
        },
        "scales": {"cpu": scale(CPU, FIG7_CPU, eval={**CPU["eval"], "samples": 4})},
        "findings": [],
        "choose_lr": True,
        "rates": CALIBRATION_RATES + (2.5e-5,),  # lr* is the lowest unstable one (chosen_lr)
    },
    # stage 2: the KL at lr* (its --lr is filled in from stage 1's outputs by main), 5 paired seeds
    "fig7-dose": {
        "title": "Fig. 7 at lr*: K1-in-reward and K3-in-loss at beta 0.05 and 0.5 against no KL "
                 "(lag 10)",
        "seeds": [0, 1, 2, 3, 4],
        "runs": {
            "base": BASE,
            "nokl": {"label": "no KL", "flags": {"kl": "k1", "place": "none"}},
            **{f"{kl}-{place}-{beta:g}": {"label": f"{kl.upper()}-in-{place}, beta {beta:g}",
                                          "flags": {"kl": kl, "place": place, "beta": beta}}
               for kl, place in (("k1", "reward"), ("k3", "loss")) for beta in (0.05, 0.5)},
        },
        "scales": {"cpu": scale(CPU, {**FIG7_CPU, "lr": None},
                                eval={**CPU["eval"], "samples": 4})},
        "findings": [{"name": f"Fig. 7 (sec. 4.2): {kl.upper()}-in-{place} at beta {beta:g} "
                              f"stabilizes lag 10 where no KL is unstable",
                      "collapses": "nokl", "holds": f"{kl}-{place}-{beta:g}", "about": "paired"}
                     for kl, place in (("k1", "reward"), ("k3", "loss")) for beta in (0.05, 0.5)],
        "lr_from": "fig7-calibration",
        "one_kind_per_seed": True,
    },
    "fig7": {
        "title": "Fig. 7 (sec. 4.2): asynchronous, lag 10; no KL against K1-in-reward and "
                 "K3-in-loss",
        "seeds": [0, 1, 2],
        "runs": {
            "base": BASE,
            "nokl": {"label": "no KL", "flags": {"kl": "k1", "place": "none"}},
            "k1-reward": {"label": "K1-in-reward", "flags": {"kl": "k1", "place": "reward"}},
            "k3-loss": {"label": "K3-in-loss", "flags": {"kl": "k3", "place": "loss"}},
        },
        "scales": {
            # the async pilot's setting (studies/async-pilot): lag 10 collapses at lr 3e-5
            "cpu": scale(CPU, {"async-lag": 10, "loss": "truncated", "advantage": "drgrpo",
                               "lr": 3e-5, "beta": 0.05}),
            # sec. 4.2 and app. B: prime-rl, Dr. GRPO, 16 rollouts, beta 0.005, up to 350 steps
            # (a batch of 512 samples: 32 prompts x 16, as prime-rl counts them)
            "paper": scale(PAPER, {"async-lag": 10, "loss": "truncated", "advantage": "drgrpo",
                                   "group-size": 16, "prompts-per-step": 32, "beta": 0.005,
                                   "steps": 350, "max-new-tokens": 4096}),
        },
        "findings": [
            {"name": "Fig. 7 (sec. 4.2): K1-in-reward stabilizes asynchronous training",
             "collapses": "nokl", "holds": "k1-reward", "about": "holds"},
            {"name": "Fig. 7 (sec. 4.2): K3-in-loss stabilizes asynchronous training",
             "collapses": "nokl", "holds": "k3-loss", "about": "holds"},
        ],
    },
}
# flags that change nothing a run computes or logs: a reused run may differ in them
REUSE_IGNORED = {"out", "resume", "save_every", "micro_batch", "recompute", "fsdp",
                 "max_bad_steps", "trust_remote_code"}
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")

parser = argparse.ArgumentParser(prog="study.py",
                                 description="run a plan (a figure of the paper) over seeds, "
                                             "aggregate it and print its verdicts",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("plan", choices=PLANS, help="the plan: a figure of the paper")
parser.add_argument("--seeds", default=None,
                    help="comma-separated seeds (default: the plan's, 0,1,2)")
parser.add_argument("--lanes", type=int, default=1,
                    help="jobs at a time; each gets OMP_NUM_THREADS = cores // lanes")
parser.add_argument("--scale", default="cpu", choices=("cpu", "paper"),
                    help="cpu = SmolLM2-135M on arith (the CPU study's defaults); paper = the "
                         "paper's flags (docs/gpu.md), 8 GPUs a job")
parser.add_argument("--print", action="store_true",
                    help="print the shell commands of every job instead of running them")
parser.add_argument("--only", default=None,
                    help="comma-separated configuration names: run only these (the aggregate "
                         "and the verdicts still read every configuration)")
parser.add_argument("--steps", type=int, default=None,
                    help="override --steps of every run (a smoke test: use other --runs-dir and "
                         "--studies-dir; such runs are never reused)")
parser.add_argument("--runs-dir", default="runs/study",
                    help="where runs train (checkpoints); PLAN/NAME-seedS below it")
parser.add_argument("--studies-dir", default="studies",
                    help="where the small outputs, the table, the figure and the verdicts go; "
                         "PLAN/ below it (PLAN-paper/ at --scale paper)")
parser.add_argument("--keep-checkpoints", action="store_true",
                    help="keep a finished run's step_N checkpoints (by default only final/ stays: "
                         "each is 1.6 GB at 135M, so a plan of 9 runs would keep ~70 GB)")
parser.add_argument("--no-aggregate", action="store_true",
                    help="run the jobs only: no table, figure or verdicts")
parser.add_argument("--aggregate-only", action="store_true",
                    help="train and evaluate nothing: the table, figure and verdicts of what is "
                         "in STUDIES/PLAN")


# ---------------------------------------------------------------- commands
def render(flags):
    """{flag: value} as argv: True gives the bare flag, None and False nothing, floats as %g."""
    argv = []
    for key, value in flags.items():
        if value is None or value is False:
            continue
        argv.append(f"--{key}")
        if value is not True:
            argv.append(f"{value:g}" if isinstance(value, float) else str(value))
    return argv


def train_flags(plan, scale_name, name, seed, steps=None):
    """The train.py flags of configuration `name` at `seed` (without --out and --resume)."""
    setting = plan["scales"][scale_name]
    run = plan["runs"][name]["flags"]  # a configuration's own flags win over its scale's
    flags = {**run, **{key: run.get(key, value) for key, value in setting["train"].items()},
             "seed": seed}
    if steps is not None:
        flags["steps"] = steps
    return flags


def commands(plan, scale_name, name, seed, run_dir, resume=False, steps=None):
    """(train argv or None for the base model, eval argv) of one job."""
    setting = plan["scales"][scale_name]
    launcher = [sys.executable if word == "python" else word for word in setting["launcher"]]
    train = None
    model = setting["train"]["model"]
    if plan["runs"][name]["flags"] is not None:
        train = launcher + ["train.py"] + render(train_flags(plan, scale_name, name, seed, steps)) \
            + ["--out", str(run_dir)] + (["--resume"] if resume else [])
        model = str(run_dir / "final")
    evaluate = launcher + ["eval.py", "--model", model] + render(setting["eval"]) \
        + ["--seed", str(seed), "--out", str(run_dir / setting["eval_dir"])]
    return train, evaluate


def shell(argv, threads):
    """argv as one shell line, python as `python`, with OMP_NUM_THREADS in front when given."""
    words = ["python" if word == sys.executable else word for word in argv]
    quoted = [word if word and all(c.isalnum() or c in "-_./=,:" for c in word) else repr(word)
              for word in words]
    return (f"OMP_NUM_THREADS={threads} " if threads else "") + " ".join(quoted)


# ---------------------------------------------------------------- the machine
def cores():
    """The CPU cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def resolved_dtype(flag):
    """The compute dtype `--dtype flag` resolves to here (runtime.compute_dtype, start's rule)."""
    import torch

    from systems import runtime

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return str(runtime.compute_dtype(flag, device)).removeprefix("torch.")


def machine(stage, train_dtype, eval_dtype, threads):
    """One machine.json entry: what ran this session, on what."""
    import torch
    import transformers

    cpu, flags = platform.processor() or platform.machine(), set()
    if Path("/proc/cpuinfo").is_file():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                cpu = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    git = lambda *argv: subprocess.run(["git", *argv], cwd=ROOT, capture_output=True,  # noqa: E731
                                       text=True).stdout.strip()
    return {"stage": stage, "time": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"),
            "cpu": cpu, "cpu_flags": {flag: flag in flags for flag in CPU_FLAGS},
            "cores": cores(), "omp_num_threads": threads,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "train_dtype": train_dtype,
            "eval_dtype": eval_dtype, "commit": git("rev-parse", "HEAD"),
            "modified": git("status", "--porcelain", "--untracked-files=no").split("\n")
            if git("status", "--porcelain", "--untracked-files=no") else []}


def record(run_dir, entry):
    """Append a session to RUN/machine.json."""
    path = run_dir / "machine.json"
    sessions = json.loads(path.read_text())["sessions"] if path.is_file() else []
    path.write_text(json.dumps({"sessions": sessions + [entry]}, indent=2) + "\n")


# ---------------------------------------------------------------- reuse
def sampler_dtype(source):
    """The compute dtype a committed run ran with: its machine.json, else (runs from before the
    machine record, lag 0 only) its mismatch_kl: a bf16 sampler differs from the fp32 trainer by
    ~1e-3 nats a token, an fp32 one by ~1e-6."""
    if (source / "machine.json").is_file():
        return json.loads((source / "machine.json").read_text())["sessions"][0]["train_dtype"]
    config = json.loads((source / "config.json").read_text())
    if config.get("async_lag"):
        return None
    values = sorted(abs(row["mismatch_kl"]) for row in read_rows(source / "metrics.jsonl"))
    return None if not values else "bfloat16" if values[len(values) // 2] > 1e-4 else "float32"


def reuse_problem(source, flags, setting):
    """Why the committed run `source` cannot stand for a run with train.py `flags` here, or None:
    run-defining flags, steps and the in-training evaluation as the plan's (a flag the run's
    train.py did not have yet counts as its default), the same compute dtype as this machine
    resolves, and the plan's final evaluation (samples, problems) done."""
    import train

    if not (source / "config.json").is_file():
        return f"{source} has no config.json"
    config = json.loads((source / "config.json").read_text())
    wanted = vars(train.parser.parse_args(render(flags)))
    then = {key: config.get(key, train.parser.get_default(key)) for key in wanted}
    device = train.torch.device("cuda" if train.torch.cuda.is_available() else "cpu")
    for run in (wanted, then):  # --logprob-dtype auto, as train.main resolves it here
        resolved = train.runtime.logprob_dtype(run["logprob_dtype"], device)
        run["logprob_dtype"] = str(resolved).removeprefix("torch.")
    differ = [f"--{key.replace('_', '-')} {then[key]} (plan: {value})"
              for key, value in wanted.items()
              if key not in REUSE_IGNORED | {"dtype"} and then[key] != value]
    if differ:
        return "other flags: " + ", ".join(differ)
    # the dtype it computed in: config.json's (train.py now writes the resolved one), or inferred
    dtype = then["dtype"] if then["dtype"] != "auto" else sampler_dtype(source)
    here = resolved_dtype(wanted["dtype"])
    if dtype != here:
        return f"it ran in {dtype or 'an unrecorded dtype'}, this machine resolves {here}"
    result = read_result(source, setting)
    if result is None or result.get("samples") != setting["eval"].get("samples"):
        return f"no final evaluation with --samples {setting['eval'].get('samples')}"
    return None


def other_kind(plan, args, seed, cpu):
    """Why seed `seed` of a one-kind-per-seed plan cannot run on `cpu`, or None: its finished runs,
    and its runs in progress, trained or evaluated on another kind of CPU."""
    for name in plan["runs"]:
        for folder in (args.studies / f"{name}-seed{seed}", args.runs / f"{name}-seed{seed}"):
            kinds = {session["cpu"] for session in cpu_sessions(folder)} - {cpu}
            if kinds:
                return (f"seed {seed}'s runs are on {', '.join(sorted(kinds))} ({folder}), this "
                        f"is {cpu}: one kind of CPU per seed (studies/PREREGISTRATION.md)")
    return None


def reuse(source, target, setting):
    """Copy a committed run's small outputs (`source`, relative to the repository) into `target`,
    machine.json saying where from."""
    source, name = ROOT / source, source
    target.mkdir(parents=True, exist_ok=True)
    for file in ("config.json", "metrics.jsonl"):
        shutil.copy(source / file, target / file)
    entry = {"stage": "reused", "reused_from": name, "train_dtype": sampler_dtype(source),
             "note": "" if (source / "machine.json").is_file() else
             "no machine record: train_dtype inferred from mismatch_kl"}
    for session in cpu_sessions(source):  # where the source trained and evaluated, kept
        record(target, session)
    record(target, entry)
    (target / setting["eval_dir"]).mkdir(exist_ok=True)
    shutil.copy(source / setting["eval_dir"] / "eval.json", target / setting["eval_dir"])


# ---------------------------------------------------------------- running
def done(target, setting):
    return ((target / setting["eval_dir"] / "eval.json").is_file()
            or (target / "diverged.json").is_file())


def drop_resume_points(run_dir):
    """A finished run's step_N checkpoints, complete or not (.tmp-, .old- names): final/ stays."""
    if run_dir.is_dir():
        for path in run_dir.iterdir():
            if path.is_dir() and "step_" in path.name:
                shutil.rmtree(path, ignore_errors=True)


def latest_step(run_dir):
    """The step that train.py --resume will continue from (checkpoint.latest), or None."""
    from systems import checkpoint

    found = checkpoint.latest(run_dir)
    return checkpoint.step_of(found) if found else None


def run_job(plan, args, name, seed, threads, say):
    """One (configuration, seed): skip, reuse, or train + evaluate + copy. Returns an error line
    or None."""
    from systems import checkpoint

    setting = plan["scales"][args.scale]
    target = args.studies / f"{name}-seed{seed}"
    run_dir = args.runs / f"{name}-seed{seed}"
    if done(target, setting):
        if not args.keep_checkpoints:
            drop_resume_points(run_dir)
        return None
    source = setting.get("reuse", {}).get(name, {}).get(seed)
    if source is not None and args.steps is None:
        problem = reuse_problem(ROOT / source, train_flags(plan, args.scale, name, seed), setting)
        if problem is None:
            reuse(source, target, setting)
            say(f"{name} seed {seed}: reused {source}")
            return None
        say(f"{name} seed {seed}: not reusing {source}: {problem}")
    if plan.get("one_kind_per_seed"):
        problem = other_kind(plan, args, seed, machine("check", None, None, None)["cpu"])
        if problem:
            return f"{name} seed {seed}: not run: {problem}"
    is_training = plan["runs"][name]["flags"] is not None
    finished = (run_dir / "final").is_dir() and checkpoint.missing(run_dir / "final") is None
    # always --resume: train.py continues from the newest checkpoint, or starts when there is none
    train, evaluate = commands(plan, args.scale, name, seed, run_dir, True, args.steps)
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if setting["threads"] else {})}
    run_dir.mkdir(parents=True, exist_ok=True)
    train_dtype = (resolved_dtype(train_flags(plan, args.scale, name, seed).get("dtype", "auto"))
                   if is_training else None)
    eval_dtype = resolved_dtype(setting["eval"].get("dtype", "auto"))
    if is_training and not finished:
        step = latest_step(run_dir)
        say(f"{name} seed {seed}: train" + (f", resuming from step {step}" if step else ""))
        record(run_dir, {**machine("resume" if step else "train", train_dtype, eval_dtype,
                                   threads), "from_step": step})
        with open(run_dir / "train.log", "a") as log:
            log.write("$ " + shell(train, None) + "\n")
            log.flush()
            code = subprocess.run(train, cwd=ROOT, env=env, stdout=log,
                                  stderr=subprocess.STDOUT).returncode
        if code != 0:
            last = (run_dir / "train.log").read_text().strip().splitlines()[-1:] or [""]
            if "non-finite" in last[0]:  # train.py stopped it: the run diverged
                copy_outputs(run_dir, target, setting, evaluated=False)
                (target / "diverged.json").write_text(json.dumps({"message": last[0]}) + "\n")
                say(f"{name} seed {seed}: diverged ({last[0]})")
                return None
            return (f"{name} seed {seed}: train.py exited with {code}: {last[0]} "
                    f"({run_dir}/train.log)")
    say(f"{name} seed {seed}: evaluate")
    record(run_dir, machine("eval", train_dtype, eval_dtype, threads))
    with open(run_dir / "eval.log", "a") as log:
        log.write("$ " + shell(evaluate, None) + "\n")
        log.flush()
        code = subprocess.run(evaluate, cwd=ROOT, env=env, stdout=log,
                              stderr=subprocess.STDOUT).returncode
    if code != 0:
        last = (run_dir / "eval.log").read_text().strip().splitlines()[-1:] or [""]
        return f"{name} seed {seed}: eval.py exited with {code}: {last[0]} ({run_dir}/eval.log)"
    copy_outputs(run_dir, target, setting, evaluated=True)
    if not args.keep_checkpoints:
        drop_resume_points(run_dir)
    say(f"{name} seed {seed}: done")
    return None


def copy_outputs(run_dir, target, setting, evaluated):
    """config.json, metrics.jsonl, machine.json and (evaluated) EVAL_DIR/eval.json, that last."""
    target.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "metrics.jsonl", "machine.json"):
        if (run_dir / name).is_file():
            shutil.copy(run_dir / name, target / name)
    if evaluated:
        (target / setting["eval_dir"]).mkdir(exist_ok=True)
        shutil.copy(run_dir / setting["eval_dir"] / "eval.json", target / setting["eval_dir"])


def run_jobs(plan, args, jobs):
    """The jobs over --lanes worker threads, each job a subprocess at a time; the error lines."""
    threads = max(1, cores() // args.lanes)
    todo, errors, lock = queue.Queue(), [], threading.Lock()
    for job in jobs:
        todo.put(job)

    def lane(number):
        say = lambda line: print(f"[lane {number}] {line}", flush=True)  # noqa: E731
        while True:
            try:
                name, seed = todo.get_nowait()
            except queue.Empty:
                return
            try:
                error = run_job(plan, args, name, seed, threads, say)
            except Exception as caught:  # noqa: BLE001 - one job's failure stops only that job
                error = f"{name} seed {seed}: {type(caught).__name__}: {caught}"
            if error:
                say(error)
                with lock:
                    errors.append(error)

    import train  # noqa: F401 - here, not in two lanes at once: transformers' lazy imports race
    workers = [threading.Thread(target=lane, args=(number,)) for number in range(1, args.lanes + 1)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return errors


# ---------------------------------------------------------------- main
def parse_seeds(text, default):
    if text is None:
        return list(default)
    try:
        seeds = [int(word) for word in text.split(",")]
    except ValueError:
        seeds = []
    if not seeds or any(seed < 0 for seed in seeds) or len(set(seeds)) != len(seeds):
        parser.error(f"--seeds must be distinct non-negative integers like 0,1,2, got {text!r}")
    return seeds


def main(argv=None):
    args = parser.parse_args(argv)
    plan = PLANS[args.plan]
    seeds = parse_seeds(args.seeds, plan["seeds"])
    if args.scale not in plan["scales"]:
        parser.error(f"plan {args.plan} has no {args.scale} scale")
    if args.lanes < 1:
        parser.error(f"--lanes must be at least 1, got {args.lanes}")
    if args.scale == "paper" and args.lanes > 1 and not args.print:
        parser.error("--scale paper: a job takes all 8 GPUs; use --lanes 1")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if plan.get("lr_from"):  # fig7-dose: --lr is stage 1's lr*, decided by its rule
        stage1 = PLANS[plan["lr_from"]]
        lr, reason = chosen_lr(stage1, Path(args.studies_dir) / plan["lr_from"],
                               stage1["scales"][args.scale])
        if lr is None:
            parser.error(f"plan {args.plan} runs at the lr* of {plan['lr_from']}: {reason}")
        plan["scales"][args.scale]["train"]["lr"] = lr
        # no KL's seeds 0-2 are the calibration's runs at lr* (reuse_problem checks them)
        plan["scales"][args.scale]["reuse"] = {"nokl": {
            seed: str(Path(args.studies_dir) / plan["lr_from"] / f"nokl-lag10-lr{lr:g}-seed{seed}")
            for seed in PLANS[plan["lr_from"]]["seeds"]}}
        print(f"{args.plan}: {reason}", flush=True)
    only = ([name for name, run in plan["runs"].items() if not run.get("on_demand")]
            if args.only is None else args.only.split(","))
    unknown = [name for name in only if name not in plan["runs"]]
    if unknown:
        parser.error(f"--only: no configuration {', '.join(unknown)} in plan {args.plan} "
                     f"(it has {', '.join(plan['runs'])})")
    folder = args.plan + ("" if args.scale == "cpu" else f"-{args.scale}")
    args.runs, args.studies = Path(args.runs_dir) / folder, Path(args.studies_dir) / folder
    # seed-major: every configuration's seed 0 first, so partial results stay balanced
    jobs = [(name, seed) for seed in seeds for name in only]

    if args.print:
        setting = plan["scales"][args.scale]
        threads = max(1, cores() // args.lanes) if setting["threads"] else None
        for name, seed in jobs:
            run_dir = args.runs / f"{name}-seed{seed}"
            source = setting.get("reuse", {}).get(name, {}).get(seed)
            if source:
                print(f"# {name} seed {seed}: reused from {source} when its flags and dtype "
                      f"match (study.py reuse_problem), else:")
            train, evaluate = commands(plan, args.scale, name, seed, run_dir, steps=args.steps)
            for argv in filter(None, (train, evaluate)):
                print(shell(argv, threads))
            target, eval_dir = args.studies / f"{name}-seed{seed}", setting["eval_dir"]
            small = (f"cp {run_dir}/config.json {run_dir}/metrics.jsonl {target}/ && "
                     if train else "")
            print(f"mkdir -p {target}/{eval_dir} && {small}"
                  f"cp {run_dir}/{eval_dir}/eval.json {target}/{eval_dir}/")
        return

    errors = [] if args.aggregate_only else run_jobs(plan, args, jobs)
    if not args.no_aggregate:
        print(aggregate(plan, args, seeds), end="")
        print(f"wrote {args.studies / 'results.md'}, aggregate.json, figure.png")
    if errors:
        raise SystemExit("study.py: error: " + f"{len(errors)} job(s) failed: " + "; ".join(errors))


if __name__ == "__main__":
    main()
