"""The sampler's GPU speed machinery: rollout.sample_step, the same computation, made fast.

It wraps rollout.py's forward and step, never copies them: rollout.forward's one layer loop runs
this module's parts (attention_setup, decoder_layer, rms_norm), and `decoder` hands the wrapped
forward and step to rollout.generate, chosen once where the sampler is made
(runtime.sampler_decoder), as gpt-fast rebinds its decode_one_token to torch.compile(
decode_one_token, mode="reduce-overhead") in main(). rollout.py imports nothing from here; a CPU
samples with rollout.py's own parts. On a GPU a decode step is many small kernels, each launched
from Python, which the GPU runs faster than Python launches them. What this module does about it,
each measured in docs/benchmarks.md:
- CUDA graphs (capture, capture_stream): the step, which reads and writes only rollout.Decoding's
  tensors in place and never syncs with the host, is captured once per attention span and
  replayed; the span is a multiple of rollout.SPAN_BUCKET, so one graph serves that many steps.
- torch.compile of the step's decoder layers, regionally: the two regions of a layer around its
  attention, each compiled once, run in every layer (compiled_step, opt-in: train.py
  --compile-sampler).
- Fused projections (fuse_projections): each layer's q/k/v and gate/up weights as one GEMM each.
- Fewer kernels for the same formulas: RMSNorm through F.rms_norm (one fused kernel on CUDA where
  the module runs seven; on a CPU the module's own ops, bit for bit), rope with its sign folded
  into sin, and on q and k as one tensor where the projections are fused.
- Attention with flash_attn_with_kvcache where flash_choice says so (CUDA, fp16 or bf16, compute
  capability 8.0 or higher, flash-attn importable): it reads each row's own cache_seqlens slots,
  where SDPA reads a span common to all rows. flash-attn is never imported at module level.
  Where flash-attn cannot run, the decode step attends with PyTorch's FlexAttention on the devices
  runtime.FLEX_DECODE_ON names (attention_choice): compiled, it too reads only each row's own
  blocks of FLEX_BLOCK slots (flex_block_mask), with no host sync.
- Inverse-CDF sampling by blocks of CDF_BLOCK tokens (inverse_cdf), the same tokens as rollout's
  one float64 cumsum up to float64 rounding, for a fraction of its memory traffic.
Every one computes what rollout.py's own step computes: tests/test_static_decode.py,
tests/test_cuda_paths.py (the flash branch against a CPU stand-in, the flex branch on the CPU) and
tests/test_gpu.py.
"""
import functools
import importlib.util

import torch
import torch.nn.functional as F

import rollout

CDF_BLOCK = 1024  # inverse_cdf's blocks of tokens: it sums the blocks, then cumsums inside one
FLEX_BLOCK = 64  # flex_attention's blocks of slots: a row reads the blocks its slots lie in


# ---------------------------------------------------------------- the decoder generate takes
def decoder(model, compiled=False, cuda_graphs=True):
    """(forward, step) for one generate's rows of `model`: rollout.forward and rollout.sample_step
    with this module's parts. forward, for the prefill: fused projections where fuse_projections
    joined them, fused norms, flash-attn where flash_choice says so. step: the same forward (with
    FlexAttention where attention_choice says so) and inverse_cdf by blocks, its layers compiled
    with `compiled`, and on CUDA captured as a CUDA graph per span and replayed (cuda_graphs=False
    runs it eagerly, to debug). rollout.generate takes it as its `decoder` (with `compiled` and
    `cuda_graphs` bound: systems/runtime.sampler_decoder)."""
    check_fused(model)
    param = next(model.parameters())
    attention = attention_choice(param.device, param.dtype)[0]
    flash, flex = attention == "flash", attention == "flex"
    step = functools.partial(compiled_step() if compiled else static_step, flash=flash, flex=flex)
    if not (cuda_graphs and param.is_cuda):
        return functools.partial(forward, flash=flash), step
    graphs, pool = {}, torch.cuda.graph_pool_handle()  # one at a time: one memory pool

    def replay(model, cache, state, span):
        span = None if flash or flex else span  # each row's own slots: one graph for all
        if span in graphs:
            graphs[span].replay()
        else:  # runs this step, then records it
            graphs[span] = capture(lambda: step(model, cache, state, span), pool,
                                   capture_stream(cache.k.device))
    return functools.partial(forward, flash=flash), replay


@torch.no_grad()
def static_step(model, cache, state, span, flash=False, flex=False, regions=(None, None)):
    """rollout.sample_step through this module's forward (`regions`: compiled_step's compiled
    forms of attention_inputs_of and layer_output) and block inverse CDF: every row feeds its
    last token and samples its next one, no host sync."""
    rollout.sample_step(model, cache, state, span,
                        functools.partial(forward, flash=flash, flex=flex, regions=regions),
                        draw=inverse_cdf)


@functools.cache
def compiled_step(backend="inductor"):
    """static_step with its decoder layers compiled by torch.compile (Inductor on CUDA; the tests
    trace it with other backends too), regionally: each of a layer's two regions around attention,
    attention_inputs_of (the input norm, the q/k/v projections, rope) and layer_output (the output
    projection, the residuals, the MLP and its norm), is compiled once, and its one graph runs in
    every layer, the layer's weights being its inputs (PyTorch's recipe "Reducing torch.compile
    cold start compilation time with regional compilation"). The regions fuse the layer's
    elementwise ops into fewer kernels. Attention and its cache writes stay outside (the span a
    step reads would make Inductor compile again; Dynamo cannot trace flash-attn's kernel), and
    so does sampling (Inductor cannot compile its cumsum fused with the softmax before it).
    Symbolic shapes from the first call (dynamic=True): the rows change from call to call in a
    run; a chunk of one row compiles once more (PyTorch specializes sizes 0 and 1). Opt-in
    (train.py --compile-sampler). Its compile times and the failures behind each choice:
    docs/benchmarks.md, "Why the GPU machinery is as it is"."""
    def compiled(region):
        region = torch.compile(region, fullgraph=True, dynamic=True, backend=backend)
        # the norms' eps as constants (symbolic, the graph would read each from a tensor)
        return torch._dynamo.config.patch(specialize_float=True)(region)
    regions = (compiled(attention_inputs_of), compiled(layer_output))
    return functools.partial(static_step, regions=regions)


@functools.cache
def capture_stream(device):
    """The one side stream on which every capture of the process warms up and records: cuBLAS keeps
    a workspace for each stream it has run a GEMM on until the process ends, so a new stream per
    capture would hold one more for each span (docs/gpu.md)."""
    return torch.cuda.Stream(device)


def capture(step, pool, stream):
    """Run step() once, eagerly on the side `stream` (the warm-up CUDA graphs need: cuBLAS
    workspaces, kernel choices), then record it there as a CUDA graph whose replay() is the next
    step: a replay launches the whole recorded step at once, where eagerly the GPU waits on Python
    to launch each small kernel."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        step()  # recorded, not run
    return graph


# ---------------------------------------------------------------- the GPU's parts of forward
def decode(model, tokens, cache, span, flash=False, flex=False):
    """rollout.decode through this module's forward: next-token logits (rows, V), float32."""
    return rollout.decode(model, tokens, cache, span,
                          functools.partial(forward, flash=flash, flex=flex))


def forward(model, input_ids, cache, span, flash=False, flex=False, regions=(None, None)):
    """rollout.forward (its one layer loop) with this module's parts: attention_setup's mask and
    sin, decoder_layer for each layer, rms_norm for the last norm. SDPA reads slots 0..span-1 of
    every row; flash and flex (span unused) each row's own seqlens + L (flex: rounded up to whole
    FLEX_BLOCKs)."""
    return rollout.forward(
        model, input_ids, cache, span,
        setup_fn=functools.partial(attention_setup, flash=flash, flex=flex),
        layer_fn=functools.partial(decoder_layer, flash=flash, flex=flex, regions=regions),
        norm_fn=rms_norm)


def attention_setup(model, cache, positions, span, cos, sin, flash=False, flex=False):
    """rollout.attention_setup for this module's attention: the mask (SDPA's causal bias, flex's
    block mask, or for flash the rows' filled slots, cache.seqlens, which it masks by), and sin
    with rope's sign folded in (signed_sin)."""
    groups = model.config.num_attention_heads // model.config.num_key_value_heads
    if flash:
        mask = cache.seqlens
    elif flex:
        mask = flex_block_mask(positions, groups, cache.k.shape[2])
    else:
        mask = rollout.causal_bias(positions, span, groups, cache.k.dtype)
    return mask, cos, signed_sin(sin)


def decoder_layer(layer, x, k_cache, v_cache, positions, mask, cos, sin, flash=False, flex=False,
                  regions=(None, None)):
    """rollout.decoder_layer in fewer kernels: attention, its K/V written into this layer's cache
    rows k_cache, v_cache (n, max_len, kv_heads, head_dim) at positions (n, L), then the MLP,
    each with its residual, written into x. `mask`: attention_setup's. `regions`: the compiled
    forms of attention_inputs_of and layer_output (compiled_step), each compiled once for every
    layer."""
    inputs, output = regions
    q, k, v = (inputs or attention_inputs_of)(layer, x, cos, sin)
    attn = layer.self_attn
    if flash:
        out = flash_attention(q, k, v, k_cache, v_cache, mask, attn.scaling)
    elif flex:
        out = flex_attention(q, k, v, k_cache, v_cache, positions, mask, attn.scaling)
    else:
        out = rollout.sdpa_attention(q, k, v, k_cache, v_cache, positions, mask, attn.scaling)
    return (output or layer_output)(layer, x, out)


def attention_inputs_of(layer, x, cos, sin):
    """The layer's q, k and v from the hidden states x (n * L, hidden): its input norm, then
    attention_inputs (cos, sin: (n, L, 1, head_dim))."""
    n, L = cos.shape[:2]
    return attention_inputs(layer.self_attn, rms_norm(layer.input_layernorm, x), n, L, cos, sin)


def layer_output(layer, x, out):
    """The layer's output from its input x (n * L, hidden) and attention's out (n, L, ...): the
    output projection and its residual, then the MLP on the normed sum and its residual. The sums
    are written into x (the same numbers): its caller's frame still holds x while this runs, so a
    new sum would keep one more hidden state alive through the MLP."""
    x = x.add_(layer.self_attn.o_proj(out.reshape(x.shape[0], -1)))
    return x.add_(mlp(layer.mlp, rms_norm(layer.post_attention_layernorm, x)))


def rms_norm(norm, x):
    """Hugging Face's RMSNorm module `norm` applied to x, the three families' formula with its
    normalizing in one F.rms_norm call: on CUDA one fused kernel (_fused_rms_norm) where the module
    runs seven (to fp32, pow, mean, add, rsqrt, mul, back to x's dtype); on a CPU the module's own
    ops, the same bits (torch 2.13's composite: an older one may round eps differently)."""
    # x / sqrt(mean(x^2) + eps) in fp32, rounded to x's dtype, then times the weight
    return norm.weight * F.rms_norm(x, x.shape[-1:], eps=norm.variance_epsilon)


def signed_sin(sin):
    """(-sin1, sin2) from sin = (sin1, sin2) (..., head_dim): rope's sign, folded in once a step."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rope(x, cos, sin):
    """rollout.rope with sin from signed_sin: rotate_half(x) sin = (x2, x1) (-sin1, sin2), the
    same numbers ((-a) b = a (-b) exactly), one kernel (the negation) less."""
    half = x.shape[-1] // 2
    # rope: x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1); in place, two of x's size live
    rotated = torch.cat((x[..., half:], x[..., :half]), dim=-1).mul_(sin)
    return (x * cos).add_(rotated)


def attention_inputs(attn, h, n, L, cos, sin):
    """The layer's q (n, L, heads, head_dim), k and v (n, L, kv_heads, head_dim) from the normed
    hidden states h (n * L, hidden): Qwen3's per-head norms and rope applied. Where
    fuse_projections joined q, k and v (and no per-head norm comes between), q and k lie side by
    side in the one GEMM's output and take rope as one tensor: half the rope kernels."""
    head_dim = attn.head_dim
    if hasattr(attn, "fused") and not hasattr(attn, "q_norm"):
        weight, bias, sizes = attn.fused
        qkv = F.linear(h, weight, bias).view(n, L, -1, head_dim)
        num_q, num_qk = sizes[0] // head_dim, (sizes[0] + sizes[1]) // head_dim
        qk = rope(qkv[:, :, :num_qk], cos, sin)
        return qk[:, :, :num_q], qk[:, :, num_q:], qkv[:, :, num_qk:]
    q, k, v = (t.view(n, L, -1, head_dim)
               for t in projections(attn, ("q_proj", "k_proj", "v_proj"), h))
    if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm on each head before rope
        q, k = rms_norm(attn.q_norm, q), rms_norm(attn.k_norm, k)
    return rope(q, cos, sin), rope(k, cos, sin), v


def mlp(module, h):
    """The three families' MLP, down(act(gate(h)) * up(h)), gate and up from one GEMM where they are
    fused; the product in place and its factors freed before down runs, so it holds no more memory
    than Hugging Face's own."""
    gate, up = projections(module, ("gate_proj", "up_proj"), h)
    hidden = module.act_fn(gate).mul_(up)
    del gate, up
    return module.down_proj(hidden)


# ---------------------------------------------------------------- fused projections
def fuse_projections(model):
    """Join each layer's q, k and v projections into one weight, and its MLP's gate and up
    projections into another, the separate weights becoming views into them (no second copy): a
    decode step then runs 4 GEMMs a layer, not 7 (vLLM's QKVParallelLinear and
    MergedColumnParallelLinear, gpt-fast's wqkv; why: docs/benchmarks.md). Weights replaced
    afterwards (`.to()`, a load) leave the fused ones stale: fuse again (as
    runtime.refresh_sampler does); fast refuses a model whose fused weights are stale.
    rollout.py's own forward reads the separate weights, views of the fused ones."""
    for layer in model.model.layers:
        fuse(layer.self_attn, ("q_proj", "k_proj", "v_proj"))
        fuse(layer.mlp, ("gate_proj", "up_proj"))


def unfuse_projections(model):
    """Drop fuse_projections' fused weights: forward runs each projection on its own again (the
    weights stay views of the fused ones, and keep them alive, until they are replaced)."""
    for module in model.modules():
        vars(module).pop("fused", None)


@torch.no_grad()
def fuse(module, names):
    """module.fused = (weight, bias or None, output sizes): module's linear layers `names` side by
    side along their outputs, each layer's weight (and bias) now a view into them."""
    linears = [getattr(module, name) for name in names]
    weight = torch.cat([linear.weight for linear in linears])
    bias = None if linears[0].bias is None else torch.cat([linear.bias for linear in linears])
    sizes = [linear.out_features for linear in linears]
    for linear, rows in zip(linears, weight.split(sizes)):
        linear.weight.data = rows
    for linear, rows in zip(linears, [] if bias is None else bias.split(sizes)):
        linear.bias.data = rows
    module.fused = (weight, bias, sizes)


def projections(module, names, h):
    """module's linear layers `names` applied to h: one GEMM where fuse_projections fused them,
    else one each."""
    if hasattr(module, "fused"):
        weight, bias, sizes = module.fused
        return F.linear(h, weight, bias).split(sizes, dim=-1)
    return [getattr(module, name)(h) for name in names]


def check_fused(model):
    """Refuse fused weights that are no longer those the layers hold (replaced after fusing)."""
    for layer in model.model.layers:
        for module, first in ((layer.self_attn, "q_proj"), (layer.mlp, "gate_proj")):
            weight = getattr(module, first).weight
            if hasattr(module, "fused") and (weight.untyped_storage().data_ptr()
                                             != module.fused[0].untyped_storage().data_ptr()):
                raise ValueError("the model's weights were replaced after fuse_projections: fuse "
                                 "them again (cuda_decode.unfuse_projections, then "
                                 "fuse_projections)")


# ---------------------------------------------------------------- sampling by blocks
def inverse_cdf(probs, uniform):
    """rollout.inverse_cdf in two levels over a vocabulary of 16 blocks of CDF_BLOCK tokens or
    more: the same token as one cumsum over the whole vocabulary up to float64 rounding, for a
    fraction of its memory traffic: the blocks' sums find the block, a cumsum inside it the
    token. Under 16 blocks, rollout's one cumsum (fewer ops). probs (n, V), uniform (n,); returns
    (tokens (n, 1), total mass (n, 1))."""
    n, V = probs.shape
    if V < 16 * CDF_BLOCK:
        return rollout.inverse_cdf(probs, uniform)
    # whole blocks (the padding's zero mass is never drawn), and the CDF at each block's end
    blocks = F.pad(probs, (0, -V % CDF_BLOCK)).view(n, -1, CDF_BLOCK)
    block_cdf = blocks.sum(-1, dtype=torch.float64).cumsum(-1)  # (n, blocks)
    total = block_cdf[:, -1:]
    target = uniform[:, None] * total
    block = torch.searchsorted(block_cdf, target, right=True).clamp(max=block_cdf.shape[1] - 1)
    # the mass of the blocks before it, and its own tokens
    mass_before = torch.where(block > 0, block_cdf.gather(-1, (block - 1).clamp(min=0)), 0)
    inside = blocks.gather(1, block[:, :, None].expand(n, 1, CDF_BLOCK))[:, 0]  # (n, CDF_BLOCK)
    index = torch.searchsorted(inside.cumsum(-1, dtype=torch.float64), target - mass_before,
                               right=True)
    # rounding may put the target past the block's own sum: then its last token of nonzero mass
    last = (inside > 0).cumsum(-1).argmax(-1, keepdim=True)
    return block * CDF_BLOCK + torch.minimum(index, last), total


# ---------------------------------------------------------------- flash-attn
@functools.cache
def flash_attn_status():
    """(usable, reason): whether flash-attn imports here, probed once. A wheel built for another
    torch or CUDA is found by find_spec but fails on import; that must show at start-up, not inside
    the first decode after a 7B model has loaded (flash_choice reports it; generate() then uses
    SDPA)."""
    if importlib.util.find_spec("flash_attn") is None:
        return False, "flash-attn is not installed: decoding with PyTorch SDPA"
    try:
        from flash_attn import flash_attn_with_kvcache  # noqa: F401
    except Exception as error:  # noqa: BLE001
        # ImportError, OSError (undefined symbol), RuntimeError
        message = (str(error).splitlines() or [type(error).__name__])[0]
        return False, (f"flash-attn is installed but does not import ({message}): "
                       "decoding with PyTorch SDPA")
    return True, "flash-attn imports: decoding with flash_attn_with_kvcache on CUDA"


def flash_choice(device, dtype):
    """(use, reason): whether generate() attends with flash_attn_with_kvcache for a model on
    `device` in `dtype`, and the one line train.py and eval.py print. flash-attn 2's kernel runs on
    CUDA in fp16 or bf16 only, and only on compute capability 8.0 or higher (Ampere, Hopper, ...):
    on a V100 (7.0) or T4 (7.5) it installs and imports, then refuses the first call
    (flash_api.cpp: "FlashAttention only supports Ampere GPUs or newer"). Checked here, before any
    model loads; then the import (flash_attn_status)."""
    sdpa = "decoding with PyTorch SDPA"
    if device.type != "cuda":
        return False, f"{sdpa}: flash-attn runs on CUDA only, this device is {device.type}"
    if dtype not in (torch.float16, torch.bfloat16):
        return False, (f"{sdpa}: flash-attn computes in fp16 or bf16, this run in "
                       f"{str(dtype).removeprefix('torch.')}")
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return False, (f"{sdpa}: flash-attn 2 needs compute capability 8.0 or higher (Ampere or "
                       f"newer), this GPU has {major}.{minor}")
    return flash_attn_status()


def flash_attention(q, k, v, k_cache, v_cache, seqlens, scale):
    """The CUDA branch of attention: one kernel writes k, v at slots seqlens.. of each row and
    attends causally."""
    from flash_attn import flash_attn_with_kvcache

    return flash_attn_with_kvcache(
        q, k_cache, v_cache, k=k, v=v, cache_seqlens=seqlens, softmax_scale=scale, causal=True
    )


# ---------------------------------------------------------------- FlexAttention
def attention_choice(device, dtype):
    """(kind, line): what generate()'s decode steps attend with, "flash", "flex" or "sdpa", and the
    one line train.py and eval.py print. flash-attn where flash_choice says so; else FlexAttention
    on the device types runtime.FLEX_DECODE_ON names (the prefill stays on SDPA); else SDPA."""
    from systems import runtime  # (runtime imports this module)

    use, line = flash_choice(device, dtype)
    if use:
        return "flash", line
    if device.type in runtime.FLEX_DECODE_ON:
        return "flex", line.replace("decoding with PyTorch SDPA", "decoding with FlexAttention "
                                    "(runtime.FLEX_DECODE_ON; the prefill with SDPA)")
    return "sdpa", line


def flex_block_mask(positions, groups, max_len):
    """The BlockMask of flex_attention for n rows of L new tokens at positions (n, L) over a cache
    of max_len slots, each row's `groups` query heads of one key/value head folded into its query
    rows (groups * L of them, group-major as sdpa_attention folds them). A row reads blocks 0..b
    of FLEX_BLOCK slots, b the block of its newest position, and inside them the slots its causal
    mask lets through (mask_mod): built from tensors, no host sync."""
    from torch.nn.attention.flex_attention import BlockMask

    n, L = positions.shape
    # query blocks of 128 folded rows (a decode step's `groups` fit in one); counts from shapes
    q_blocks, kv_blocks = -(-groups * L // 128), -(-max_len // FLEX_BLOCK)
    # blocks a row reads, the same for each of its query blocks: up to its newest slot's
    kv_num_blocks = (positions[:, -1] // FLEX_BLOCK + 1).int()[:, None, None]
    kv_num_blocks = kv_num_blocks.expand(n, 1, q_blocks).contiguous()
    kv_indices = torch.arange(kv_blocks, dtype=torch.int32, device=positions.device)
    kv_indices = kv_indices.expand(n, 1, q_blocks, kv_blocks).contiguous()
    start = positions[:, 0].contiguous()
    static_rows(kv_num_blocks, kv_indices, start)

    def causal(b, h, q_idx, kv_idx):  # the query at folded row q_idx sits at start + q_idx % L
        return kv_idx <= start[b] + q_idx % L
    return BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=(128, FLEX_BLOCK),
                                    mask_mod=causal, seq_lengths=(groups * L, max_len),
                                    compute_q_blocks=False)  # no backward


@functools.cache
def compiled_flex():
    """flex_attention compiled by Inductor: eagerly it materializes every score and reads every
    slot (the block mask's counts unused), so it runs compiled, as PyTorch's docs ask. Shapes:
    dynamic, so one compile serves every cache length (max_len changes from one generate call to
    the next); flex_attention marks the heads and head_dim static, and flex_attention (below) the
    rows: Inductor's decode kernel (flex_decoding, query rows under 128, split over the slots)
    needs the rows and heads static, else it runs its general kernel. So: a compile per number of
    rows (and per dtype and model shape), plus one where the first call's cache held one block.
    Past torch._dynamo's recompile_limit (8 compiles) flex_attention would run eagerly (the same
    numbers, slowly). Inductor's decode kernel also wants a power-of-two ratio of query to
    key/value heads: flex_attention folds each key/value head's query heads into its rows, a
    ratio of 1 (Qwen2.5-7B's 28 on 4 heads, SmolLM2's 9 on 3, would not qualify unfolded)."""
    from torch.nn.attention.flex_attention import flex_attention as flex

    return torch.compile(flex, dynamic=True, fullgraph=True)


def flex_attention(q, k, v, k_cache, v_cache, positions, block_mask, scale):
    """The FlexAttention branch of attention, for the decode step: rollout.sdpa_attention's
    arguments with flex_block_mask's mask for the bias. Writes k, v at each row's positions, then
    attends over the cache (n, kv_heads, max_len, d) with each key/value head's `groups` query
    heads folded into its query rows (grouped-query attention without repeating the keys: one
    head's groups * L rows, as sdpa_attention folds them). Returns (n, L, kv_heads, groups, d)."""
    n, L, _, head_dim = q.shape
    kv_heads = k.shape[2]
    rows = torch.arange(n, device=q.device)[:, None]
    k_cache[rows, positions] = k
    v_cache[rows, positions] = v
    q = (q.view(n, L, kv_heads, -1, head_dim).permute(0, 2, 3, 1, 4)
         .reshape(n, kv_heads, -1, head_dim))
    keys, values = k_cache.transpose(1, 2), v_cache.transpose(1, 2)  # views
    static_rows(q, keys, values)
    out = compiled_flex()(q, keys, values, block_mask=block_mask, scale=scale)
    return out.view(n, kv_heads, -1, L, head_dim).permute(0, 3, 1, 2, 4)


def static_rows(*tensors):
    """Mark the tensors' first dimension, the rows, static for compiled_flex (its decode kernel
    needs them static); inside a compiled step (compiled_step) the step's own compile decides."""
    if not torch.compiler.is_compiling():
        for tensor in tensors:
            torch._dynamo.mark_static(tensor, 0)
