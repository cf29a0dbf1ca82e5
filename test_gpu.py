"""Tests that need a CUDA GPU (and, for the flash branch, flash-attn): `pytest -m gpu -q` on a GPU
machine.

On a CPU they skip with the reason. They check the CUDA-only branches the CPU suite cannot
reach: the sampler's flash_attn_with_kvcache path against its SDPA path on the same cache, a
bf16 training step of train.py on CUDA (NCCL is not needed: one process), and an --async-lag
queue saved from CUDA onto the CPU and resumed.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rollout
from test_rollout import tiny_model

ROOT = Path(__file__).parent
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU (pytest -m gpu)")]
needs_flash = pytest.mark.skipif(not rollout.flash_attn_status()[0],
                                 reason=rollout.flash_attn_status()[1])


def cache_for(model, rows, length, flash):
    config, param = model.config, next(model.parameters())
    head_dim = model.model.layers[0].self_attn.head_dim
    shape = (config.num_hidden_layers, rows, length, config.num_key_value_heads, head_dim)
    return rollout.KVCache(torch.zeros(shape, dtype=param.dtype, device=param.device),
                           torch.zeros(shape, dtype=param.dtype, device=param.device),
                           torch.zeros(rows, dtype=torch.int32, device=param.device), flash)


@needs_flash
@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3"])
def test_flash_equals_sdpa_on_the_same_cache(family):
    """Prefill three prompts of different lengths, then decode 8 steps feeding the same tokens to
    both paths: the logits agree within bf16 rounding at every step."""
    model = tiny_model(family).cuda().bfloat16()
    prompts = [[5, 9, 2, 7, 7, 1, 3], [3, 4], [8, 8, 8, 1]]
    caches = {flash: cache_for(model, 3, 32, flash) for flash in (True, False)}
    logits = {flash: rollout.prefill(model, prompts, cache) for flash, cache in caches.items()}
    torch.testing.assert_close(logits[True], logits[False], atol=5e-2, rtol=5e-2)
    for _ in range(8):
        tokens = logits[False].argmax(-1)
        logits = {flash: rollout.decode(model, tokens, cache) for flash, cache in caches.items()}
        torch.testing.assert_close(logits[True], logits[False], atol=5e-2, rtol=5e-2)
        assert torch.equal(caches[True].seqlens, caches[False].seqlens)


@needs_flash
def test_flash_generate_greedy_matches_sdpa(monkeypatch):
    """Greedy generation with flash and with SDPA (flash turned off) agree on most tokens (bf16
    ties may break differently; a wrong cache position would diverge at once)."""
    model = tiny_model("llama3").cuda().bfloat16()
    prompts = [[5, 9, 2, 7, 7, 1, 3], [3, 4], [8, 8, 8, 1]] * 2
    flash = rollout.generate(model, prompts, 24, temperature=0)
    monkeypatch.setattr(rollout, "flash_attn_status", lambda: (False, "off for the test"))
    sdpa = rollout.generate(model, prompts, 24, temperature=0)
    agree = (flash.tokens == sdpa.tokens).float().mean().item()
    assert agree > 0.9, agree


def test_bf16_train_step_on_cuda(tmp_path, letter_model):
    """Two steps of train.py on CUDA in bf16 (autocast, bf16 sampler, fp32 log-prob passes): finite
    metrics, the KL of step 1 exactly 0, and sampler and trainer close (mismatch_kl)."""
    task = letter_model(tmp_path)["task"]
    argv = ["--kl", "k3", "--place", "loss", "--model", str(tmp_path / "model"),
            "--task", str(task),
            "--group-size", "4", "--prompts-per-step", "4", "--max-new-tokens", "5", "--steps", "2",
            "--dtype", "bfloat16", "--lr", "1e-2", "--out", str(tmp_path / "run")]
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), *argv],
                            cwd=ROOT, capture_output=True,
                            text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line)
            for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["kl_k3"] == 0.0 and rows[1]["kl_k3"] > 0
    for row in rows:
        assert all(v is None or not isinstance(v, float) or v == v for v in row.values())  # no NaN
        assert abs(row["mismatch_kl"]) < 0.05 and row["skipped"] == 0


def test_async_queue_is_saved_on_the_cpu_and_resumes_on_cuda(tmp_path, letter_model):
    """--async-lag 2 on CUDA: the checkpoint's queue of batches sampled ahead holds CPU tensors
    (loadable on any device, or none), and --resume puts them back on the GPU and finishes."""
    task = letter_model(tmp_path)["task"]
    argv = ["--kl", "k1", "--place", "weighted", "--model", str(tmp_path / "model"),
            "--task", str(task), "--group-size", "4", "--prompts-per-step", "4",
            "--max-new-tokens", "5", "--async-lag", "2", "--loss", "truncated",
            "--lr", "1e-2", "--out", str(tmp_path / "run")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for extra in (["--steps", "1"], ["--steps", "2", "--resume"]):
        result = subprocess.run([sys.executable, str(ROOT / "train.py"), *argv, *extra], cwd=ROOT,
                                capture_output=True, text=True, timeout=600, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        queue = torch.load(tmp_path / "run" / "final" / "queue_rank0.pt", weights_only=False)
        assert len(queue) == 2 and all(batch["out"].tokens.device.type == "cpu" for batch in queue)
