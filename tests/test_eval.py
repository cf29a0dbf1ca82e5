"""Tests of eval.py (mean@k, pass@k, sharding, completions.jsonl) and plot.py (renders without a
display)."""
import functools
import importlib.util
import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import eval as evaluation
from systems import cuda_decode

REPO = Path(__file__).resolve().parents[1]  # the repository


def test_mean_at_k_and_stderr_by_hand():
    correct = np.array([[1, 0, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=float)
    metrics = evaluation.mean_at_k(correct)
    # per-problem fractions 0.75, 0, 1, 0.25: mean 0.5; deviations .25 -.5 .5 -.25;
    # ddof=1 variance 0.625/3
    assert metrics["n"] == 4
    assert metrics["accuracy"] == pytest.approx(0.5)
    assert metrics["stderr"] == pytest.approx(math.sqrt(0.625 / 3) / 2)
    # one problem: undefined, reported as 0
    assert evaluation.mean_at_k(correct[:1])["stderr"] == 0.0


def test_pass_at_k_matches_enumeration():
    # the fraction of all k-subsets of the n samples that hold at least one correct sample
    for n in range(1, 7):
        for c in range(n + 1):
            outcomes = [1] * c + [0] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(outcomes, k))
                expected = sum(any(subset) for subset in subsets) / len(subsets)
                assert evaluation.pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def records_from(rewards, **fields):
    """Completion records of problems with these per-sample rewards, plus per-problem fields."""
    return [{"index": i, "sample": j, "reward": reward,
             **{key: values[i] for key, values in fields.items()}}
            for i, row in enumerate(rewards) for j, reward in enumerate(row)]


def test_summarize_by_hand():
    rewards = [[1.0, 0.0, 1.0, 1.0], [0.0, 0.1, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0],
               [1.0, 0.0, 0.0, 0.0]]
    records = records_from(rewards, subject=["alg", "geo", "alg", "geo"], level=[1, 2, 2, 2])
    metrics = evaluation.summarize(records[::-1])  # the order of the records does not matter
    assert metrics["samples"] == 4 and metrics["n"] == 4
    # a 0.1 partial reward is not correct
    assert metrics["accuracy"] == metrics["pass@1"] == pytest.approx(0.5)
    assert metrics["stderr"] == pytest.approx(math.sqrt(0.625 / 3) / 2)
    # pass@2 per problem: 1 - C(1,2)/C(4,2) = 1, 0, 1, 1 - C(3,2)/C(4,2) = 0.5
    assert metrics["pass@2"] == pytest.approx(2.5 / 4)
    assert metrics["pass@4"] == pytest.approx(3 / 4)
    assert set(metrics) >= {"accuracy", "stderr", "n", "samples", "pass@1", "pass@2", "pass@4"}
    # alg: 0.75, 1.0; geo: 0, 0.25; level 1: 0.75; level 2: 0, 1, 0.25
    assert metrics["by_subject"]["alg"] == pytest.approx(
        {"accuracy": 0.875, "stderr": 0.125, "n": 2})
    assert metrics["by_subject"]["geo"] == pytest.approx(
        {"accuracy": 0.125, "stderr": 0.125, "n": 2})
    assert metrics["by_level"]["1"] == {"accuracy": 0.75, "stderr": 0.0, "n": 1}
    level2 = np.array([0.0, 1.0, 0.25])
    assert metrics["by_level"]["2"] == pytest.approx(
        {"accuracy": level2.mean(), "stderr": level2.std(ddof=1) / math.sqrt(3), "n": 3})
    assert "by_level" not in evaluation.summarize(records_from(rewards))
    json.dumps(metrics)  # plain Python numbers, ready for eval.json


def test_bad_input_is_one_line_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        evaluation.main(["--model", "x", "--tasks", "math500", "--out", str(tmp_path),
                         "--samples", "0"])
    assert "--samples" in capsys.readouterr().err
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(SystemExit):
        evaluation.main(["--model", "x", "--tasks", str(missing), "--out", str(tmp_path)])
    assert "missing.jsonl" in capsys.readouterr().err


# ---- end to end on a tiny random Llama with the SmolLM2 tokenizer:
#      1 process vs torchrun with 2 ranks ----

TASK_ROWS = [  # mixed prompt lengths; two rows carry a subject so the breakdown path runs too
    {"problem": "What is 1+1?", "answer": "2"},
    {"problem": "Compute $3 \\times 3$.", "answer": "9", "subject": "algebra"},
    {"problem": "x", "answer": "1"},
    {"problem": "Compute 10 - 3, and show every step of the computation carefully.", "answer": "7",
     "subject": "prealgebra"},
    {"problem": "What is $2^3$?", "answer": "8"},
]
EVAL_FLAGS = ["--samples", "3", "--batch-size", "4", "--max-new-tokens", "8", "--seed", "1"]


@pytest.fixture(scope="module")
def eval_runs(tmp_path_factory, smollm2_tokenizer, tiny_llama):
    """eval.py run by one process and by torchrun --nproc_per_node=2 (gloo) on the same tiny model
    and task."""
    root = tmp_path_factory.mktemp("eval")
    tokenizer = smollm2_tokenizer
    tiny_llama(len(tokenizer), max_position_embeddings=256, eos_token_id=tokenizer.eos_token_id,
               tie_word_embeddings=True).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    task = root / "task.jsonl"
    task.write_text("".join(json.dumps(row) + "\n" for row in TASK_ROWS))
    # 5 problems x 3 samples = 15 sequences in 4 batches: rank 0 gets batches 0 and 2,
    # rank 1 batches 1 and 3
    flags = ["--model", str(root / "model"), "--tasks", str(task), *EVAL_FLAGS]
    threads = torch.get_num_threads()
    # as in each torchrun worker (OMP_NUM_THREADS=1), so the float sums match too
    torch.set_num_threads(1)
    try:
        evaluation.main([*flags, "--out", str(root / "single")])
    finally:
        torch.set_num_threads(threads)
    env = {key: value for key, value in os.environ.items()
           if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    sharded = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                              str(REPO / "eval.py"), *flags, "--out", str(root / "sharded")],
                             env=env, capture_output=True, text=True, timeout=300)
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    return task, root / "single", root / "sharded"


def test_sharded_equals_unsharded(eval_runs):
    task, single, sharded = eval_runs
    assert (single / "completions.jsonl").read_text() == (sharded / "completions.jsonl").read_text()
    assert (json.loads((single / "eval.json").read_text())
            == json.loads((sharded / "eval.json").read_text()))
    completions = [json.loads(line)["completion"] for line in (single / "completions.jsonl").open()]
    assert len(set(completions)) == len(completions)  # every sample drew its own random numbers


def test_on_a_gpu_eval_samples_with_the_projections_joined(eval_runs, monkeypatch, tmp_path):
    """Where runtime.FUSED_PROJECTIONS_ON names the device (a GPU; here the CPU, patched), eval.py
    joins the model's q/k/v and gate/up weights as train.py's sampler does (one GEMM each a step):
    the same completions and numbers as the separate weights drew. Sampled through
    systems/cuda_decode.py's step, as on a GPU (rollout's own step reads the separate weights)."""
    import rollout

    task, single, _ = eval_runs
    joined = []
    monkeypatch.setattr(evaluation.runtime, "FUSED_PROJECTIONS_ON", ("cpu",))
    monkeypatch.setattr(evaluation, "generate",
                        functools.partial(rollout.generate, decoder=cuda_decode.decoder))
    monkeypatch.setattr(evaluation, "fuse_projections",
                        lambda model: joined.append(model) or cuda_decode.fuse_projections(model))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        evaluation.main(["--model", str(single.parent / "model"), "--tasks", str(task),
                         *EVAL_FLAGS, "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    assert len(joined) == 1 and hasattr(joined[0].model.layers[0].self_attn, "fused")
    for name in ("completions.jsonl", "eval.json"):
        assert (tmp_path / name).read_text() == (single / name).read_text()


def test_completions_round_trip(eval_runs):
    import data
    from reward import extract_boxed

    task, single, _ = eval_runs
    results = json.loads((single / "eval.json").read_text())
    records = [json.loads(line) for line in (single / "completions.jsonl").open()]
    examples = data.load_task(str(task), split="test")
    assert ([(r["index"], r["sample"]) for r in records]
            == [(i, j) for i in range(5) for j in range(3)])
    for record in records:
        assert record["task"] == str(task)
        example = examples[record["index"]]
        assert record["problem"] == example["problem"] and record["answer"] == example["answer"]
        # any score can be audited
        assert record["reward"] == data.score(example, record["completion"])
        assert record["extracted"] == extract_boxed(record["completion"])
    # eval.json is exactly what the completions say
    assert results == {str(task): evaluation.summarize(records)}
    metrics = results[str(task)]
    assert metrics["n"] == 5 and metrics["samples"] == 3
    assert set(metrics["by_subject"]) == {"algebra", "prealgebra"}


# ---- plot.py ----

def write_run(run, config, steps, eval_results):
    run.mkdir()
    if config is not None:
        (run / "config.json").write_text(json.dumps(config))
    with open(run / "metrics.jsonl", "w") as file:
        for step in range(steps):
            row = {"step": step, "reward": 0.3 + 0.01 * step,
                   "kl_k1": 0.01 * step, "kl_k3": 0.009 * step,
                   "entropy": 1.0 - 0.01 * step, "response_len": 50 + step,
                   "grad_norm": float("nan") if step == 3 else 1.0}
            if step % 5 == 0:
                row["eval/arith/accuracy"] = 0.4 + 0.01 * step
            file.write(json.dumps(row) + "\n")
        file.write('{"step": 99, "rew')  # a run still writing its last line
    if eval_results is not None:
        (run / "eval.json").write_text(json.dumps(eval_results))


def test_plot_renders_without_display(tmp_path):
    results = {"arith": {"accuracy": 0.5, "stderr": 0.05, "n": 100, "samples": 4},
               "math500": {"accuracy": 0.1, "stderr": 0.01, "n": 50, "samples": 4}}
    write_run(tmp_path / "k1_reward", {"kl": "k1", "place": "reward", "beta": 0.1}, 20, results)
    write_run(tmp_path / "none", {"kl": "k1", "place": "none", "beta": 0.0}, 12,
              {"arith": results["arith"]})
    # no config.json, no eval.json: labelled by its name
    write_run(tmp_path / "bare", None, 8, None)
    env = {key: value for key, value in os.environ.items() if key not in ("DISPLAY", "MPLBACKEND")}
    out = tmp_path / "fig.png"
    runs = [str(tmp_path / name) for name in ("k1_reward", "none", "bare")]
    done = subprocess.run([sys.executable, str(REPO / "plot.py"), *runs, "--out", str(out),
                           "--smooth", "0.5"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000

    import plot

    assert plot.run_label(tmp_path / "k1_reward") == "k1-in-reward β=0.1"
    assert plot.run_label(tmp_path / "none") == "no KL"
    assert plot.run_label(tmp_path / "bare") == "bare"
    assert len(plot.read_metrics(tmp_path / "bare" / "metrics.jsonl")) == 8


def test_plot_merges_eval_files_one_level_down(tmp_path):
    """RUN/eval.json and RUN/*/eval.json (one eval.py --out per setting) merge; a .jsonl task shows
    its stem."""
    import plot

    (tmp_path / "eval-math500").mkdir()
    (tmp_path / "eval.json").write_text(json.dumps({"arith": {"accuracy": 0.5}}))
    (tmp_path / "eval-math500" / "eval.json").write_text(
        json.dumps({"../shared/data/math500.jsonl": {"accuracy": 0.02}}))
    assert plot.read_evals(tmp_path) == {"arith": {"accuracy": 0.5}, "math500": {"accuracy": 0.02}}


def test_plot_table_lists_final_results(tmp_path):
    import plot

    rows = [{"step": s, "reward": s / 10, "kl_k1": float("nan") if s == 9 else 1.0,
             "skipped": int(s == 9)}
            for s in range(10)]
    text = plot.table(["k1-in-reward β=0.05", "base"], [rows, []],
                      [{"arith": {"accuracy": 0.75, "stderr": 0.03}},
                       {"arith": {"accuracy": 0.4, "stderr": 0.04}}])
    lines = text.splitlines()
    assert lines[0].startswith("| run | arith | train reward, last 5 steps")
    # reward: mean of steps 5-9 = 0.7; K1: the finite ones of the last 5 (1.0); one skipped step
    assert lines[2] == "| k1-in-reward β=0.05 | 0.750 ± 0.030 | 0.700 | 1.000 |  |  | 1 |"
    assert lines[3] == "| base | 0.400 ± 0.040 |  |  |  |  |  |"


def test_each_seed_draws_its_own_samples(tmp_path, smollm2_tokenizer, tiny_llama, one_thread):
    """--seed S: every seed its own stream (the old seed * 2**32 + b drew the same samples for
    every seed: the CPU generator keeps 32 bits); the same seed twice draws the same; seed 0 is
    the old stream (manual_seed(b)), so evaluations made before the fix are seed 0's."""
    tokenizer = smollm2_tokenizer
    model = tiny_llama(len(tokenizer), eos_token_id=tokenizer.eos_token_id).eval()
    task = tmp_path / "task.jsonl"
    task.write_text("".join(json.dumps(row) + "\n" for row in TASK_ROWS[:3]))
    examples = evaluation.data.load_task(str(task), split="test")

    def draw(seed):
        _, records = evaluation.evaluate(model, tokenizer, examples, samples=2, max_new_tokens=6,
                                         batch_size=4, seed=seed)
        return [record["completion"] for record in records]

    seed0, seed1, seed2 = draw(0), draw(1), draw(2)
    assert draw(0) == seed0
    assert seed0 != seed1 and seed1 != seed2 and seed0 != seed2
    # no sample of seed 1 repeats seed 0's in the same position (a shared stream would)
    assert sum(a == b for a, b in zip(seed0, seed1)) <= 1
    # seed 0 is the stream each batch b had before: torch.Generator().manual_seed(b)
    assert [evaluation.batch_seed(0, b) for b in range(3)] == [0, 1, 2]
    assert len({evaluation.batch_seed(seed, b) for seed in range(8) for b in range(64)}) == 8 * 64
    with pytest.raises(ValueError, match="0-4095"):
        evaluation.batch_seed(4096, 0)


def test_generate_rows_decodes_a_batch_in_chunks_with_the_same_samples(
        tmp_path, smollm2_tokenizer, tiny_llama, one_thread, monkeypatch):
    """generate_rows=2 (train.py's --generate-rows, which --eval-every's evaluation now follows:
    it sampled a whole batch, every row of a step, in one call): each generate call gets max_rows=2,
    and the completions are those of whole-batch calls."""
    tokenizer = smollm2_tokenizer
    model = tiny_llama(len(tokenizer), eos_token_id=tokenizer.eos_token_id).eval()
    task = tmp_path / "task.jsonl"
    task.write_text("".join(json.dumps(row) + "\n" for row in TASK_ROWS[:3]))
    examples = evaluation.data.load_task(str(task), split="test")
    generate, max_rows = evaluation.generate, []

    def recorded(*args, **kwargs):
        max_rows.append(kwargs.get("max_rows"))
        return generate(*args, **kwargs)
    monkeypatch.setattr(evaluation, "generate", recorded)
    draws = {rows: evaluation.evaluate(model, tokenizer, examples, samples=2, max_new_tokens=6,
                                       batch_size=4, generate_rows=rows)[1]
             for rows in (None, 2)}
    assert max_rows == [None, None, 2, 2]
    assert ([r["completion"] for r in draws[2]] == [r["completion"] for r in draws[None]])
