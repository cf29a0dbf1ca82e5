"""Tests that need a CUDA GPU (and, for the flash branch, flash-attn on compute capability 8.0 or
higher): `pytest -m gpu -q` on a GPU machine, or gpu_check.py, which runs them and more
(docs/gpu.md).

On a CPU they skip with the reason. They check the CUDA-only branches the CPU suite reaches only
through stand-ins (test_cuda_paths.py): the rule that picks flash and bf16 on this GPU (and, on a
pre-Ampere GPU with flash-attn installed, that its kernel does refuse it); the sampler's
flash_attn_with_kvcache path against its SDPA path on the same cache; greedy generation with each,
token by token against the model's own forward pass; the decode loop through cuda_decode.decoder
replayed as a CUDA graph against its eager steps and against rollout's own step, under
torch.cuda.set_sync_debug_mode("error"), and holding no memory after a second call (its captures'
cuBLAS workspace); the FlexAttention branch's greedy tokens and its loop without a sync; a bf16
training step of train.py on CUDA (NCCL is not needed: one process); and an --async-lag queue saved
from CUDA onto the CPU and resumed.
"""
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import rollout
from systems import cuda_decode, runtime
from test_rollout import (PROMPTS, assert_greedy_up_to_ties, cache_for, eos_for_mixed_lengths,
                          lively, tiny_model)

ROOT = Path(__file__).resolve().parents[1]  # the repository
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU (pytest -m gpu)")]
FLASH = (cuda_decode.flash_choice(torch.device("cuda"), torch.bfloat16) if torch.cuda.is_available()
         else (False, "needs a CUDA GPU"))
needs_flash = pytest.mark.skipif(not FLASH[0], reason=FLASH[1])
# bf16 logits of the tiny models (|z| ~ 1): flash against SDPA, and a greedy token's tie
BF16 = dict(atol=5e-2, rtol=5e-2)


def test_the_rules_on_this_gpu():
    """--dtype auto is bf16 exactly where this GPU computes it natively (compute capability 8.0
    and up), and flash is used exactly where its kernel runs. On a pre-Ampere GPU with flash-attn
    installed, the kernel itself refuses to run: the reason flash_choice checks the capability."""
    device = torch.device("cuda", torch.cuda.current_device())
    major, minor = torch.cuda.get_device_capability(device)
    assert runtime.bf16_is_native(device) == (major >= 8)
    assert FLASH[0] == (major >= 8 and cuda_decode.flash_attn_status()[0]), FLASH[1]
    if major < 8 and cuda_decode.flash_attn_status()[0]:
        from flash_attn import flash_attn_with_kvcache

        q = torch.zeros(1, 1, 2, 64, dtype=torch.float16, device=device)
        cache = torch.zeros(1, 8, 2, 64, dtype=torch.float16, device=device)
        seqlens = torch.zeros(1, dtype=torch.int32, device=device)
        with pytest.raises(RuntimeError, match="Ampere"):
            flash_attn_with_kvcache(q, cache, cache.clone(), k=q, v=q, cache_seqlens=seqlens,
                                    causal=True)


@needs_flash
@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3"])
def test_flash_equals_sdpa_on_the_same_cache(family):
    """Prefill three prompts of different lengths, then decode 8 steps feeding the same tokens to
    both paths (cuda_decode's flash branch, rollout's own SDPA): the logits agree within bf16
    rounding at every step, and so do the caches (flash writes into them in place)."""
    model = tiny_model(family).cuda().bfloat16()
    prompts = [[5, 9, 2, 7, 7, 1, 3], [3, 4], [8, 8, 8, 1]]
    caches = {flash: cache_for(model, 3, 32) for flash in (True, False)}
    flash_forward = functools.partial(cuda_decode.forward, flash=True)
    logits = {True: rollout.prefill(model, prompts, caches[True], flash_forward),
              False: rollout.prefill(model, prompts, caches[False])}
    torch.testing.assert_close(logits[True], logits[False], **BF16)
    for _ in range(8):
        tokens = logits[False].argmax(-1)
        logits = {True: cuda_decode.decode(model, tokens, caches[True], None, flash=True),
                  False: rollout.decode(model, tokens, caches[False], span=32)}
        torch.testing.assert_close(logits[True], logits[False], **BF16)
        assert torch.equal(caches[True].seqlens, caches[False].seqlens)
        torch.testing.assert_close(caches[True].k, caches[False].k, **BF16)


@pytest.mark.parametrize("flash", [True, False], ids=["flash", "sdpa"])
def test_greedy_generate_follows_the_model(monkeypatch, flash):
    """Greedy generation on CUDA in bf16, with flash and with SDPA, prompts of 1-19 tokens (one
    twice), an EOS that ends rows at different steps: every token is the argmax of the model's own
    forward pass on the same prefix, up to a bf16 tie. Checked at each step on the tokens each
    run generated, not as whole streams: one tie broken the other way early changes the rest of
    a row and is no error; a wrong cache slot or mask is."""
    if flash and not FLASH[0]:
        pytest.skip(FLASH[1])
    if not flash:
        monkeypatch.setattr(cuda_decode, "flash_choice", lambda device, dtype: (False, "SDPA"))
    model = lively(tiny_model("qwen3")).cuda().bfloat16()
    free = rollout.generate(model, PROMPTS, 24, temperature=0).response_ids
    out = rollout.generate(model, PROMPTS, 24, temperature=0,
                           eos_token_id=eos_for_mixed_lengths(free), decoder=cuda_decode.decoder)
    assert_greedy_up_to_ties(model, PROMPTS, out, **BF16)
    assert len({len(row) for row in out.response_ids}) >= 2, "the test needs rows that stop"


@pytest.mark.parametrize("flash", [True, False], ids=["flash", "sdpa"])
def test_graphed_fixed_shape_loop_equals_eager(monkeypatch, flash):
    """generate on CUDA (through cuda_decode.decoder) in bf16 with EOS at mixed lengths, greedy
    and sampled: replaying the captured CUDA graph gives the eager step's tokens and log-probs (the
    same kernels on the same tensors), greedy tokens follow the model's own forward pass up to bf16
    ties, and the EOS comes from rollout's own step (rollout.own_decoder)."""
    if flash and not FLASH[0]:
        pytest.skip(FLASH[1])
    if not flash:
        monkeypatch.setattr(cuda_decode, "flash_choice", lambda device, dtype: (False, "SDPA"))
    model = lively(tiny_model("qwen3")).cuda().bfloat16()
    free = rollout.generate(model, PROMPTS, 24, temperature=0).response_ids
    eos = eos_for_mixed_lengths(free)
    for temperature in (0.0, 1.0):
        out = {graphs: rollout.generate(model, PROMPTS, 24, temperature=temperature,
                                        eos_token_id=eos, decoder=functools.partial(
                                            cuda_decode.decoder, cuda_graphs=graphs),
                                        generator=torch.Generator("cuda").manual_seed(0))
               for graphs in (True, False)}
        assert out[True].response_ids == out[False].response_ids
        torch.testing.assert_close(out[True].token_logprobs, out[False].token_logprobs,
                                   atol=1e-6, rtol=0)
    greedy = rollout.generate(model, PROMPTS, 24, temperature=0, eos_token_id=eos,
                              decoder=cuda_decode.decoder)
    assert_greedy_up_to_ties(model, PROMPTS, greedy, **BF16)
    assert len({len(row) for row in greedy.response_ids}) >= 2, "the test needs rows that stop"


@pytest.mark.parametrize("graphs", [True, False], ids=["graphed", "eager"])
def test_the_fixed_shape_loop_never_syncs(graphs):
    """The decode loop through cuda_decode.decoder with EOS off (no "all done?" to ask), sampled
    with top-p, under torch.cuda.set_sync_debug_mode("error"): any synchronizing CUDA operation in
    it raises."""
    model = lively(tiny_model("llama3")).cuda().bfloat16()
    decode_loop_without_a_sync(model, graphs)


def decode_loop_without_a_sync(model, graphs):
    """20 steps of the decode loop through cuda_decode.decoder, EOS off, top-p 0.8, under
    set_sync_debug_mode("error")."""
    cache, logits, _ = rollout.cache_for_prompts(model, PROMPTS, 20)
    uniforms = torch.rand(len(PROMPTS), 20, device="cuda", dtype=torch.float64)
    state = rollout.new_decoding(uniforms, torch.tensor([], dtype=torch.long, device="cuda"),
                                 1.0, 0.8)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rollout.sample_loop(model, cache, logits, state,
                            cuda_decode.decoder(model, cuda_graphs=graphs)[1])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert int(state.step) == 20 and state.lengths.eq(20).all()


@pytest.mark.parametrize("graphs", [True, False], ids=["graphed", "eager"])
def test_flex_decode_follows_the_model_and_never_syncs(monkeypatch, graphs):
    """The FlexAttention branch on CUDA (runtime.FLEX_DECODE_ON naming it, flash-attn off), bf16,
    Inductor's kernel: greedy tokens with EOS at mixed lengths follow the model's own forward pass
    up to bf16 ties, and the decode loop, compiled by then, runs under
    set_sync_debug_mode("error")."""
    monkeypatch.setattr(cuda_decode, "flash_choice", lambda device, dtype: (False, "SDPA"))
    monkeypatch.setattr(runtime, "FLEX_DECODE_ON", ("cuda",))
    model = lively(tiny_model("qwen3")).cuda().bfloat16()
    free = rollout.generate(model, PROMPTS, 24, temperature=0).response_ids
    out = rollout.generate(model, PROMPTS, 24, temperature=0,
                           decoder=functools.partial(cuda_decode.decoder, cuda_graphs=graphs),
                           eos_token_id=eos_for_mixed_lengths(free))
    assert_greedy_up_to_ties(model, PROMPTS, out, **BF16)
    assert len({len(row) for row in out.response_ids}) >= 2, "the test needs rows that stop"
    decode_loop_without_a_sync(model, graphs)


def test_the_compiled_sampler_compiles_once_in_a_train_run(monkeypatch):
    """train.py --compile-sampler on CUDA, Inductor and CUDA graphs (issue 55): a decoder layer's
    two regions, each compiled once, serve every layer of a run's generate calls, whose prompts'
    lengths, rows (--generate-rows chunks) and spans differ, the spans below the cache's length
    (max_new_tokens above rollout.SPAN_BUCKET, as train.py's 1,024) and at it; greedy tokens follow
    the model up to bf16 ties. tests/test_static_decode.py checks the same on a CPU, with Inductor
    too."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(cuda_decode, "flash_choice", lambda device, dtype: (False, "SDPA"))
    model = lively(tiny_model("qwen2")).cuda().bfloat16()
    cuda_decode.fuse_projections(model)  # as train.py's sampler on a GPU
    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    calls = [  # (a step's prompts, each G = 2 times; max_new_tokens; EOS; max_rows)
        ([p for p in PROMPTS[:3] for _ in range(2)], 20, True, None),  # span = max_len at once
        ([p + [9] * 5 for p in PROMPTS[2:] for _ in range(2)], 140, False, None),  # 128, max_len
        ([p for p in PROMPTS[1:] for _ in range(2)], 140, False, 5),  # chunks of 5, 5, 2 rows
    ]
    for prompts, max_new_tokens, eos, max_rows in calls:
        free = rollout.generate(model, prompts, max_new_tokens, temperature=0).response_ids
        out = rollout.generate(model, prompts, max_new_tokens, temperature=0, max_rows=max_rows,
                               eos_token_id=eos_for_mixed_lengths(free) if eos else None,
                               decoder=runtime.sampler_decoder(torch.device("cuda"), True))
        assert_greedy_up_to_ties(model, prompts, out, **BF16)
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])  # one a region
    torch._dynamo.reset()


@pytest.mark.skipif(torch.torch_version.TorchVersion(torch.__version__) < (2, 8),
                    reason=f"torch {torch.__version__} has no fused RMSNorm CUDA kernel (torch 2.8 "
                           "added it; before, F.rms_norm runs the composite ops on CUDA)")
@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3"])
def test_a_step_normalizes_with_the_fused_kernel(family):
    """On CUDA a bf16 decode step's norms run PyTorch's fused RMSNorm kernel (aten._fused_rms_norm,
    once for each of the model's norms), none of the modules' own seven (no mean); that the tokens
    stay the model's, the greedy tests above check."""
    model = tiny_model(family).cuda().bfloat16()
    cache = cache_for(model, 3, 16)
    tokens = rollout.prefill(model, [[5, 9, 2], [3, 4], [8]], cache).argmax(-1)
    ops = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))
    with Ops():
        cuda_decode.decode(model, tokens, cache, span=16)
    layers = model.config.num_hidden_layers
    norms = 2 * layers + 1 + (2 * layers if family == "qwen3" else 0)
    assert ops.count("_fused_rms_norm") == norms and "mean" not in ops


def test_a_second_generate_holds_no_more_memory_than_the_first_left(monkeypatch):
    """Each capture of the fixed-shape loop warms up and records on one side stream for the process
    (cuda_decode.capture_stream): cuBLAS keeps a workspace (32 MiB on a Hopper card) in PyTorch's
    allocator for each stream that has run a GEMM, until the process ends, so a new stream per
    capture held one more for each span. Here each call captures four spans (SDPA: one graph per
    SPAN_BUCKET slots); once the first call has made the side stream's workspace, the second leaves
    the allocated bytes as they were."""
    monkeypatch.setattr(cuda_decode, "flash_choice", lambda device, dtype: (False, "SDPA"))
    model = lively(tiny_model("llama3")).cuda().bfloat16()
    max_new_tokens = 3 * rollout.SPAN_BUCKET  # spans of 128, 256, 384 and the cache's length
    for seed in (0, 1):
        if seed == 1:
            before = torch.cuda.memory_allocated()
        rollout.generate(model, PROMPTS, max_new_tokens, decoder=cuda_decode.decoder,
                         generator=torch.Generator("cuda").manual_seed(seed))
        torch.cuda.synchronize()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


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


def test_fp32_matmuls_from_bf16_tensor_cores_are_as_accurate_as_fp32():
    """systems/split_matmul.py on CUDA, where the piece products are one bf16 tensor-core GEMM with fp32
    output (torch.mm's out_dtype): against float64 as accurate as an fp32 matmul, as on a CPU
    (tests/test_split_matmul.py); three products are not. Fails if the tensor cores add with fewer
    bits than fp32."""
    import torch.nn.functional as F

    from systems.split_matmul import split_linear
    from test_split_matmul import operands, relative_error

    x, weight, bias = (t.cuda() for t in operands(k=4096))  # a long sum, as in a model's layers
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        fp32 = relative_error(F.linear(x, weight, bias), x, weight, bias)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    six = relative_error(split_linear(x, weight, bias, terms=6), x, weight, bias)
    three = relative_error(split_linear(x, weight, bias, terms=3), x, weight, bias)
    assert fp32 < 1e-6 and six < 2 * fp32 + 1e-7 and three > 5 * six  # 15x on a CPU
