"""rollout.py's fixed-shape decode loop (every row every step), through rollout's own step and
through systems/cuda_decode.py's (the GPU's, run eagerly here), checked on a CPU with tiny random
Llama, Qwen2 and Qwen3 models in fp32 (test_rollout.py's):

- each token is the one its pre-drawn uniform picks from the model's own full forward pass (or a
  tie), both steps draw the same samples, greedy rows are Hugging Face's greedy generate's, and
  log-probs equal the full forward pass's, with EOS ending rows at mixed lengths, at temperature 0
  and 1, top-p 1 and 0.8; a row's sample depends on the seed and its row index only;
- what lets a GPU replay the step as a CUDA graph: no host sync inside a step, and one "all done?"
  per rollout.ALL_DONE_EVERY steps over a whole generate (counted with a TorchDispatchMode); the
  cache's and the step's tensors keep their addresses; torch.compile(fullgraph=True) traces the
  step without a graph break (backend "eager": it only traces);
- the compiled step (cuda_decode.compiled_step, a decoder layer's two regions around attention
  compiled for every layer): one graph a region over a train.py-shaped run of generate calls
  (Inductor's guards included), no sync inside them, and with Inductor the plain step's samples;
- the step's aten ops no more than Hugging Face generate's per step.
The flash branch of the loop runs in test_cuda_paths.py (the stand-in), the graphs in test_gpu.py,
the benchmark's CPU run in test_bench_decode below.
"""
import dataclasses
import functools
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

import rollout
from systems import cuda_decode, runtime
from test_rollout import (FAMILIES, PROMPTS, VOCAB, assert_cut_at_eos, eos_for_mixed_lengths,
                          hf_greedy, lively, nucleus_logprobs, reference_logprobs, tiny_model)

ROOT = Path(__file__).resolve().parents[1]
# 7 rows of 1-19 prompt tokens, one prompt twice: more rows than rollout.PREFILL_BUCKETS
MIXED = PROMPTS + [[9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12], [60, 61]]
# two fp32 logits this close are a tie: rounding may break it either way (classroom E7's rule)
TIE = 1e-4
pytestmark = pytest.mark.usefixtures("one_thread")


class AtenOps(TorchDispatchMode):
    """Counts the aten ops run inside it. `ops`: those that are not views (each a dispatch, most a
    kernel launch on a GPU: issue 34's count). `syncs`: those that make the host wait for the
    device: a scalar read (.item(), int(t), bool(t), `if t.any()`: _local_scalar_dense,
    is_nonzero), nonzero, masked_select, and indexing with a boolean mask (index, index_put with a
    bool index: the result's size is the mask's count)."""
    SYNCS = {"_local_scalar_dense", "is_nonzero", "item", "nonzero", "masked_select", "equal"}

    def __init__(self):
        super().__init__()
        self.ops, self.syncs = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops += not func.is_view
        masked = (name in ("index", "index_put", "index_put_", "_index_put_impl_")
                  and any(i is not None and i.dtype == torch.bool for i in args[1]))
        if name in self.SYNCS or masked:
            self.syncs.append(name)
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def started(model, prompts, max_new_tokens, eos, temperature=1.0, top_p=1.0, seed=0):
    """generate's fixed-shape loop up to its first step: the prefilled cache and the state after
    token 0. Returns (cache, state, span), span = every slot of the cache (a valid SDPA span)."""
    cache, logits, row_of_slot = rollout.cache_for_prompts(model, prompts, max_new_tokens)
    generator = torch.Generator().manual_seed(seed)
    uniforms = torch.rand(len(prompts), max_new_tokens, generator=generator, dtype=torch.float64)
    state = rollout.new_decoding(uniforms[row_of_slot], torch.tensor(eos, dtype=torch.long),
                                 temperature, top_p)
    rollout.record_sample(logits, state)
    return cache, state, cache.k.shape[2]


def tensors(cache, state):
    """The addresses of every tensor the step reads or writes."""
    fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
    named = {"cache.k": cache.k, "cache.v": cache.v, "cache.seqlens": cache.seqlens, **fields}
    return {name: t.data_ptr() for name, t in named.items() if isinstance(t, torch.Tensor)}


# ---------------------------------------------------------------- the same samples
def assert_differs_at_a_tie(model, prompt, ours, theirs, temperature, top_p, uniforms):
    """Two token rows of one prompt drawn with the same uniforms agree, or first differ where the
    model's own full forward pass puts them at a tie: greedy, two logits within TIE; sampled, the
    row's uniform within TIE of the boundary between the two tokens in the CDF."""
    if ours == theirs:
        return
    t = next((t for t, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    assert t is not None, f"same tokens, another length: {ours} against {theirs}"
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ours[:t]])).logits[0, -1].double()
    if temperature == 0:
        assert abs(logits[ours[t]] - logits[theirs[t]]) < TIE, (t, ours, theirs)
        return
    probs = torch.softmax(logits / temperature, -1)
    if top_p < 1:
        probs = nucleus_logprobs(probs.log()[None], top_p)[0].exp()
    cdf = probs.cumsum(0)
    boundary = cdf[min(ours[t], theirs[t])]
    assert abs(uniforms[t] - boundary) < TIE, (t, ours, theirs)


@pytest.mark.parametrize("temperature, top_p", [(0.0, 1.0), (1.0, 1.0), (1.0, 0.8)],
                         ids=["greedy", "T1", "T1-top-p0.8"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_same_samples_as_the_full_forward_pass(family, temperature, top_p):
    """rollout's step and cuda_decode's from the same seed, EOS ending rows at 3 or more lengths:
    every token of rollout's is the one its uniform picks by inverse CDF from the model's own full
    forward pass (or a tie), cuda_decode's rows equal rollout's (or first differ at a tie), greedy
    rows equal Hugging Face's generate, and every log-prob equals the full forward pass's (1e-4, as
    test_rollout.py's) and the other step's; a CPU's default decoder (runtime.sampler_decoder, what
    train.py samples with here) is rollout's own: the same tokens and log-probs, bit for bit."""
    model = lively(tiny_model(family))

    def run(decoder, eos_token_id):
        return rollout.generate(model, MIXED, 16, temperature, top_p, eos_token_id=eos_token_id,
                                generator=torch.Generator().manual_seed(0), decoder=decoder)
    eos = eos_for_mixed_lengths(run(rollout.own_decoder, None).response_ids)
    # out[True]: rollout's own step; out[False]: cuda_decode's; default: a CPU's default
    out = {own: run(rollout.own_decoder if own else cuda_decode.decoder, eos)
           for own in (True, False)}
    default = run(runtime.sampler_decoder(torch.device("cpu")), eos)
    assert torch.equal(default.tokens, out[True].tokens)
    assert torch.equal(default.token_logprobs, out[True].token_logprobs)
    uniforms = torch.rand(len(MIXED), 16, generator=torch.Generator().manual_seed(0),
                          dtype=torch.float64)  # generate's own draw
    assert len({len(row) for row in out[True].response_ids}) >= 3, "the test needs 3 lengths"
    for row, prompt in enumerate(MIXED):
        ours, today = out[True].response_ids[row], out[False].response_ids[row]
        assert_differs_at_a_tie(model, prompt, ours, today, temperature, top_p, uniforms[row])
        assert_drawn_by_its_uniforms(model, prompt, ours, temperature, top_p, uniforms[row])
        if temperature == 0:
            hf = hf_greedy(model, prompt, 16, eos_token_id=eos)
            assert_differs_at_a_tie(model, prompt, ours, hf, 0, 1, None)
        logp, response = reference_logprobs(model, prompt, ours, temperature or 1.0)
        if top_p < 1:
            logp = nucleus_logprobs(logp, top_p)
        expected = (logp.gather(-1, response[:, None])[:, 0] if temperature
                    else torch.zeros(len(ours)))
        torch.testing.assert_close(torch.tensor(out[True].response_logprobs[row]), expected,
                                   atol=1e-4, rtol=0)
        if ours == today:
            assert out[True].response_logprobs[row] == pytest.approx(
                out[False].response_logprobs[row], abs=1e-4)
    for name in ("tokens", "token_logprobs", "response_mask"):  # padding after each row's end
        assert getattr(out[True], name).shape == getattr(out[False], name).shape
    assert torch.equal(out[True].response_mask, out[False].response_mask)


def assert_drawn_by_its_uniforms(model, prompt, ours, temperature, top_p, uniforms):
    """Each token of `ours` is the one its uniform picks by inverse CDF (float64) from the model's
    own full forward pass over the prompt and the tokens before it (greedy: its argmax), or a
    tie (assert_differs_at_a_tie); a row shorter than `uniforms` ends at its first EOS (its
    caller's check: the masks)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1:-1].double()
    for t, token in enumerate(ours):
        if temperature == 0:
            pick = int(logits[t].argmax())
        else:
            probs = torch.softmax(logits[t] / temperature, -1)
            if top_p < 1:
                probs = nucleus_logprobs(probs.log()[None], top_p)[0].exp()
            cdf = probs.cumsum(0)
            pick = min(int(torch.searchsorted(cdf, uniforms[t] * cdf[-1], right=True)),
                       len(cdf) - 1)
        if pick != token:
            assert_differs_at_a_tie(model, prompt, ours, ours[:t] + [pick], temperature, top_p,
                                    uniforms)
            return


def test_a_row_depends_on_the_seed_and_its_index_only():
    """The fixed-shape loop, sampled: a row of a batch equals the same prompt run alone with the
    same seed; with EOS on, each row is its EOS-free sample cut after the first EOS, however the
    other rows finish (finished rows stay in the batch and keep drawing)."""
    model = tiny_model("qwen2")

    def run(prompts, eos_token_id=None):
        return rollout.generate(model, prompts, 14, temperature=1.0, eos_token_id=eos_token_id,
                                generator=torch.Generator().manual_seed(3))
    assert run(PROMPTS[1:]).response_ids[0] == run(PROMPTS[1:2]).response_ids[0]
    free = run(PROMPTS * 3)
    eos = sorted(range(VOCAB), key=lambda t: -sum(t in row for row in free.response_ids))[:2]
    out = run(PROMPTS * 3, eos)
    for row, cut in enumerate(assert_cut_at_eos(out, free, eos)):
        assert not out.tokens[row, cut:].any() and not out.token_logprobs[row, cut:].any()



@pytest.mark.parametrize("decoder", [rollout.own_decoder, cuda_decode.decoder],
                         ids=["rollout", "cuda_decode"])
def test_rows_in_chunks_are_the_samples_of_one_call(decoder):
    """generate(max_rows=3, then 4) on 9 rows (chunks of 3, 3, 3, then 4, 4, 1), sampled with
    top-p 0.8 and EOS at mixed lengths: every row equals one call's (or first
    differs at a tie: another batch size may round a logit otherwise), log-probs within 1e-5, and
    the outputs keep one call's shapes and padding."""
    model = lively(tiny_model("llama3"))
    prompts = MIXED + [[4, 4, 4]] * 2

    def run(max_rows, eos_token_id=None):
        return rollout.generate(model, prompts, 16, 1.0, 0.8, eos_token_id=eos_token_id,
                                generator=torch.Generator().manual_seed(5), decoder=decoder,
                                max_rows=max_rows)
    eos = eos_for_mixed_lengths(run(None).response_ids)
    whole = run(None, eos)
    assert len({len(row) for row in whole.response_ids}) >= 3, "the test needs 3 lengths"
    uniforms = torch.rand(len(prompts), 16, generator=torch.Generator().manual_seed(5),
                          dtype=torch.float64)  # generate's own draw
    for max_rows in (3, 4):
        chunked = run(max_rows, eos)
        for row, prompt in enumerate(prompts):
            ours, one_call = chunked.response_ids[row], whole.response_ids[row]
            assert_differs_at_a_tie(model, prompt, ours, one_call, 1.0, 0.8, uniforms[row])
            if ours == one_call:
                assert chunked.response_logprobs[row] == pytest.approx(
                    whole.response_logprobs[row], abs=1e-5)
        assert chunked.tokens.shape == whole.tokens.shape
        assert torch.equal(chunked.response_mask, whole.response_mask)
        assert not (chunked.tokens * (1 - chunked.response_mask.long())).any()
    with pytest.raises(ValueError, match="max_rows"):
        run(0)



@pytest.mark.parametrize("family", FAMILIES)
def test_kv_bytes_is_the_cache_prefilled_allocates(family):
    """kv_bytes, which --generate-rows auto divides the free GPU memory by, counts exactly the K
    and V tensors cache_for_prompts allocates (grouped-query heads, the model's dtype)."""
    model = tiny_model(family).to(torch.bfloat16)
    cache, _, _ = rollout.cache_for_prompts(model, MIXED, 7)
    allocated = sum(t.numel() * t.element_size() for t in (cache.k, cache.v))
    assert runtime.kv_bytes(model, len(MIXED), max(map(len, MIXED)) + 7) == allocated


# ---------------------------------------------------------------- what a CUDA graph needs
def test_the_counter_sees_each_kind_of_sync():
    """AtenOps itself: it counts a scalar read, an `if` on a tensor, nonzero and boolean-mask
    indexing (read and write), and not integer indexing."""
    x = torch.tensor([0, 3, 0, 5])
    reads = [lambda: x.sum().item(), lambda: int(x.max()), lambda: bool(x.any()),
             lambda: x.nonzero(), lambda: x[x > 0], lambda: x.clone().__setitem__(x > 0, 1)]
    for read in reads:
        with AtenOps() as ops:
            read()
        assert ops.syncs, read
    with AtenOps() as ops:
        x[torch.tensor([1, 3])] = x.cumsum(0)[torch.tensor([0, 1])]
    assert not ops.syncs and ops.ops > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_a_step_never_waits_for_the_host(family):
    """No sync inside the decode step (rollout's, and cuda_decode's with fused projections),
    sampled with top-p and EOS on (the most ops), rows finishing on the way."""
    model = lively(tiny_model(family))
    caches = {fast: started(model, MIXED, 10, eos=[3, 4, 5], top_p=0.8) for fast in (False, True)}
    cuda_decode.fuse_projections(model)  # rollout's own forward reads the views
    for _ in range(9):
        for fast, (cache, state, span) in caches.items():
            with AtenOps() as ops:
                (cuda_decode.static_step if fast else rollout.sample_step)(model, cache, state,
                                                                           span)
            assert ops.syncs == [], fast


def test_generate_asks_the_host_once_every_k_steps():
    """Over a whole generate with EOS on, the decode loop adds at most one sync per
    rollout.ALL_DONE_EVERY steps to what the prefill and the result's width take (a generate of
    one token: no decode step)."""
    model = tiny_model("llama3")

    def syncs(max_new_tokens):
        with AtenOps() as ops:
            rollout.generate(model, MIXED, max_new_tokens, eos_token_id=[VOCAB - 1],
                             generator=torch.Generator().manual_seed(0))
        return len(ops.syncs)
    k, base = rollout.ALL_DONE_EVERY, syncs(1)
    for steps in (k, 3 * k + 2):
        assert syncs(steps) - base <= math.ceil((steps - 1) / k), steps


def test_the_step_writes_in_place():
    """The cache's and the step's tensors keep their addresses from step to step, also when rows
    finish (they stay in the batch): what lets one captured CUDA graph replay every step."""
    model = lively(tiny_model("llama3"))
    free = [hf_greedy(model, prompt, 12) for prompt in MIXED]
    cache, state, span = started(model, MIXED, 12, eos=[eos_for_mixed_lengths(free)],
                                 temperature=0.0)
    before = tensors(cache, state)
    for _ in range(11):
        rollout.sample_step(model, cache, state, span)
        assert tensors(cache, state) == before
    assert state.done.any() and not state.done.all(), "the test needs rows that finish"


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_step_traces_as_one_graph(family, fused):
    """torch.compile(fullgraph=True) raises at the first graph break; backend "eager" only traces
    (seconds on a CPU). The traced step gives the eager step's tokens and log-probs, also with the
    projections joined as train.py's sampler has them (cuda_decode.fuse_projections, through
    cuda_decode's step; separate: rollout's own step)."""
    model = tiny_model(family)
    if fused:
        cuda_decode.fuse_projections(model)
    plain = cuda_decode.static_step if fused else rollout.sample_step
    torch._dynamo.reset()
    step = torch.compile(plain, fullgraph=True, backend="eager")
    eager, traced = (started(model, MIXED, 5, eos=[3], top_p=0.8) for _ in range(2))
    for _ in range(4):
        plain(model, *eager)
        step(model, *traced)
    assert torch.equal(eager[1].tokens_out, traced[1].tokens_out)
    torch.testing.assert_close(eager[1].logprobs_out, traced[1].logprobs_out)


def smollm2_layout():
    """A random model of SmolLM2-135M's layout (30 layers, 9 heads on 3 key/value heads, tied
    head) at a width of 72: an op count does not depend on the width."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=72, intermediate_size=96,
                                        num_hidden_layers=30, num_attention_heads=9,
                                        num_key_value_heads=3, tie_word_embeddings=True)).eval()


@pytest.mark.parametrize("temperature, top_p", [(0.0, 1.0), (1.0, 0.8)], ids=["greedy", "top-p"])
@pytest.mark.parametrize("family", FAMILIES + ["smollm2-layout"])
def test_a_step_runs_no_more_ops_than_hf_generate(family, temperature, top_p):
    """Aten ops that are not views, per decode step: ours (one step, cuda_decode's and rollout's
    own) against Hugging
    Face's generate on the same model and rows (its per step: the ops of 6 new tokens minus those
    of 4, over 2), sampling alike (EOS on, top_k off). Seen on SmolLM2's layout: ours 1,091 greedy,
    1,105 at top-p 0.8; Hugging Face's 1,323 and 1,344."""
    model = smollm2_layout() if family == "smollm2-layout" else tiny_model(family)
    prompts = [[5, 6, 7, 8 + row] for row in range(4)]
    ours = {}
    for step in (cuda_decode.static_step, rollout.sample_step):
        cache, state, span = started(model, prompts, 8, eos=[VOCAB - 1], temperature=temperature,
                                     top_p=top_p)
        with AtenOps() as ops:
            step(model, cache, state, span)
        ours[step.__module__] = ops.ops
    ids = torch.tensor(prompts)

    def hf(new):
        sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
        with AtenOps() as ops:
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                           eos_token_id=VOCAB - 1, pad_token_id=0,
                           **(sampling if temperature else dict(do_sample=False)))
        return ops.ops
    theirs = (hf(6) - hf(4)) / 2
    assert max(ours.values()) <= theirs, (ours, theirs)


# ---------------------------------------------------------------- the benchmark, on a CPU
def test_bench_decode_runs_on_a_cpu(tmp_path):
    """`python -m lab.bench_rollout --decode --allow-cpu` at its tiny CPU shapes: every part in the
    JSON, each sampler's step time and HBM-floor fraction, the greedy EOS-on rates, the profile (a
    decode step's ops: one attention call a layer, the prefill's cancelled) and the sync check (on
    a CPU: the dispatch counter's)."""
    out = tmp_path / "decode.json"
    command = ["--decode", "--allow-cpu", "--out", str(out), "--threads", "1", "--steps", "2", "4",
               "--repeats", "1", "--eos-tokens", "8", "--profile", "tiny:4"]
    result = subprocess.run([sys.executable, "-m", "lab.bench_rollout", *command], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    steps = report["step_ms"]
    assert {row["sampler"] for row in steps} >= {"ours eager", "ours plain", "hf eager"}
    for row in steps:  # a step's ms is t(4) - t(2) over 2 steps: on a loaded CPU it can be < 0
        assert math.isfinite(row["ms"]) and row["floor_ms"] > 0, row
        assert row["floor_fraction"] == pytest.approx(row["floor_ms"] / row["ms"]), row
        assert row["ms_repeats"] == [row["ms"]], row  # one repeat: its median is itself
    assert {row["sampler"] for row in report["eos_on"]} >= {"ours eager", "hf eager"}
    assert all(row["useful_tokens_per_s"] > 0 for row in report["eos_on"])
    assert report["syncs"]["ok"], report["syncs"]
    assert "floor" in result.stdout
    (profile,) = report["profile"]  # ours eager: a CPU has no graphs
    assert (profile["model"], profile["batch"], profile["sampler"]) == ("tiny", 4, "ours eager")
    calls = {row["kernel"]: row["calls_per_step"] for row in profile["kernels"]}
    assert calls["aten::scaled_dot_product_attention"] == 2, calls  # the tiny shape's 2 layers
    # --eos-tokens 0: no EOS-on part (a GPU slot's time for the step rows); --samplers: only those
    command[command.index("--eos-tokens") + 1] = "0"
    subprocess.run([sys.executable, "-m", "lab.bench_rollout", *command[:-2], "--samplers",
                    "ours eager", "hf eager"], cwd=ROOT, check=True, capture_output=True, timeout=300)
    first = report
    report = json.loads(out.read_text())
    assert report["eos_on"] == [] and report["syncs"]["ok"], report
    assert [row["sampler"] for row in report["step_ms"]] == ["ours eager", "hf eager"], report
    # one bandwidth for a run's commands: --measure-bandwidth prints it, --bandwidth divides by it
    # (the floor moves with the figure alone); --no-sync-check: no sync part
    measured = subprocess.run([sys.executable, "-m", "lab.bench_rollout", "--measure-bandwidth"],
                              cwd=ROOT, check=True, capture_output=True, text=True, timeout=300)
    assert float(measured.stdout) > 0, measured.stdout
    subprocess.run([sys.executable, "-m", "lab.bench_rollout", *command[:-2], "--samplers",
                    "ours eager", "--bandwidth", "2.5", "--no-sync-check"], cwd=ROOT, check=True,
                   capture_output=True, timeout=300)
    report = json.loads(out.read_text())
    assert report["read_bandwidth_GBps"] == 2.5 and report["read_bandwidth_from"] == "--bandwidth"
    assert report["syncs"] is None and report["skipped"] == [], report
    (row,) = report["step_ms"]
    before = next(r for r in first["step_ms"] if r["sampler"] == "ours eager")
    assert row["floor_ms"] == pytest.approx(before["floor_ms"] * first["read_bandwidth_GBps"] / 2.5)
    refused = subprocess.run([sys.executable, "-m", "lab.bench_rollout", "--decode", "--allow-cpu",
                              "--bandwidth", "0"], cwd=ROOT, capture_output=True, text=True)
    assert refused.returncode == 2 and "--bandwidth must be a positive" in refused.stderr


def test_bench_decode_writes_each_repeat_as_it_goes(tmp_path):
    """A GPU slot's timeout keeps what finished: the JSON holds each sampler's repeats so far, read
    here while the run goes on (then killed), as a whole file each time (written, then renamed)."""
    out = tmp_path / "decode.json"
    command = ["--decode", "--allow-cpu", "--out", str(out), "--threads", "1", "--steps", "2", "4",
               "--repeats", "200", "--eos-tokens", "0", "--batches", "2"]
    run = subprocess.Popen([sys.executable, "-m", "lab.bench_rollout", *command], cwd=ROOT,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    partial, deadline = [], time.monotonic() + 240
    try:
        while not partial and run.poll() is None and time.monotonic() < deadline:
            if out.exists():
                rows = json.loads(out.read_text())["step_ms"]
                partial = [row for row in rows if 0 < len(row["ms_repeats"]) < 200]
            time.sleep(0.01)
    finally:
        run.kill()
        _, stderr = run.communicate()
    assert partial, f"no row was written before its last repeat: {stderr[-2000:]}"
    for row in partial:
        ordered = sorted(row["ms_repeats"])
        assert row["ms"] == ordered[len(ordered) // 2], row
        assert row["floor_fraction"] == pytest.approx(row["floor_ms"] / row["ms"]), row


def test_the_compiled_step_plumbs_through_generate(monkeypatch):
    """The compiled decoder (runtime.sampler_decoder(compiled=True), train.py --compile-sampler)
    runs cuda_decode.compiled_step in the decode loop (traced here with a backend that runs the
    traced graph as it is), whose compiled graphs are a decoder layer's two regions around
    attention, without the sampler, each run for both layers, and samples what the plain step
    samples; rollout's own decoder (a CPU's default) never compiles. One trace a region
    serves every span and cache length (other prompts and max_new_tokens): a specialized compile
    would trace again."""
    model = tiny_model("qwen3")
    torch._dynamo.reset()
    calls, traces = [], []

    def backend(graph_module, example_inputs):
        traces.append(graph_module.code)
        return graph_module.forward

    def traced():
        calls.append(1)
        return compiled_step(backend=backend)
    compiled_step = cuda_decode.compiled_step
    monkeypatch.setattr(cuda_decode, "compiled_step", traced)

    def run(compiled, prompts=MIXED, max_new_tokens=10):
        decoder = runtime.sampler_decoder(torch.device("cpu"), compiled)
        return rollout.generate(model, prompts, max_new_tokens, 1.0, 0.8, eos_token_id=[3],
                                generator=torch.Generator().manual_seed(1), decoder=decoder)
    plain, compiled = run(False), run(True)
    assert calls == [1] and len(traces) == 2
    # the model's part only: Inductor's split scan fails on the sampler's cumsum (pytorch#180221)
    assert all("linear" in trace and "cumsum" not in trace and "sort" not in trace
               for trace in traces)
    assert plain.response_ids == compiled.response_ids
    torch.testing.assert_close(plain.token_logprobs, compiled.token_logprobs)
    run(False)
    assert calls == [1]
    run(True, prompts=[p + [5, 6, 7] for p in MIXED], max_new_tokens=6)  # a new span and length
    assert calls == [1, 1] and len(traces) == 2, traces
    torch._dynamo.reset()


def graph_counter(graphs, backend=None, ops=None):
    """A torch.compile backend that appends each graph it is given to `graphs` and runs it with
    `backend` (torch._inductor's compile_fx, say), or as traced; `ops`: a list that gets, for each
    run of the graph, an AtenOps of the ops it ran (Dynamo runs no compiled code under a dispatch
    mode, so the counter runs inside the graph)."""
    def compile_graph(graph_module, example_inputs):
        graphs.append(graph_module.code)
        run = backend(graph_module, example_inputs) if backend else graph_module.forward
        if ops is None:
            return run

        def counted(*args):
            with AtenOps() as counter:
                out = run(*args)
            ops.append(counter)
            return out
        return counted
    return compile_graph


def test_the_compiled_step_compiles_once_in_a_train_run(monkeypatch):
    """train.py --compile-sampler compiles a decoder layer's two regions once each, for every
    layer of every generate call of a run (cuda_decode.compiled_step, a regional compile, by
    Inductor as on a GPU: its guards, not only Dynamo's, decide a recompile): the calls differ in
    their prompts' lengths (the cache's length), in rows (--generate-rows auto chunks a step's
    rows by the memory free then), and their spans run from rollout.SPAN_BUCKET up to the cache's
    length (max_new_tokens above SPAN_BUCKET, as train.py's 1,024: span below max_len) or sit at
    it from the first step (short responses). A compile per layer, per span, per length or per
    row count would show as a third graph: each a minute or more at the 7B shape on a GPU. Each
    call samples what the plain step samples. The projections joined, as train.py's sampler on a
    GPU has them."""
    from torch._inductor.compile_fx import compile_fx

    model = lively(tiny_model("qwen2"))
    cuda_decode.fuse_projections(model)
    torch._dynamo.reset()
    graphs = []
    monkeypatch.setattr(cuda_decode, "compiled_step",
                        functools.partial(cuda_decode.compiled_step,
                                          graph_counter(graphs, backend=compile_fx)))
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)  # a region's second
    spans = set()

    def recorded(compiled):  # cuda_decode's decoder, recording which spans the steps read
        def decoder(model):
            forward, step = cuda_decode.decoder(model, compiled)

            def record(model, cache, state, span):
                spans.add("below max_len" if span < cache.k.shape[2] else "max_len")
                step(model, cache, state, span)
            return forward, record
        return decoder
    calls = [  # (prompts: a step's problems, each G = 2 times; max_new_tokens; EOS; max_rows)
        ([p for p in MIXED[:3] for _ in range(2)], 20, [3], None),  # span = max_len from step 1
        ([p + [9] * 5 for p in MIXED[2:5] for _ in range(2)], 140, None, None),  # 128, max_len
        ([p for p in MIXED[1:] for _ in range(2)], 140, None, 5),  # chunks of 5, 5 and 2 rows
    ]
    for prompts, max_new_tokens, eos, max_rows in calls:
        plain, compiled = (rollout.generate(model, prompts, max_new_tokens, 1.0, 0.8,
                                            eos_token_id=eos, max_rows=max_rows,
                                            generator=torch.Generator().manual_seed(2),
                                            decoder=recorded(compiled))
                           for compiled in (False, True))
        assert plain.response_ids == compiled.response_ids
        torch.testing.assert_close(plain.token_logprobs, compiled.token_logprobs)
    assert spans == {"below max_len", "max_len"}, spans
    assert len(graphs) == 2, f"{len(graphs)} graphs compiled (one a region: 2)"
    torch._dynamo.reset()


@pytest.mark.parametrize("family", FAMILIES)
def test_the_compiled_step_never_waits_for_the_host(family):
    """No sync in the compiled layer's graph, counted as it runs (graph_counter), sampled with
    top-p and EOS on: the graph every layer of the compiled step runs; the rest of the step is
    static_step's own code (test_a_step_never_waits_for_the_host)."""
    model = lively(tiny_model(family))
    cuda_decode.fuse_projections(model)
    torch._dynamo.reset()
    graphs, ops = [], []
    step = cuda_decode.compiled_step(graph_counter(graphs, ops=ops))
    cache, state, span = started(model, MIXED, 10, eos=[3, 4, 5], top_p=0.8)
    for _ in range(9):
        step(model, cache, state, span)
    assert len(graphs) == 2 and len(ops) == 9 * 2 * model.config.num_hidden_layers
    assert all(counter.ops > 0 and counter.syncs == [] for counter in ops)
    torch._dynamo.reset()


def test_inductor_compiles_the_layer_on_a_cpu():
    """Inductor itself, as train.py --compile-sampler runs it (C++ kernels on a CPU; its one graph
    took 26 s on a shared core, 7 s from Inductor's cache): generate(compiled=True) samples the
    plain step's tokens, log-probs up to Inductor's float rounding, at two calls of other lengths
    and rows, from one compile."""
    from torch._dynamo.utils import counters

    model = lively(tiny_model("llama3"))
    cuda_decode.fuse_projections(model)
    torch._dynamo.reset()
    counters.clear()
    for prompts, max_new_tokens in ((MIXED, 10), ([p + [5, 6, 7] for p in MIXED[:4]], 6)):
        plain, compiled = (rollout.generate(model, prompts, max_new_tokens, 1.0, 0.8,
                                            eos_token_id=[3],
                                            decoder=functools.partial(cuda_decode.decoder,
                                                                      compiled=compiled),
                                            generator=torch.Generator().manual_seed(3))
                           for compiled in (False, True))
        assert plain.response_ids == compiled.response_ids
        torch.testing.assert_close(plain.token_logprobs, compiled.token_logprobs)
    assert counters["stats"]["unique_graphs"] == 2  # one a region
    torch._dynamo.reset()


def test_a_cpu_samples_with_rollouts_own_loop(monkeypatch):
    """A CPU's default decoder (runtime.sampler_decoder, what train.py and eval.py sample with
    here) is rollout.py's own loop, the code a reader reads (classroom E7's `decode`): each decode
    step calls rollout.decode once for every row, attends through rollout.sdpa_attention once a
    layer over one span common to the rows, and draws with rollout.inverse_cdf; nothing of
    systems/cuda_decode.py runs."""
    model = tiny_model("llama3").eval()
    decodes, spans, draws = [], [], []
    decode, attention, inverse_cdf = rollout.decode, rollout.sdpa_attention, rollout.inverse_cdf

    def recorded_attention(q, k, v, k_cache, v_cache, positions, bias, scale):
        if positions.shape[1] == 1:  # a decode step's call: (its rows, the span read)
            spans.append((len(positions), bias.shape[-1]))
        return attention(q, k, v, k_cache, v_cache, positions, bias, scale)
    monkeypatch.setattr(rollout, "decode", lambda model, tokens, *rest: decodes.append(
        len(tokens)) or decode(model, tokens, *rest))
    monkeypatch.setattr(rollout, "sdpa_attention", recorded_attention)
    monkeypatch.setattr(rollout, "inverse_cdf", lambda probs, uniform: draws.append(
        len(probs)) or inverse_cdf(probs, uniform))
    for name in ("forward", "static_step", "inverse_cdf", "decoder_layer"):
        monkeypatch.setattr(cuda_decode, name, lambda *a, **k: pytest.fail("cuda_decode ran"))
    decoder = runtime.sampler_decoder(torch.device("cpu"))
    rollout.generate(model, MIXED, 5, eos_token_id=None, generator=torch.Generator().manual_seed(0),
                     decoder=decoder)
    layers = model.config.num_hidden_layers
    assert decoder is rollout.own_decoder
    assert decodes == [len(MIXED)] * 4 and draws == [len(MIXED)] * 5, (decodes, draws)
    assert len(spans) == 4 * layers and all(rows == len(MIXED) for rows, _ in spans), spans
