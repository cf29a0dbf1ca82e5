"""The CUDA-only paths, checked on a CPU: the sampler's flash branch, and the rules that decide when
it runs and what --dtype auto means on a GPU.

- The flash branch runs against tests/fixtures/flash_attn_standin, a pure-PyTorch stand-in of
  flash-attn's `flash_attn_with_kvcache` that follows its documented semantics and asserts its
  preconditions (its docstring says what it cannot prove: the kernel itself, its numerics, its
  speed). The stand-in goes on sys.path, so cuda_decode.flash_attn_status's real import probe finds
  it; flash_choice's CUDA, dtype and compute-capability rules are waived (the branch "forced on").
  Then prefill and decode equal the SDPA path on the same cache, and generate through cuda_decode
  equals Hugging Face's greedy output, for the Llama, Qwen2 and Qwen3 layouts of test_rollout.py.
- The FlexAttention branch (cuda_decode.flex_attention) runs as it is, compiled by Inductor's CPU
  template, with runtime.FLEX_DECODE_ON naming the CPU: generate's samples equal the SDPA branch's
  for rows of mixed lengths in 1 to 3 blocks of slots, its step makes no host sync, and it reads
  nothing past a row's own slots (a cache poisoned there gives the same bits).
- The rules run against torch.cuda's answers patched: one fake GPU of a given compute capability
  whose bf16 is native (8.0 and up) or emulated (7.0, 7.5), read through torch's own
  is_bf16_supported and get_device_capability.
- runtime.start under torchrun on a fake node: the GPU of LOCAL_RANK, set before the process group
  is joined and given to it.
- gpu_check.py, the acceptance command for a GPU machine, tried on the CPU (--allow-cpu).
The same checks on a real GPU: test_gpu.py, and gpu_check.py (docs/gpu.md).
"""
import contextlib
import functools
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import rollout
from systems import cuda_decode, runtime
from test_rollout import (FAMILIES, PROMPTS, VOCAB, assert_greedy_up_to_ties, cache_for,
                          eos_for_mixed_lengths, hf_greedy, lively, tiny_model)
from test_static_decode import AtenOps, started

STANDIN = Path(__file__).parent / "fixtures" / "flash_attn_standin"
CUDA = torch.device("cuda", 0)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def standin(monkeypatch):
    """flash-attn installed: the stand-in, found and imported by rollout's own probe. Yields the
    imported module; afterwards flash-attn is gone again."""
    monkeypatch.syspath_prepend(str(STANDIN))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    cuda_decode.flash_attn_status.cache_clear()
    try:
        usable, reason = cuda_decode.flash_attn_status()
        assert usable, reason
        module = sys.modules["flash_attn"]
        assert Path(module.__file__).is_relative_to(STANDIN)
        monkeypatch.setattr(module, "calls", 0)
        yield module
    finally:
        sys.modules.pop("flash_attn", None)
        cuda_decode.flash_attn_status.cache_clear()


@pytest.fixture
def forced_on(standin, monkeypatch):
    """The flash branch on this CPU: flash_choice's device, dtype and capability rules waived, its
    import probe kept."""
    monkeypatch.setattr(cuda_decode, "flash_choice",
                        lambda device, dtype: cuda_decode.flash_attn_status())
    return standin


def fake_gpu(monkeypatch, major, minor):
    """torch.cuda answering as one GPU of compute capability major.minor on which bf16 tensors work
    (natively from 8.0, emulated on 7.0 and 7.5)."""
    props = types.SimpleNamespace(major=major, minor=minor, name=f"fake sm{major}{minor}")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda device: True,
                        raising=False)


# ---------------------------------------------------------------- the flash branch, forced on
PREFILL_PROMPTS = sorted(PROMPTS + [[9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12], [60, 61]], key=len,
                         reverse=True)  # 7 rows: buckets of 2 with padding inside; a repeat
# bf16: the stand-in attends in fp32 and rounds once, SDPA's CPU kernel rounds otherwise. Seen:
# logits (|z| <= 1.1) up to 8e-3 apart; keys cached by layer 2 up to 3e-2 (a bf16 step is 1.6e-2
# at 2-4), those of layer 1 equal
BF16 = {"logits": dict(atol=1e-2, rtol=1.6e-2), "cache": dict(atol=5e-2, rtol=1.6e-2)}
FP32 = {"logits": dict(atol=1e-5, rtol=0), "cache": dict(atol=1e-5, rtol=0)}
# a greedy bf16 token against the bf16 model's own forward pass: seen up to 2.2% of the largest
# logit below it (flash or SDPA; a tie broken the other way), 107-145% with a top-left causal mask
TIE = dict(atol=1e-2, rtol=4e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_flash_branch_equals_sdpa_on_the_same_cache(forced_on, monkeypatch, family, dtype):
    """Prefill 7 prompts of 1-19 tokens, then 6 decode steps that feed both paths the same tokens:
    at every step the flash branch's logits (cuda_decode's forward) equal the SDPA path's (rollout's
    own; fp32 to 1e-5, bf16 within its rounding), and so do the two caches, slot for slot:
    flash's writes land in cache.k and cache.v, at the slots the SDPA path writes."""
    monkeypatch.setattr(forced_on, "ALLOW_FP32", dtype == torch.float32)
    tolerance = FP32 if dtype == torch.float32 else BF16
    model = tiny_model(family).to(dtype)
    caches = {flash: cache_for(model, len(PREFILL_PROMPTS), 32) for flash in (True, False)}

    def check(logits):
        torch.testing.assert_close(logits[True], logits[False], **tolerance["logits"])
        assert torch.equal(caches[True].seqlens, caches[False].seqlens)
        for name in ("k", "v"):
            flash, sdpa = getattr(caches[True], name), getattr(caches[False], name)
            assert torch.equal(flash[0], sdpa[0])  # layer 1's keys and values: no attention yet
            torch.testing.assert_close(flash.float(), sdpa.float(), **tolerance["cache"])

    flash_forward = functools.partial(cuda_decode.forward, flash=True)
    logits = {True: rollout.prefill(model, PREFILL_PROMPTS, caches[True], flash_forward),
              False: rollout.prefill(model, PREFILL_PROMPTS, caches[False])}
    check(logits)
    for _ in range(6):
        tokens = logits[False].argmax(-1)
        logits = {True: cuda_decode.decode(model, tokens, caches[True], None, flash=True),
                  False: rollout.decode(model, tokens, caches[False], span=32)}
        check(logits)
    assert forced_on.calls > 0


def kernel_call(heads=2, heads_k=1, head_dim=64, dtype=torch.bfloat16, slots=8, new=1,
                seqlens=None, cache=None):
    """The arguments of one flash_attn_with_kvcache call: 2 rows, `new` new tokens each."""
    q = torch.zeros(2, new, heads, head_dim, dtype=dtype)
    k = torch.zeros(2, new, heads_k, head_dim, dtype=dtype)
    cache = torch.zeros(2, slots, heads_k, head_dim, dtype=dtype) if cache is None else cache
    seqlens = torch.tensor([3, 5], dtype=torch.int32) if seqlens is None else seqlens
    return dict(q=q, k_cache=cache, v_cache=torch.zeros_like(cache), k=k, v=k.clone(),
                cache_seqlens=seqlens, causal=True)


@pytest.mark.parametrize("bad, message", [
    (dict(dtype=torch.float32), "only support fp16 and bf16"),
    (dict(seqlens=torch.tensor([3, 5])), "int32"),
    (dict(seqlens=torch.tensor([3, 9, 5, 9], dtype=torch.int32)[::2]), "contiguous"),
    (dict(seqlens=torch.tensor([3], dtype=torch.int32)), "shape"),
    (dict(cache=torch.zeros(2, 64, 1, 8, dtype=torch.bfloat16).transpose(1, 3)),
     "contiguous last dimension"),
    (dict(head_dim=288), "at most 256"),
    (dict(heads=3, heads_k=2), "must divide"),
    (dict(new=4), "past the end"),
], ids=["fp32", "int64-seqlens", "strided-seqlens", "seqlens-shape", "cache-stride", "head-dim",
        "heads", "past-the-end"])
def test_the_standin_refuses_what_the_kernel_refuses(standin, bad, message):
    """The stand-in's preconditions are live: each call the kernel refuses (flash_api.cpp), or
    where it would write out of bounds, raises; the same call made right runs."""
    standin.flash_attn_with_kvcache(**kernel_call())
    with pytest.raises(RuntimeError, match=message):
        standin.flash_attn_with_kvcache(**kernel_call(**bad))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_flash_generate_equals_hf_greedy(forced_on, monkeypatch, family, dtype):
    """generate through the flash branch (cuda_decode's step), greedy, rows of 1-19 prompt tokens
    (one prompt twice), EOS ending rows at different steps: in fp32 every row equals Hugging Face's
    greedy generate of its prompt alone; in bf16 every token is the argmax of the model's own
    forward pass up to a bf16 tie."""
    monkeypatch.setattr(forced_on, "ALLOW_FP32", dtype == torch.float32)
    model = lively(tiny_model(family))
    free = [hf_greedy(model, prompt, 16) for prompt in PREFILL_PROMPTS]
    eos = eos_for_mixed_lengths(free)
    if dtype == torch.float32:
        out = rollout.generate(model, PREFILL_PROMPTS, 16, temperature=0, eos_token_id=eos,
                               decoder=cuda_decode.decoder)
        expected = [row[: row.index(eos) + 1] if eos in row else row for row in free]
        assert out.response_ids == expected
    else:
        model = model.to(dtype)
        out = rollout.generate(model, PREFILL_PROMPTS, 16, temperature=0, eos_token_id=eos,
                               decoder=cuda_decode.decoder)
        assert_greedy_up_to_ties(model, PREFILL_PROMPTS, out, **TIE)
    assert len({len(row) for row in out.response_ids}) >= 3, "the test needs rows of 3 lengths"
    assert forced_on.calls > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_flash_fixed_shape_loop_equals_hf_greedy(forced_on, monkeypatch, family, dtype):
    """The decode loop through the flash branch (cuda_decode's step, as on CUDA), as above: the
    kernel reads each row's own cache_seqlens, and rows that have emitted EOS stay in the batch and
    go on writing past their end, so the stand-in's bounds checks see every slot written. fp32:
    every row equals Hugging Face's greedy generate, and a sampled run equals the SDPA fixed-shape
    loop's; bf16, with the projections joined as train.py's bf16 sampler has them
    (cuda_decode.fuse_projections): every token an argmax up to a tie."""
    monkeypatch.setattr(forced_on, "ALLOW_FP32", dtype == torch.float32)
    model = lively(tiny_model(family))
    free = [hf_greedy(model, prompt, 16) for prompt in PREFILL_PROMPTS]
    eos = eos_for_mixed_lengths(free)
    if dtype == torch.bfloat16:
        model = model.to(dtype)
        cuda_decode.fuse_projections(model)
    monkeypatch.setattr(forced_on, "calls", 0)
    out = rollout.generate(model, PREFILL_PROMPTS, 16, temperature=0, eos_token_id=eos,
                           decoder=cuda_decode.decoder)
    calls = forced_on.calls
    if dtype == torch.float32:
        assert out.response_ids == [row[: row.index(eos) + 1] if eos in row else row
                                    for row in free]

        def sampled():
            return rollout.generate(model, PREFILL_PROMPTS, 12, temperature=1.0, eos_token_id=eos,
                                    decoder=cuda_decode.decoder,
                                    generator=torch.Generator().manual_seed(0))
        flash = sampled()
        monkeypatch.setattr(cuda_decode, "flash_choice", lambda device, dtype: (False, "SDPA"))
        sdpa = sampled()
        assert flash.response_ids == sdpa.response_ids
        torch.testing.assert_close(flash.token_logprobs, sdpa.token_logprobs, atol=1e-5, rtol=0)
    else:
        assert_greedy_up_to_ties(model, PREFILL_PROMPTS, out, **TIE)
    assert len({len(row) for row in out.response_ids}) >= 3, "the test needs rows of 3 lengths"
    # the decode steps went through the kernel too: more calls than the prefill's, one a layer a
    # bucket of prompts
    assert calls > rollout.PREFILL_BUCKETS * model.config.num_hidden_layers


# ---------------------------------------------------------------- the flex branch, on the CPU
# 8 rows of 1 to 127 prompt tokens: in 1, 2 and 3 blocks of cuda_decode.FLEX_BLOCK (64) slots, some
# crossing into the next block as they decode
FLEX_PROMPTS = [[(7 * i + row) % (VOCAB - 1) + 1 for i in range(length)]
                for row, length in enumerate([127, 100, 64, 60, 19, 3, 2, 1])]


@pytest.fixture
def flex_on(monkeypatch):
    """FlexAttention's branch forced on this CPU (runtime.FLEX_DECODE_ON names it); yields the
    list of its calls' block masks, each one layer's."""
    calls, attend = [], cuda_decode.flex_attention

    def recorded(q, k, v, k_cache, v_cache, positions, block_mask, scale):
        calls.append(block_mask)
        return attend(q, k, v, k_cache, v_cache, positions, block_mask, scale)
    monkeypatch.setattr(runtime, "FLEX_DECODE_ON", ("cpu",))
    monkeypatch.setattr(cuda_decode, "flex_attention", recorded)
    return calls


@pytest.mark.parametrize("family", FAMILIES)
def test_flex_generate_samples_what_sdpa_samples(flex_on, monkeypatch, family):
    """generate through cuda_decode's step, sampled at temperature 1 and greedy, EOS ending rows at
    3 or more lengths: with FlexAttention every row has the SDPA branch's tokens, and log-probs
    within 1e-5 (fp32: the two kernels sum the same products in other orders; seen 4e-6), for rows
    that read 1, 2 and 3 blocks of slots. The decode steps went through flex (the prefill stays on
    SDPA), their block masks counting each row's own blocks."""
    model = lively(tiny_model(family))

    def run(temperature, eos=None):
        return rollout.generate(model, FLEX_PROMPTS, 16, temperature, eos_token_id=eos,
                                decoder=cuda_decode.decoder,
                                generator=torch.Generator().manual_seed(0))
    eos = eos_for_mixed_lengths(run(1.0).response_ids)
    flex_on.clear()
    flex = {temperature: run(temperature, eos) for temperature in (1.0, 0.0)}
    masks = list(flex_on)
    monkeypatch.setattr(runtime, "FLEX_DECODE_ON", ())
    for temperature, out in flex.items():
        sdpa = run(temperature, eos)
        assert out.response_ids == sdpa.response_ids, temperature
        torch.testing.assert_close(out.token_logprobs, sdpa.token_logprobs, atol=1e-5, rtol=0)
    assert len(flex_on) == len(masks), "SDPA's run called flex"
    assert len({len(row) for row in flex[1.0].response_ids}) >= 3, "the test needs 3 lengths"
    layers, config = model.config.num_hidden_layers, model.config
    groups = config.num_attention_heads // config.num_key_value_heads
    assert masks and len(masks) % layers == 0
    assert all(mask.shape[-2] == groups for mask in masks)  # one new token a row: no prefill
    blocks = torch.stack([mask.kv_num_blocks.flatten() for mask in masks[::layers]])
    assert set(blocks.unique().tolist()) == {1, 2, 3}


def poison(cache):
    """Every slot of every row from its length on: NaN in the blocks of cuda_decode.FLEX_BLOCK
    slots past the row's block (a kernel that reads them gives NaN), 1e4 in the rest of its block
    (a mask that lets them through changes the scores and the output)."""
    slots = torch.arange(cache.k.shape[2])
    length = cache.seqlens.long()[:, None]
    past_block = slots // cuda_decode.FLEX_BLOCK > length // cuda_decode.FLEX_BLOCK  # (rows, slots)
    for tensor in (cache.k, cache.v):
        tensor[:, slots >= length] = 1e4
        tensor[:, past_block] = float("nan")


@pytest.mark.parametrize("family", FAMILIES)
def test_flex_reads_nothing_past_a_rows_slots(flex_on, family):
    """Before every decode step, the cache poisoned past each row's length (poison): the flex step
    samples the same tokens and log-probs, bit for bit, as on the clean cache; so it reads no block
    past the row's own (the NaN would spread) and its mask hides the slots past the row's newest
    in the row's last block (the 1e4 would win the softmax). The slot at the row's length is
    poisoned too: the step writes its new key and value there before it attends."""
    model = lively(tiny_model(family))
    clean, dirty = (started(model, FLEX_PROMPTS, 12, eos=[], top_p=0.9) for _ in range(2))
    for _ in range(11):
        poison(dirty[0])
        for cache, state, _ in (clean, dirty):
            cuda_decode.static_step(model, cache, state, None, flex=True)
    assert flex_on
    assert torch.equal(clean[1].tokens_out, dirty[1].tokens_out)
    assert torch.equal(clean[1].logprobs_out, dirty[1].logprobs_out)
    assert clean[1].logprobs_out.isfinite().all()


@pytest.mark.parametrize("family", FAMILIES)
def test_flex_step_never_waits_for_the_host(flex_on, monkeypatch, family):
    """No host sync inside the flex step (test_static_decode's AtenOps: scalar reads, nonzero,
    boolean-mask indexing), its block mask built from the rows' lengths included, with the
    projections joined as on CUDA, sampled with top-p and EOS on, rows finishing on the way. The
    compiled kernel itself runs unwatched: torch.compile runs nothing compiled under a dispatch
    mode (test_gpu.py watches it on CUDA, under torch.cuda.set_sync_debug_mode)."""
    from torch.utils._python_dispatch import _disable_current_modes

    compiled = cuda_decode.compiled_flex()

    def unwatched(*args, **kwargs):
        with _disable_current_modes():
            return compiled(*args, **kwargs)
    monkeypatch.setattr(cuda_decode, "compiled_flex", lambda: unwatched)
    model = lively(tiny_model(family))
    cuda_decode.fuse_projections(model)
    cache, state, _ = started(model, FLEX_PROMPTS, 10, eos=[3, 4, 5], top_p=0.8)
    for _ in range(9):
        with AtenOps() as ops:
            cuda_decode.static_step(model, cache, state, None, flex=True)
        assert ops.syncs == [] and ops.ops > 0
    assert len(flex_on) == 9 * model.config.num_hidden_layers


@torch.no_grad()
def test_flex_forward_attends_many_new_tokens_as_sdpa_does():
    """The flex branch is not only a decode step's: as a prefill (buckets of rows of 1 to 127 new
    tokens, up to 2 blocks of folded query rows) cuda_decode.forward with flex gives the SDPA
    prefill's logits (fp32, 1e-5; seen 1.2e-6) and keys and values. generate keeps its prefill on
    SDPA (cuda_decode.decoder)."""
    model = lively(tiny_model("qwen2"))
    prompts = sorted(FLEX_PROMPTS, key=len, reverse=True)
    caches = {flex: cache_for(model, len(prompts), 130) for flex in (True, False)}
    logits = {flex: rollout.prefill(model, prompts, caches[flex],
                                    functools.partial(cuda_decode.forward, flex=flex))
              for flex in (True, False)}
    torch.testing.assert_close(logits[True], logits[False], atol=1e-5, rtol=0)
    assert torch.equal(caches[True].seqlens, caches[False].seqlens)
    torch.testing.assert_close(caches[True].k, caches[False].k, atol=1e-5, rtol=0)


def test_flex_only_where_flash_cannot_run_and_named(standin, monkeypatch):
    """attention_choice: flash-attn first wherever flash_choice says so; else FlexAttention on the
    device types runtime.FLEX_DECODE_ON names (none by default), else SDPA; its one line says
    which, and FLEX_DECODE_ON when flex."""
    fake_gpu(monkeypatch, 9, 0)
    assert runtime.FLEX_DECODE_ON == ()
    assert cuda_decode.attention_choice(CUDA, torch.bfloat16)[0] == "flash"
    kind, line = cuda_decode.attention_choice(CUDA, torch.float32)
    assert kind == "sdpa" and "decoding with PyTorch SDPA" in line
    monkeypatch.setattr(runtime, "FLEX_DECODE_ON", ("cuda",))
    assert cuda_decode.attention_choice(CUDA, torch.bfloat16)[0] == "flash"
    kind, line = cuda_decode.attention_choice(CUDA, torch.float32)
    assert kind == "flex" and "decoding with FlexAttention (runtime.FLEX_DECODE_ON" in line
    assert "PyTorch SDPA" not in line and "\n" not in line
    assert cuda_decode.attention_choice(torch.device("cpu"), torch.float32)[0] == "sdpa"


# ---------------------------------------------------------------- the rules, on fake GPUs
@pytest.mark.parametrize("major, minor, native", [(7, 0, False), (7, 5, False), (8, 0, True),
                                                  (9, 0, True)],
                         ids=["sm70", "sm75", "sm80", "sm90"])
def test_auto_dtype_is_bf16_only_where_the_gpu_computes_it(monkeypatch, major, minor, native):
    """--dtype auto: bf16 on compute capability 8.0 and up; fp32 on a V100 (7.0) or T4 (7.5),
    whose bf16 torch.cuda.is_bf16_supported() reports as supported (emulated). An explicit
    --dtype bfloat16 is kept."""
    fake_gpu(monkeypatch, major, minor)
    assert torch.cuda.is_bf16_supported()  # torch's default answer counts emulation
    assert runtime.bf16_is_native(CUDA) is native
    assert runtime.compute_dtype("auto", CUDA) == (torch.bfloat16 if native else torch.float32)
    assert runtime.compute_dtype("bfloat16", CUDA) == torch.bfloat16


@pytest.mark.parametrize("major, minor, dtype, use, says", [
    (8, 0, torch.bfloat16, True, "decoding with flash_attn_with_kvcache"),
    (9, 0, torch.float16, True, "decoding with flash_attn_with_kvcache"),
    (8, 6, torch.float32, False, "fp16 or bf16, this run in float32"),
    (7, 5, torch.bfloat16, False, "compute capability 8.0 or higher (Ampere or newer), this GPU "
                                  "has 7.5"),
    (7, 0, torch.float16, False, "this GPU has 7.0"),
], ids=["sm80-bf16", "sm90-fp16", "sm86-fp32", "sm75-bf16", "sm70-fp16"])
def test_flash_only_where_its_kernel_runs(standin, monkeypatch, major, minor, dtype, use, says):
    """flash-attn installed and importable (the stand-in): flash_choice uses it on CUDA in
    fp16/bf16 from compute capability 8.0 on, and says so; elsewhere it says SDPA and why, in the
    one line train.py and eval.py print."""
    fake_gpu(monkeypatch, major, minor)
    choice, reason = cuda_decode.flash_choice(CUDA, dtype)
    assert choice is use and says in reason and "\n" not in reason
    assert ("PyTorch SDPA" in reason) is not use


def test_flash_nowhere_else(standin, monkeypatch):
    """Not on a CPU, even with flash-attn importable: generate runs on SDPA there (the stand-in is
    never called). Not where flash-attn is missing, on any GPU."""
    choice, reason = cuda_decode.flash_choice(torch.device("cpu"), torch.bfloat16)
    assert not choice and "CUDA only" in reason
    for decoder in (rollout.own_decoder, cuda_decode.decoder):
        rollout.generate(tiny_model("qwen3").bfloat16(), PROMPTS, 4, temperature=0,
                         decoder=decoder)
    assert standin.calls == 0
    fake_gpu(monkeypatch, 9, 0)
    sys.modules.pop("flash_attn")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(STANDIN)])
    cuda_decode.flash_attn_status.cache_clear()
    choice, reason = cuda_decode.flash_choice(CUDA, torch.bfloat16)
    assert not choice and reason == "flash-attn is not installed: decoding with PyTorch SDPA"


def test_start_takes_its_gpu_before_the_process_group(monkeypatch):
    """torchrun's second node of two, 2 GPUs each, its second process (RANK 3, LOCAL_RANK 1):
    runtime.start takes GPU 1 (the local rank; the global one is 3), sets it before joining the
    process group, hands it to NCCL as device_id (else NCCL binds to cuda:0 until first use), and
    returns the global rank; auto is bf16 on this fake sm80."""
    calls = []
    fake_gpu(monkeypatch, 8, 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set", device)))
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **kwargs: calls.append(("init", backend,
                                                                kwargs.get("device_id"))))
    monkeypatch.setattr(dist, "is_initialized", lambda: any(c[0] == "init" for c in calls))
    monkeypatch.setattr(dist, "get_rank", lambda: 3)
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    for name, value in dict(RANK="3", LOCAL_RANK="1", WORLD_SIZE="4").items():
        monkeypatch.setenv(name, value)
    rank, world_size, device, dtype = runtime.start("auto")
    gpu = torch.device("cuda", 1)
    assert calls == [("set", gpu), ("init", "nccl", gpu)]
    assert (rank, world_size, device, dtype) == (3, 4, gpu, torch.bfloat16)


# ---------------------------------------------------------------- the acceptance script
def test_gpu_check_runs_on_a_cpu(tmp_path, letter_model, monkeypatch):
    """gpu_check.py --allow-cpu on the letter-choice model: the machine, sampler and train parts
    run their real code (the train part launches train.py under torchrun), the CUDA-only checks
    say why they do not, and the report has every part; a part that fails (a model that does not
    exist) says FAIL with the reason and sets the exit status."""
    from lab import gpu_check

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # torchrun's worker: a tiny model, one thread
    tiny = letter_model(tmp_path)
    base = ["--allow-cpu", "--model", str(tiny["model"]), "--workdir", str(tmp_path / "work")]
    report = tmp_path / "report.md"
    assert gpu_check.main([*base, "--task", str(tiny["task"]), "--parts", "sampler", "train",
                           "--out", str(report)]) == 0
    text = report.read_text()
    for line in ("| machine | INFO |", "| sampler | PASS |", "| train | PASS |",
                 "flash not checked: decoding with PyTorch SDPA: flash-attn runs on CUDA only"):
        assert line in text, text
    assert gpu_check.main([*base, "--model", str(tmp_path / "none"), "--task", str(tiny["task"]),
                           "--parts", "sampler", "--out", str(report)]) == 1
    text = report.read_text()
    assert "| sampler | FAIL |" in text and str(tmp_path / "none") in text


# (name, compute capability, what --logprob-dtype auto picks): bf16x6 where dense bf16 tensor cores
# run ~15x fp32 or more (docs/precision.md's table), fp32 where 2-4x, and where bf16 GEMMs with an
# fp32 output do not run (before 8.0)
CARDS = [("V100", (7, 0), torch.float32), ("T4", (7, 5), torch.float32),
         ("A10", (8, 6), torch.float32), ("L4", (8, 9), torch.float32),
         ("RTX 4090", (8, 9), torch.float32), ("RTX 5090", (12, 0), torch.float32),
         ("A100", (8, 0), "bf16x6"), ("H100", (9, 0), "bf16x6"), ("H200", (9, 0), "bf16x6"),
         ("B200", (10, 0), "bf16x6")]


@pytest.mark.parametrize("card, capability, picked", CARDS, ids=[card for card, *_ in CARDS])
def test_logprob_dtype_auto_is_bf16x6_only_on_the_cards_where_it_runs_and_pays(
        monkeypatch, card, capability, picked):
    """--logprob-dtype auto on CUDA, by the card torch.cuda reports: bf16x6 on A100, H100, H200 and
    B200, fp32 elsewhere (a V100 or T4 would crash in the first no-grad pass; an A10, L4 or RTX
    4090 would run six products slower than one fp32 GEMM). bf16x6 named outright on a card before
    8.0 stops with a one-line error; on the others it runs as asked. A CPU is fp32 whatever the
    card rule says."""
    from systems import split_matmul

    monkeypatch.setattr(split_matmul, "OUT_DTYPE", True)  # torch 2.8 or later
    fake_gpu(monkeypatch, *capability)
    assert runtime.logprob_dtype("auto", CUDA) == picked
    assert runtime.logprob_dtype("float32", CUDA) == torch.float32
    assert runtime.logprob_dtype("auto", torch.device("cpu")) == torch.float32
    if capability < (8, 0):
        with pytest.raises(SystemExit) as stop:
            runtime.logprob_dtype("bf16x6", CUDA)
        message = str(stop.value)
        assert "error: --logprob-dtype bf16x6 needs bf16 tensor cores" in message
        assert f"this GPU has {capability[0]}.{capability[1]}" in message and "\n" not in message
    else:
        assert runtime.logprob_dtype("bf16x6", CUDA) == "bf16x6"


def test_logprob_dtype_keeps_the_rules_pick_and_fp32_where_torch_lacks_out_dtype(monkeypatch):
    """On a card where bf16x6 pays, auto is the registered rule's pick (bf16x6, or whatever it had
    picked); with torch older than 2.8 (no out_dtype GEMM) auto is fp32 and bf16x6 named outright
    stops in one line; a CPU runs bf16x6 when named (exact products) and fp32 on auto."""
    from systems import split_matmul

    cpu = torch.device("cpu")
    fake_gpu(monkeypatch, 9, 0)
    assert runtime.CUDA_LOGPROB_DTYPE == "bf16x6"  # the rule's pick on the H200 (2026-11-28)
    monkeypatch.setattr(split_matmul, "OUT_DTYPE", False)  # torch before 2.8
    assert runtime.logprob_dtype("auto", CUDA) == torch.float32
    with pytest.raises(SystemExit, match="needs torch.mm's out_dtype"):
        runtime.logprob_dtype("bf16x6", CUDA)
    assert runtime.logprob_dtype("bf16x6", cpu) == "bf16x6"
    monkeypatch.setattr(split_matmul, "OUT_DTYPE", True)
    monkeypatch.setattr(runtime, "CUDA_LOGPROB_DTYPE", "bfloat16")  # had the rule picked bf16
    assert runtime.logprob_dtype("auto", CUDA) == torch.bfloat16
    assert runtime.logprob_dtype("auto", cpu) == torch.float32
    assert runtime.logprob_dtype("bfloat16", cpu) == torch.bfloat16


def test_generate_rows_auto_counts_the_allocators_unused_memory_as_free(monkeypatch):
    """After a training pass PyTorch's caching allocator keeps its temporaries' memory reserved:
    the driver reports it used, yet a new KV cache can take it. --generate-rows auto counts it
    (else each step after the first samples fewer rows a call than the memory allows)."""
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 60 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 35 * gib)
    assert runtime.cuda_free_for_tensors(CUDA) == 35 * gib


def test_every_capture_warms_up_and_records_on_one_side_stream(monkeypatch):
    """cuBLAS keeps a workspace (32 MiB on a Hopper card) for each stream that has run a GEMM, in
    PyTorch's allocator until the process ends: a new side stream per capture held one more for
    each span the sampler captured. With torch.cuda's streams and graphs recorded: one side stream
    for the process (cuda_decode.capture_stream), and each capture's warm-up and recording on it.
    test_gpu.py checks the memory itself."""
    streams, used, steps = [], [], []

    class Stream:
        def wait_stream(self, other):
            pass

    def new_stream(device=None):
        streams.append(Stream())
        return streams[-1]

    @contextlib.contextmanager
    def on_stream(stream):
        used.append(("warm-up", stream))
        yield

    @contextlib.contextmanager
    def recording(graph, pool=None, stream=None):
        used.append(("record", stream))
        yield

    monkeypatch.setattr(torch.cuda, "Stream", new_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", on_stream)
    monkeypatch.setattr(torch.cuda, "graph", recording)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", object)
    cuda_decode.capture_stream.cache_clear()
    try:
        for span in (128, 256, 384):  # a new span, a new graph (cuda_decode.decoder)
            cuda_decode.capture(lambda span=span: steps.append(span), None,
                            cuda_decode.capture_stream(CUDA))
    finally:
        cuda_decode.capture_stream.cache_clear()
    assert len(streams) == 1
    assert used == [("warm-up", streams[0]), ("record", streams[0])] * 3
    assert steps == [128, 128, 256, 256, 384, 384]  # run once on the stream, then recorded


@pytest.mark.parametrize("flex", [False, True], ids=["sdpa", "flex"])
def test_the_fixed_shape_loop_captures_each_span_once_on_the_one_stream(monkeypatch, flex):
    """The decode loop through cuda_decode.decoder on a cache that says it is on CUDA, with
    capture recorded (it runs the step once, as the real one's warm-up does, and its graph's replay
    runs the step): each span is captured once (with FlexAttention, which reads each row's own
    slots, one capture for every span), every capture gets the process's one side stream, and the
    replays give the eager fixed-shape loop's tokens and log-probs."""
    monkeypatch.setattr(runtime, "FLEX_DECODE_ON", ("cpu",) if flex else ())
    model = lively(tiny_model("qwen2"))
    monkeypatch.setattr(rollout, "SPAN_BUCKET", 4)  # a new span every 4 steps
    # (flex: the flex tests' rows, whose compile it shares)
    prompts, steps = FLEX_PROMPTS if flex else [[5, 6, 7], [8, 9]], 14

    def decoded(cuda_graphs):
        cache, logits, _ = rollout.cache_for_prompts(model, prompts, steps)
        uniforms = torch.rand(len(prompts), steps, generator=torch.Generator().manual_seed(0),
                              dtype=torch.float64)
        state = rollout.new_decoding(uniforms, torch.tensor([], dtype=torch.long), 1.0, 1.0)
        with monkeypatch.context() as cuda:
            cuda.setattr(torch.Tensor, "is_cuda", property(lambda tensor: True))
            step = cuda_decode.decoder(model, cuda_graphs=cuda_graphs)[1]
            rollout.sample_loop(model, cache, logits, state, step)
        return state

    streams, captured = [], []

    class Graph:
        def __init__(self, step):
            self.replay = step

    def capture(step, pool, stream):
        captured.append(stream)
        step()  # the warm-up; the recording runs nothing
        return Graph(step)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: streams.append(object())
                        or streams[-1])
    monkeypatch.setattr(cuda_decode, "capture", capture)
    cuda_decode.capture_stream.cache_clear()
    try:
        graphed, eager = decoded(True), decoded(False)
    finally:
        cuda_decode.capture_stream.cache_clear()
    assert len(streams) == 1 and captured == streams * (1 if flex else 4)  # spans 4, 8, 12, 16
    assert torch.equal(graphed.tokens_out, eager.tokens_out)
    assert torch.equal(graphed.logprobs_out, eager.logprobs_out)
