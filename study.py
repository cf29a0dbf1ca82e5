"""Studies: a figure of the paper run over seeds with one command, aggregated, with verdicts.

    python study.py fig3 --seeds 0,1,2 --lanes 2     # train, evaluate, aggregate, judge
    python study.py fig3                             # a fresh clone: the committed outputs only
    python study.py fig3 --print                     # the shell commands instead
    python study.py fig3 --scale paper --print       # the paper's flags (docs/gpu.md), 8 GPUs

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

Then (or alone: --aggregate-only) it aggregates whatever seeds are done: STUDIES/PLAN/results.md
(a markdown table: final mean@k over seeds with its min and max and every seed's value, how many
seeds collapsed, the training metrics' last steps), aggregate.json (per step: each configuration's
mean, min and max over seeds; the final evaluation per seed), figure.png (one curve per
configuration, the band spanning its seeds; the final evaluation as bars with a dot per seed) and
the verdicts. The figure and the table are drawn here: plot.py draws single runs (its
read_metrics, eval_keys are reused).

Verdicts (studies/PREREGISTRATION.md, written before any run). A run collapsed at seed S if train.py
stopped it for non-finite updates, or if its final mean@k is below the base model's (evaluated with
the same --seed S) by more than two standard errors of the difference:
base - run > 2 sqrt(se_run^2 + se_base^2), each se over problems (eval.py's stderr). A finding names
a configuration X that the paper says is unstable and one Y that it says is not, and which of the
two the paper's claim is about. With n seeds and m = n // 2 + 1 (2 of 3): reproduced when X
collapsed in at least m seeds and Y in fewer than m. Otherwise, for a claim about X: not
reproduced when X collapsed in fewer than m seeds, inconclusive when both did (the setting breaks
both). For a claim about Y: not reproduced when both did (Y did not hold), inconclusive when X
collapsed in fewer than m (nothing to hold at this scale). The verdicts are over the plan's own
seeds (the pre-registered 0, 1, 2), whatever --seeds says, and wait for all of them for X, Y and
the base model ("incomplete").
"""
import argparse
import datetime
import json
import math
import os
import platform
import queue
import shutil
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent

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
REUSE_IGNORED = {"out", "resume", "save_every", "micro_batch", "grad_checkpointing", "fsdp",
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
    """The compute dtype `--dtype flag` resolves to here (runtime.start's rule)."""
    if flag != "auto":
        return flag
    import torch

    import runtime

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return "bfloat16" if runtime.bf16_is_native(device) else "float32"


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


def cpu_sessions(folder):
    """The sessions of FOLDER/machine.json that name a CPU (trained, resumed or evaluated there)."""
    path = folder / "machine.json"
    sessions = json.loads(path.read_text())["sessions"] if path.is_file() else []
    return [session for session in sessions if session.get("cpu")]


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
    import checkpoint

    found = checkpoint.latest(run_dir)
    return checkpoint.step_of(found) if found else None


def run_job(plan, args, name, seed, threads, say):
    """One (configuration, seed): skip, reuse, or train + evaluate + copy. Returns an error line
    or None."""
    import checkpoint

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


# ---------------------------------------------------------------- results
def read_rows(path):
    """metrics.jsonl's rows (plot.read_metrics: a truncated last line is dropped)."""
    from plot import read_metrics

    return read_metrics(path)


def read_result(folder, setting):
    """The final evaluation of the verdict task in FOLDER/EVAL_DIR/eval.json, {"diverged": message}
    for a diverged run, or None."""
    if (folder / "diverged.json").is_file():
        return {"diverged": json.loads((folder / "diverged.json").read_text())["message"]}
    path = folder / setting["eval_dir"] / "eval.json"
    if not path.is_file():
        return None
    results = {Path(task).stem if task.endswith(".jsonl") else task: result
               for task, result in json.loads(path.read_text()).items()}
    return results.get(setting["task"])


def collapsed(result, base):
    """The pre-registered rule: diverged, or the final mean@k below the base model's (same eval
    seed) by more than two standard errors of the difference."""
    if "diverged" in result:
        return True
    margin = 2 * math.sqrt(result["stderr"] ** 2 + base["stderr"] ** 2)
    return base["accuracy"] - result["accuracy"] > margin


# two-sided 95% quantiles of Student's t by the number of seeds (degrees of freedom + 1)
T95 = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571, 7: 2.447, 8: 2.365, 9: 2.306, 10: 2.262}


def accuracy(result):
    """A final mean@k; a diverged run scores 0 (it ends with no usable model)."""
    return 0.0 if "diverged" in result else result["accuracy"]


def contrast(results, x, y, seeds):
    """The paired contrast of fig7-dose: each seed's d_S = y_S - x_S, their mean, its 95% t interval
    over seeds, and D, the mean fall of x from the base model."""
    d = [accuracy(results[y][seed]) - accuracy(results[x][seed]) for seed in seeds]
    n, mean = len(d), sum(d) / len(d)
    se = math.sqrt(sum((v - mean) ** 2 for v in d) / (n - 1) / n)
    fall = sum(accuracy(results["base"][seed]) - accuracy(results[x][seed]) for seed in seeds) / n
    return {"d": d, "mean": mean, "se": se, "low": mean - T95[n] * se,
            "high": mean + T95[n] * se, "fall": fall}


def paired_verdict(x, y, results, seeds):
    """Stage 2's rule (fig7-dose; studies/PREREGISTRATION.md): does y (a KL) stabilize where x (no
    KL) is unstable? On the paired contrast's 95% interval and the collapse counts."""
    m = len(seeds) // 2 + 1
    counts = {name: sum(collapsed(results[name][seed], results["base"][seed]) for seed in seeds)
              for name in (x, y)}
    c = contrast(results, x, y, seeds)
    reason = (f"{y} - {x}: {c['mean']:+.3f} [{c['low']:+.3f}, {c['high']:+.3f}] (95% t interval "
              f"over {len(seeds)} seeds); {x} falls {c['fall']:.3f} from the base; collapsed: "
              f"{x} {counts[x]}, {y} {counts[y]} of {len(seeds)}")
    if c["fall"] < 0.10 and counts[x] == 0:
        return "inconclusive in this regime", reason + " (no KL is not unstable)"
    if counts[x] >= m and counts[y] >= m:
        return "inconclusive in this regime", reason + f" (both collapsed in >= {m})"
    if c["low"] > 0 and counts[y] < counts[x]:
        return "reproduced", reason
    if c["high"] < c["fall"] / 2:
        return "not reproduced", reason + " (recovers less than half of no KL's fall)"
    return "inconclusive", reason


def verdict(finding, results, seeds):
    """(verdict, reason) of a finding from results[name][seed] (a result, or None when missing)."""
    x, y = finding["collapses"], finding["holds"]
    missing = [f"{name} seed {seed}" for name in ("base", x, y) for seed in seeds
               if results[name].get(seed) is None]
    if missing:
        return "incomplete", "waiting for " + ", ".join(missing)
    if finding["about"] == "paired":
        return paired_verdict(x, y, results, seeds)
    m = len(seeds) // 2 + 1
    counts = {name: sum(collapsed(results[name][seed], results["base"][seed]) for seed in seeds)
              for name in (x, y)}
    reason = (f"{x} collapsed in {counts[x]} of {len(seeds)} seeds, {y} in {counts[y]} "
              f"(majority: {m})")
    if counts[x] >= m and counts[y] < m:
        return "reproduced", reason
    if finding["about"] == "collapses":
        return ("not reproduced" if counts[x] < m else "inconclusive"), reason
    return ("not reproduced" if counts[x] >= m else "inconclusive"), reason


def unstable(results, base, seeds):
    """Stage 1's rule (fig7-calibration): (unstable?, reason) of a configuration's results over
    seeds: the mean of base_S - run_S is at least 0.10, or at least 1 seed collapsed."""
    falls = [base[seed]["accuracy"] - results[seed]["accuracy"] for seed in seeds
             if "diverged" not in results[seed]]
    down = sum(collapsed(results[seed], base[seed]) for seed in seeds)
    mean_fall = sum(falls) / len(falls) if falls else math.inf
    return (mean_fall >= 0.10 or down >= 1,
            f"mean fall from the base {mean_fall:.3f}, collapsed in {down} of {len(seeds)}")


def chosen_lr(studies, setting):
    """lr* of fig7-dose from fig7-calibration's outputs in `studies` (studies/PREREGISTRATION.md,
    stage 1): (lr, reason), or (None, what it waits for)."""
    plan = PLANS["fig7-calibration"]
    read = lambda name: {seed: read_result(studies / f"{name}-seed{seed}", setting)  # noqa: E731
                         for seed in plan["seeds"]}
    base, reasons = read("base"), []
    for lr in CALIBRATION_RATES + (2.5e-5,):
        name = f"nokl-lag10-lr{lr:g}"
        results = read(name)
        missing = [f"{key} seed {seed}" for key, by_seed in (("base", base), (name, results))
                   for seed, result in by_seed.items() if result is None]
        if missing:
            return None, "waiting for " + ", ".join(missing) + " of fig7-calibration" + (
                f" (python study.py fig7-calibration --only {name})"
                if plan["runs"][name].get("on_demand") else "")
        is_unstable, reason = unstable(results, base, plan["seeds"])
        reasons.append(f"lr {lr:g}: {reason}")
        if is_unstable:
            return lr, "; ".join(reasons) + f": lr* = {lr:g}, the lowest unstable rate"
    return 3e-5, "; ".join(reasons) + ": none unstable, lr* = 3e-05 (fig7: 3 of 3 collapsed)"


def summary(values):
    """'mean [min, max]' of a list of numbers ('' when empty)."""
    if not values:
        return ""
    return f"{sum(values) / len(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


def eval_key(rows):
    from plot import eval_keys

    keys = eval_keys(rows)
    return keys[0] if keys else None


def curves(metrics, key):
    """{step: [each seed's value]} of one configuration (seeds that logged the step)."""
    by_step = {}
    for rows in metrics:
        for row in rows:
            value = row.get(key if key != "eval" else eval_key(rows) or "eval")
            if value is not None and math.isfinite(value):
                by_step.setdefault(row["step"], []).append(float(value))
    return dict(sorted(by_step.items()))


def aggregate(plan, args, seeds):
    """results.md, aggregate.json and figure.png in STUDIES/PLAN from what is there; returns the
    markdown (the table and the verdicts)."""
    setting = plan["scales"][args.scale]
    folders = {name: {seed: args.studies / f"{name}-seed{seed}" for seed in seeds}
               for name in plan["runs"]}
    results = {name: {seed: read_result(folder, setting) for seed, folder in by_seed.items()}
               for name, by_seed in folders.items()}
    metrics = {name: [read_rows(folder / "metrics.jsonl") for folder in by_seed.values()]
               for name, by_seed in folders.items()}
    keys = ("eval", "reward", "kl_k1", "kl_k3", "entropy", "grad_norm", "behaviour_kl_k1")
    table = aggregate_table(plan, setting, seeds, results, metrics)
    # the verdicts: over the plan's pre-registered seeds, whatever --seeds says
    registered = {name: {seed: read_result(args.studies / f"{name}-seed{seed}", setting)
                         for seed in plan["seeds"]} for name in plan["runs"]}
    verdicts = [(finding, *verdict(finding, registered, plan["seeds"]))
                for finding in plan["findings"]]
    lines = [f"# {plan['title']}", "", f"Seeds {','.join(map(str, seeds))}; `python study.py "
             f"{args.plan}" + (f" --scale {args.scale}" if args.scale != "cpu" else "") + "`.",
             "", table, "", f"Verdicts (studies/PREREGISTRATION.md; seeds "
             f"{','.join(map(str, plan['seeds']))}):", ""]
    lines += [f"- **{label}**: {finding['name']}. {reason}." for finding, label, reason in verdicts]
    paired = [finding for finding in plan["findings"] if finding["about"] == "paired"]
    if paired and all(result for name in ("base", "nokl") for result in registered[name].values()):
        lines += ["", "| KL against no KL | each seed's d = KL - no KL | mean d [95% t interval] | "
                      "share of no KL's fall recovered |", "|---|---|---|---|"]
        for finding in paired:
            if all(registered[finding["holds"]].values()):
                c = contrast(registered, "nokl", finding["holds"], plan["seeds"])
                lines.append(f"| {plan['runs'][finding['holds']]['label']} | "
                             f"{', '.join(f'{v:+.3f}' for v in c['d'])} | {c['mean']:+.3f} "
                             f"[{c['low']:+.3f}, {c['high']:+.3f}] | "
                             f"{c['mean'] / c['fall']:.2f} (of {c['fall']:.3f}) |")
    if plan.get("choose_lr"):  # fig7-calibration: lr* and the lag-0 arm, by stage 1's rule
        lr, reason = chosen_lr(args.studies, setting)
        lines += [f"- lr* for fig7-dose: {reason}."]
        lag0 = registered["nokl-lag0-lr2e-05"]
        if all(lag0.values()) and all(registered["base"].values()):
            is_unstable, why = unstable(lag0, registered["base"], plan["seeds"])
            lines += [f"- lag 0 at lr 2e-05 is {'' if is_unstable else 'not '}unstable: {why}."]
    if plan.get("one_kind_per_seed"):
        kinds = {seed: sorted({session["cpu"] for by_seed in folders.values()
                               for session in cpu_sessions(by_seed[seed])}) for seed in seeds}
        lines += ["", "CPU of each seed's runs: " + "; ".join(
            f"seed {seed}: {', '.join(kind) or '-'}" for seed, kind in kinds.items()) + "."]
    dtypes = sorted({session.get("train_dtype") for name, by_seed in folders.items()
                     for folder in by_seed.values() if (folder / "machine.json").is_file()
                     for session in json.loads((folder / "machine.json").read_text())["sessions"]}
                    - {None})
    if len(dtypes) > 1:
        lines += ["", f"Warning: the runs trained in different dtypes ({', '.join(dtypes)})."]
    markdown = "\n".join(lines) + "\n"
    args.studies.mkdir(parents=True, exist_ok=True)
    (args.studies / "results.md").write_text(markdown)
    (args.studies / "aggregate.json").write_text(json.dumps({
        "seeds": seeds,
        "curves": {name: {key: {str(step): {"mean": sum(v) / len(v), "min": min(v), "max": max(v),
                                            "n": len(v)}
                                for step, v in curves(metrics[name], key).items()}
                          for key in keys} for name in plan["runs"]},
        "final": {name: {str(seed): result for seed, result in by_seed.items()}
                  for name, by_seed in results.items()},
        "verdicts": [{"finding": finding["name"], "verdict": label, "reason": reason}
                     for finding, label, reason in verdicts]}, indent=1) + "\n")
    if any(rows for runs in metrics.values() for rows in runs) or any(
            r for by_seed in results.values() for r in by_seed.values()):
        figure(plan, setting, keys, results, metrics, args.studies / "figure.png")
    return markdown


def aggregate_table(plan, setting, seeds, results, metrics):
    """The markdown table: one row per configuration, over its seeds."""
    task, k = setting["task"], setting["eval"].get("samples")
    lines = [f"| configuration | {task}, mean@{k}: mean [min, max] over seeds | each seed "
             f"(± stderr over problems) | collapsed | held-out Pass@1 at the last evaluation | "
             f"train reward, last 5 steps | KL (K1), last 5 steps | max grad norm | skipped |",
             "|---" * 9 + "|"]
    for name, run in plan["runs"].items():
        finals = [results[name][seed] for seed in seeds]
        accuracies = [r["accuracy"] for r in finals if r and "accuracy" in r]
        each = ", ".join("diverged" if r and "diverged" in r else
                         f"{r['accuracy']:.3f} ± {r['stderr']:.3f}" if r else "-" for r in finals)
        if name == "base":
            down = ""
        else:
            judged = [collapsed(r, results["base"][seed]) for r, seed in zip(finals, seeds)
                      if r and results["base"].get(seed)]
            down = f"{sum(judged)} of {len(judged)}" if judged else ""
        runs = metrics[name]
        last_eval = [c[max(c)][0] for c in (curves([rows], "eval") for rows in runs) if c]
        last5 = lambda key: [sum(v) / len(v) for v in  # noqa: E731
                             ([row[key] for row in rows[-5:] if row.get(key) is not None]
                              for rows in runs) if v]
        grad = [max(row["grad_norm"] for row in rows) for rows in runs if rows]
        skipped = [sum(row.get("skipped", 0) for row in rows) for rows in runs if rows]
        lines.append(f"| {run['label']} | {summary(accuracies)} | {each} | {down} | "
                     f"{summary(last_eval)} | {summary(last5('reward'))} | "
                     f"{summary(last5('kl_k1'))} | {f'{max(grad):.1f}' if grad else ''} | "
                     f"{sum(skipped) if skipped else ''} |")
    return "\n".join(lines)


def figure(plan, setting, keys, results, metrics, path):
    """The curves (mean over seeds, the band spanning them) and the final evaluation's bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = {"eval": "held-out Pass@1 (during training)", "reward": "train reward",
              "kl_k1": "KL to the base, K1 (per sequence)", "kl_k3": "KL to the base, K3",
              "entropy": "entropy (per token)", "grad_norm": "gradient norm",
              "behaviour_kl_k1": "behaviour KL, K1 (sampler vs policy)"}
    colors = {name: "gray" if name == "base" else f"C{i}" for i, name in enumerate(plan["runs"])}
    fig, axes = plt.subplots(2, 4, figsize=(16, 7.5), layout="constrained")
    for axis, key in zip(axes.flat, keys):
        axis.set_title(titles[key], fontsize=11)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
        for name in plan["runs"]:
            by_step = curves(metrics[name], key)
            if not by_step:
                continue
            steps = list(by_step)
            mean = [sum(v) / len(v) for v in by_step.values()]
            axis.plot(steps, mean, color=colors[name], linewidth=1.5,
                      marker="o" if key == "eval" else None, markersize=3)
            axis.fill_between(steps, [min(v) for v in by_step.values()],
                              [max(v) for v in by_step.values()], color=colors[name], alpha=0.2)
        if key in ("grad_norm", "kl_k3") and axis.lines:
            axis.set_yscale("log")
        if not axis.lines:
            axis.text(0.5, 0.5, "no data", ha="center", va="center", transform=axis.transAxes,
                      color="gray")
    axis = axes.flat[-1]  # the final evaluation: a bar per configuration, a dot per seed
    for i, name in enumerate(plan["runs"]):
        finals = [r for r in results[name].values() if r and "accuracy" in r]
        if finals:
            values = [r["accuracy"] for r in finals]
            axis.bar(i, sum(values) / len(values), color=colors[name], alpha=0.6)
            axis.errorbar([i] * len(values), values, yerr=[r["stderr"] for r in finals], fmt="o",
                          color="black", markersize=3, capsize=2)
    axis.set_xticks(range(len(plan["runs"])), [run["label"] for run in plan["runs"].values()],
                    rotation=20, ha="right", fontsize=8)
    axis.set_title(f"final {setting['task']}, mean@{setting['eval'].get('samples')} "
                   f"(dots: seeds ± stderr)", fontsize=11)
    axis.grid(axis="y", alpha=0.3)
    handles = [matplotlib.lines.Line2D([], [], color=colors[name], linewidth=3)
               for name in plan["runs"]]
    fig.legend(handles, [run["label"] for run in plan["runs"].values()],
               loc="outside lower center", ncols=len(plan["runs"]), fontsize=11)
    fig.suptitle(plan["title"] + " (lines: mean over seeds; bands: their min to max)",
                    fontsize=12)
    fig.savefig(path, dpi=64)
    plt.close(fig)


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
        lr, reason = chosen_lr(Path(args.studies_dir) / plan["lr_from"],
                               PLANS[plan["lr_from"]]["scales"][args.scale])
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
