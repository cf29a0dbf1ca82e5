"""Our own batched sampler with a preallocated KV cache: rollouts y_1:T ~ pi_theta(.|x) of Sec. 2.

RL spends most of its time here. We reuse the Hugging Face model's own modules and weights
(embeddings, q/k/v/o projections with their biases, rotary embedding with its rope scaling, MLP,
tied or untied lm_head; the RMSNorms' weights and epsilons, Qwen3's q/k norms too) and write only
the attention, the cache, and the RMSNorm and rope formulas (in fewer kernels; on a CPU the
modules' numbers bit for bit, on CUDA the fused norm sums in its own order) ourselves, for the
Llama, Qwen2 and Qwen3 families.

The exact variant:
- Cache: one tensor per K and V of shape (layers, rows, max_len, kv_heads, head_dim), the layout of
  `flash_attn_with_kvcache`. Row b holds its own prompt from slot 0 (no left padding), so the token
  at slot j has position j, exactly as Hugging Face places an unpadded prompt. `seqlens[b]` counts
  its slots.
- Rows are sorted longest prompt first. Prefill runs each distinct prompt once (the trainer passes
  each prompt G times) in buckets of similar length, each padded only to its own longest prompt, and
  copies its K/V to the rows that share it; decode then runs one token per row, by one of two loops:
  - compaction (`generate(static=False)`, the default on a CPU): a row that emits EOS leaves the
    batch: the last live rows move into its cache slots, so the next steps run on fewer rows, and
    SDPA attends per bucket of rows over the slots of the bucket's own longest row. Each of these
    choices asks the host for a number (a sync) and gives a new shape when a row finishes: on a
    CPU, where a step is compute-bound, they save work.
  - fixed shape (`static=True`, the default on CUDA): `static_step` runs every row every step; a
    finished row stays in place (its next tokens are padding, log-prob 0, mask 0), all its inputs
    and outputs live in tensors written in place (`Decoding`), and nothing in it waits for the
    host; the host asks "all done?" once every ALL_DONE_EVERY steps. On CUDA the step is captured
    once as a CUDA graph and replayed (`capture`; `cuda_graphs=False` runs it eagerly, to debug).
  Both loops draw the same tokens from the same uniforms: they differ only in float rounding.
- Sampling: the temperature tau scales the logits (T is the response length, as in the paper);
  top-p keeps the smallest set of most likely tokens whose mass reaches p (the token that crosses
  p included: Hugging Face's TopPLogitsWarper rule) and renormalizes. The returned log-prob of
  each token is under exactly that distribution, log softmax(z / tau) renormalized over the
  nucleus: log pi_theta_old(o_t | x, o_<t) of eq. (4). temperature=0 is greedy, a point mass, so
  its log-probs are 0 (= log 1). Tokens are drawn by inverse CDF (float64 sums; over a large
  vocabulary by blocks, inverse_cdf) with one uniform per (row, step) taken from `generator` up
  front, so a row's sample depends on the seed and its row index only, not on when the other rows
  finish.
- Attention: `flash_attn_with_kvcache` where `flash_choice(device, dtype)` says so (CUDA, fp16 or
  bf16, compute capability 8.0 or higher, flash-attn importable): it reads each row's own
  `cache_seqlens` slots, with no host sync, so it serves both loops as it is. PyTorch's
  scaled_dot_product_attention over the same cache otherwise, with an additive mask built on the
  device from the rows' lengths; SDPA has no per-row lengths, so the rows read a common span of
  slots: in the compaction loop each bucket of rows its own longest row's, in the fixed-shape loop
  all rows the longest row's rounded up to SPAN_BUCKET, known on the host without asking the
  device (every row grows one slot a step), so one graph serves SPAN_BUCKET steps. train.py and
  eval.py print flash_choice's reason, so what they say is what runs. The flash branch is tested on
  a CPU against a pure-PyTorch stand-in of the kernel (tests/test_cuda_paths.py), on a GPU by
  tests/test_gpu.py and lab/gpu_check.py.
- Projections: on a GPU, where train.py samples from a bf16 copy of the policy
  (runtime.make_sampler), each layer's q/k/v and gate/up weights are fused into one GEMM each
  (fuse_projections; the separate weights become views into them, so Hugging Face's forward still
  reads them); forward runs either kind.
- Norms and rope: the modules' own formulas in fewer kernels, for a GPU step whose small kernels
  cost more than their work: RMSNorm through F.rms_norm (one fused kernel on CUDA where the module
  runs seven; the module's own ops on a CPU), rope with its sign folded into sin, and on q and k
  as one tensor where the projections are fused (rms_norm, rope, attention_inputs).
"""
import functools
import importlib.util
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FAMILIES = ("llama", "qwen2", "qwen3")
BUCKETS = 4  # rows are split into this many buckets of similar length (prefill; SDPA attention)
ALL_DONE_EVERY = 8  # the fixed-shape loop asks "all rows done?" (a host sync) every this many steps
SPAN_BUCKET = 128  # the fixed-shape loop's SDPA span: a multiple of this (one CUDA graph each)
CDF_BLOCK = 1024  # inverse_cdf's blocks of tokens: it sums the blocks, then cumsums inside one


@dataclass
class Rollout:
    tokens: torch.Tensor  # (B, T) int64, response ids right-padded with 0
    token_logprobs: torch.Tensor  # (B, T) float32, log-prob of each sampled token, 0 at padding
    # (B, T) float32, 1.0 on response tokens (EOS included when produced)
    response_mask: torch.Tensor

    @property
    def response_ids(self):
        lengths = self.response_mask.sum(1).long().tolist()
        return [row[:n] for row, n in zip(self.tokens.tolist(), lengths)]

    @property
    def logprobs(self):
        lengths = self.response_mask.sum(1).long().tolist()
        return [row[:n] for row, n in zip(self.token_logprobs.tolist(), lengths)]


@dataclass
class KVCache:
    k: torch.Tensor  # (layers, rows, max_len, kv_heads, head_dim)
    v: torch.Tensor
    seqlens: torch.Tensor  # (rows,) int32: slots filled in each row
    flash: bool  # attend with flash_attn_with_kvcache (flash_choice)


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
    """The CUDA branch: one kernel writes k, v at slots seqlens.. of each row and attends
    causally."""
    from flash_attn import flash_attn_with_kvcache

    return flash_attn_with_kvcache(
        q, k_cache, v_cache, k=k, v=v, cache_seqlens=seqlens, softmax_scale=scale, causal=True
    )


def row_buckets(num_rows):
    """Up to BUCKETS consecutive slices covering rows 0..num_rows-1."""
    size = -(-num_rows // BUCKETS)
    return [slice(start, min(start + size, num_rows)) for start in range(0, num_rows, size)]


def causal_bias(positions, span, groups, dtype):
    """Additive mask (n, 1, groups * L, span) for sdpa_attention: slot j is visible to the query at
    position p iff j <= p (each row's own positions; slots past a row's length are masked)."""
    n, L = positions.shape
    visible = torch.arange(span, device=positions.device) <= positions[:, :, None]  # (n, L, span)
    bias = (torch.zeros(n, L, span, dtype=dtype, device=positions.device)
            .masked_fill(~visible, -float("inf")))
    return bias[:, None, None].expand(n, 1, groups, L, span).reshape(n, 1, groups * L, span)


def sdpa_attention(q, k, v, k_cache, v_cache, positions, bias, scale):
    """Same as flash_attention with PyTorch ops: write this step's keys and values into the cache
    and attend over it. q (n, L, heads, d) and k, v (n, L, kv_heads, d) are the step's n rows of L
    new tokens; k_cache, v_cache (n, max_len, kv_heads, d) are those rows' cache slots, one layer;
    positions (n, L) each new token's slot; bias (n, 1, groups * L, span) from causal_bias, span =
    the slots to read (0..span-1). Query head h reads key/value head h // groups (grouped-query
    attention, groups = heads / kv_heads). Returns (n, L, kv_heads, groups, d)."""
    n, L, _, head_dim = q.shape
    kv_heads, span = k.shape[2], bias.shape[-1]
    rows = torch.arange(n, device=q.device)[:, None]
    k_cache[rows, positions] = k
    v_cache[rows, positions] = v
    keys = k_cache[:, :span].transpose(1, 2)  # (n, kv_heads, span, d), a view
    values = v_cache[:, :span].transpose(1, 2)
    # GQA: query head h reads kv head h // groups, so fold each kv head's groups queries into one
    # (n, kv_heads, groups * L, d) block instead of repeating the keys.
    q = (q.view(n, L, kv_heads, -1, head_dim).permute(0, 2, 3, 1, 4)
         .reshape(n, kv_heads, -1, head_dim))
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=scale)
    # (n, L, kv_heads, groups, d)
    return out.view(n, kv_heads, -1, L, head_dim).permute(0, 3, 1, 2, 4)


def fuse_projections(model):
    """Join each layer's q, k and v projections into one weight, and its MLP's gate and up
    projections into another, the separate weights becoming views into them (no second copy): a
    decode step then runs 4 GEMMs a layer, not 7 (vLLM's QKVParallelLinear and
    MergedColumnParallelLinear, gpt-fast's wqkv). At batch 256 of Qwen2.5-7B on an H200, k_proj's
    and v_proj's own GEMMs ran at a tenth of the card's bandwidth (docs/benchmarks.md). Weights
    replaced afterwards (`.to()`, a load) leave the fused ones stale: fuse again (as
    runtime.refresh_sampler does); generate refuses a model whose fused weights are stale."""
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


def mlp(module, h):
    """The three families' MLP, down(act(gate(h)) * up(h)), gate and up from one GEMM where they are
    fused; the product in place and its factors freed before down runs, so it holds no more memory
    than Hugging Face's own."""
    gate, up = projections(module, ("gate_proj", "up_proj"), h)
    hidden = module.act_fn(gate).mul_(up)
    del gate, up
    return module.down_proj(hidden)


def rms_norm(norm, x):
    """Hugging Face's RMSNorm module `norm` applied to x, the three families' formula with its
    normalizing in one F.rms_norm call: on CUDA one fused kernel (_fused_rms_norm) where the module
    runs seven (to fp32, pow, mean, add, rsqrt, mul, back to x's dtype), 1.6 ms of a 12.2 ms step
    at batch 256 of Qwen2.5-7B on an H200 (docs/benchmarks.md); on a CPU the module's own ops, the
    same bits (torch 2.13's composite: an older one may round eps differently)."""
    # x / sqrt(mean(x^2) + eps) in fp32, rounded to x's dtype, then times the weight
    return norm.weight * F.rms_norm(x, x.shape[-1:], eps=norm.variance_epsilon)


def signed_sin(sin):
    """(-sin1, sin2) from sin = (sin1, sin2) (..., head_dim): rope's sign, folded in once a step."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rope(x, cos, sin):
    """Hugging Face's apply_rotary_pos_emb on one tensor x (n, L, heads, head_dim), cos and sin
    (n, L, 1, head_dim) with sin from signed_sin: rotate_half(x) sin = (x2, x1) (-sin1, sin2), the
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


def forward(model, input_ids, cache, span=None):
    """Run the decoder on input_ids (n, L) for cache rows 0..n-1, appending their K/V after
    seqlens[:n]. Returns the final hidden states (n, L, hidden). SDPA reads, with span None, each
    bucket of rows' slots up to its own longest row (a host sync per bucket); with a span (the
    fixed-shape step, n = all cache rows), slots 0..span-1 of every row at once (no sync)."""
    base = model.model
    n, L = input_ids.shape
    start = cache.seqlens[:n]
    positions = start[:, None].long() + torch.arange(L, device=input_ids.device)
    if not cache.flash:
        groups = model.config.num_attention_heads // model.config.num_key_value_heads
        if span is None:  # each bucket of rows reads slots 0..its longest row's length - 1
            buckets = [(rows, causal_bias(positions[rows], int(start[rows].max()) + L, groups,
                                          cache.k.dtype))
                       for rows in row_buckets(n)]
        else:
            bias = causal_bias(positions, span, groups, cache.k.dtype)

    x = base.embed_tokens(input_ids).flatten(0, 1)  # (n * L, hidden): 2-D matmuls, fewer ops
    cos, sin = base.rotary_emb(x, positions)  # the model's own rope, scaling included
    cos, sin = cos[:, :, None], signed_sin(sin)[:, :, None]  # (n, L, 1, head_dim): over the heads
    for i, layer in enumerate(base.layers):
        attn = layer.self_attn
        q, k, v = attention_inputs(attn, rms_norm(layer.input_layernorm, x), n, L, cos, sin)
        if cache.flash:
            out = flash_attention(q, k, v, cache.k[i, :n], cache.v[i, :n], start, attn.scaling)
        elif span is not None:
            out = sdpa_attention(q, k, v, cache.k[i], cache.v[i], positions, bias, attn.scaling)
        else:
            out = torch.cat([sdpa_attention(q[rows], k[rows], v[rows], cache.k[i, rows],
                                            cache.v[i, rows], positions[rows], bias, attn.scaling)
                             for rows, bias in buckets])
        x = x + attn.o_proj(out.reshape(n * L, -1))
        x = x + mlp(layer.mlp, rms_norm(layer.post_attention_layernorm, x))
    cache.seqlens[:n] += L
    return rms_norm(base.norm, x).view(n, L, -1)


def prefill(model, prompts, cache):
    """Run the prompts (one per cache row 0..len-1, longest first); return next-token logits
    (rows, V).
    Each bucket of rows is right-padded to its own longest prompt. Padding sits after each prompt,
    so causal attention keeps it out of every real token's view; its K/V slots are overwritten by
    decode, which writes at seqlens = the true prompt length."""
    device = cache.seqlens.device
    logits = []
    for rows in row_buckets(len(prompts)):
        bucket = prompts[rows]
        lengths = torch.tensor([len(p) for p in bucket], device=device)
        input_ids = torch.zeros(len(bucket), int(lengths.max()), dtype=torch.long, device=device)
        for row, prompt in enumerate(bucket):
            input_ids[row, : len(prompt)] = torch.tensor(prompt, device=device)
        # the bucket's rows as a cache of their own: views, so forward writes into `cache`
        rows_cache = KVCache(cache.k[:, rows], cache.v[:, rows], cache.seqlens[rows], cache.flash)
        hidden = forward(model, input_ids, rows_cache)
        cache.seqlens[rows] = lengths.int()
        # only the last token's logits
        last = hidden[torch.arange(len(bucket), device=device), lengths - 1]
        logits.append(model.lm_head(last).float())
    return torch.cat(logits)


def decode(model, tokens, cache, span=None):
    """One step for the first n = len(tokens) cache rows: feed each row its last sampled token
    (tokens: (n,)) after its cached slots, and return the next-token logits (n, V), float32. Only
    the new token goes through the model; the prefix is in the cache. `span`: forward's."""
    hidden = forward(model, tokens[:, None], cache, span)
    return model.lm_head(hidden[:, 0]).float()


def sample(logits, temperature, top_p, uniform):
    """Draw one token per row with its uniform (n,) in [0, 1); return (tokens (n,), their log-probs
    (n,) under the distribution sampled from)."""
    if temperature == 0:
        return logits.argmax(-1), torch.zeros(len(logits), device=logits.device)
    # z / tau (at tau = 1 the division would change nothing: one kernel less a step)
    probs = torch.softmax(logits if temperature == 1 else logits / temperature, dim=-1)
    if top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        # nucleus: the most likely tokens until their mass reaches top_p (renormalized below)
        probs = torch.zeros_like(probs).scatter(-1, order,
                                                sorted_probs.masked_fill(mass_before >= top_p, 0))
    tokens, total = inverse_cdf(probs, uniform)
    # its log-prob under the distribution sampled from: log(p / total), total = 1 without top-p
    return tokens[:, 0], (probs.gather(-1, tokens) / total).log().float()[:, 0]


def inverse_cdf(probs, uniform):
    """Inverse-CDF sampling: each row's first token whose cumulative probability exceeds
    uniform * total mass, the sums in float64. Over a vocabulary of 16 blocks of CDF_BLOCK tokens or
    more, in two levels, the same token as one cumsum over the whole vocabulary up to float64
    rounding, for a fraction of its memory traffic (on a GPU that cumsum over 152,064 tokens, its
    float64 copy and scan, took 0.54 ms of a 12.2 ms step): the blocks' sums find the block, a
    cumsum inside it the token. Under 16 blocks, the one cumsum (fewer ops). probs (n, V), uniform
    (n,); returns (tokens (n, 1), total mass (n, 1))."""
    n, V = probs.shape
    if V < 16 * CDF_BLOCK:
        cdf = probs.cumsum(-1, dtype=torch.float64)
        total = cdf[:, -1:]
        return (torch.searchsorted(cdf, uniform[:, None] * total, right=True).clamp(max=V - 1),
                total)
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


def compact(cache, done, span):
    """Drop finished rows: fill each finished slot below the new row count with a live row from the
    tail (at most one copy per finished row). Returns old slot of each new slot, (num_alive,)."""
    alive = (~done).nonzero()[:, 0]
    order = torch.arange(len(alive), device=done.device)
    holes = done[: len(alive)].nonzero()[:, 0]
    if len(holes):
        movers = alive[alive >= len(alive)]
        order[holes] = movers
        cache.k[:, holes, :span] = cache.k[:, movers, :span]
        cache.v[:, holes, :span] = cache.v[:, movers, :span]
        cache.seqlens[holes] = cache.seqlens[movers]
    return order


@dataclass
class Decoding:
    """The fixed-shape loop's state, rows in slot order: tensors written in place, never replaced,
    so a CUDA graph captured on them reads each step's new values at the same addresses."""
    tokens: torch.Tensor  # (B,) int64: the token each row feeds to the next step
    step: torch.Tensor  # (1,) int64: the index of the token being sampled
    uniforms: torch.Tensor  # (B, T) float64: one per (row, step), drawn up front
    done: torch.Tensor  # (B,) bool: the row has emitted EOS
    lengths: torch.Tensor  # (B,) int64: response tokens so far, EOS included
    tokens_out: torch.Tensor  # (B, T) int64, 0 after EOS
    logprobs_out: torch.Tensor  # (B, T) float32, 0 after EOS
    eos: torch.Tensor  # (E,) int64: the ids that end a row
    temperature: float
    top_p: float


def new_decoding(uniforms, eos, temperature, top_p):
    """The state before token 0, for rows whose uniforms (B, T) are given in slot order."""
    (rows, steps), device = uniforms.shape, uniforms.device
    zeros = lambda *shape, dtype=torch.long: torch.zeros(shape, dtype=dtype, device=device)  # noqa
    return Decoding(tokens=zeros(rows), step=zeros(1), uniforms=uniforms,
                    done=zeros(rows, dtype=torch.bool), lengths=zeros(rows),
                    tokens_out=zeros(rows, steps),
                    logprobs_out=zeros(rows, steps, dtype=torch.float32),
                    eos=eos, temperature=temperature, top_p=top_p)


def take(logits, state):
    """Sample every row's token at state.step from logits (B, V) and record it; a finished row
    records padding (token 0, log-prob 0) and stays finished."""
    uniform = state.uniforms.index_select(1, state.step)[:, 0]
    tokens, logprobs = sample(logits, state.temperature, state.top_p, uniform)
    live = ~state.done
    state.tokens_out.index_copy_(1, state.step, (tokens * live)[:, None])
    state.logprobs_out.index_copy_(1, state.step, (logprobs * live)[:, None])
    state.lengths += live
    state.done |= (tokens[:, None] == state.eos).any(-1)
    state.tokens.copy_(tokens)
    state.step += 1


@torch.no_grad()
def static_step(model, cache, state, span, decode_fn=decode):
    """The fixed-shape decode step: every row feeds its last token, reads `span` slots (SDPA; flash
    reads its own seqlens) and samples its next one. Same shapes every step, no host sync."""
    take(decode_fn(model, state.tokens, cache, span), state)


@functools.cache
def compiled_step(backend="inductor"):
    """static_step with its model part (decode) compiled by torch.compile (Inductor on CUDA; the
    tests trace it with another backend): its 28 ops a layer (joined, as on CUDA) fused into
    fewer kernels, gpt-fast's recipe for a step whose kernels each cost more than their work (a
    graphed SmolLM2 step: ~4 ms for ~0.1 ms of memory traffic, docs/benchmarks.md). Sampling
    stays eager: Inductor's split scan fails to compile the top-p/inverse-CDF cumsum fused with
    the softmax before it (pytorch#180221, "list indices must be integers or slices, not
    NoneType", on an H200). Compiled with symbolic shapes from the first call (dynamic=True):
    the span and the cache's length change with the prompts' lengths and max_new_tokens, and a
    compile specialized to the first would recompile at the second with them symbolic. Opt-in
    (generate(compiled=True); train.py --compile-sampler)."""
    compiled_decode = torch.compile(decode, fullgraph=True, dynamic=True, backend=backend)
    return functools.partial(static_step, decode_fn=compiled_decode)


@functools.cache
def capture_stream(device):
    """The one side stream on which every capture of the process warms up and records. cuBLAS keeps
    a workspace for each stream it has run a GEMM on (32 MiB on a Hopper card) in PyTorch's
    allocator until the process ends: a new stream per capture held one more for each span, up to
    PyTorch's pool of 32 streams (~1 GB)."""
    return torch.cuda.Stream(device)


def capture(step, pool, stream):
    """Run step() once, eagerly on the side `stream` (the warm-up CUDA graphs need: cuBLAS
    workspaces, kernel choices), then record it there as a CUDA graph whose replay() is the next
    step. Why graphs pay on a GPU: a step is ~1,000-2,000 small kernels, each launched from Python
    in a few microseconds, while the GPU runs most of them faster than that, so eagerly it waits on
    the CPU; a replay launches the whole recorded step at once, and the step runs at the card's
    memory bandwidth."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        step()  # recorded, not run
    return graph


@torch.no_grad()
def static_decode(model, cache, logits, state, cuda_graphs=True, compiled=False):
    """The fixed-shape loop from the prefill's logits to the last token (or until every row is
    done); on CUDA each distinct span's step is captured once and replayed (cuda_graphs), compiled
    first with `compiled`."""
    max_len, max_new_tokens = cache.k.shape[2], state.uniforms.shape[1]
    step_fn = compiled_step() if compiled else static_step
    take(logits, state)  # token 0, from the prefill
    graphs, pool = {}, None
    if cuda_graphs and cache.k.is_cuda:
        pool = torch.cuda.graph_pool_handle()  # the graphs run one at a time: one memory pool
    for step in range(1, max_new_tokens):
        # the loop's only host sync, once every ALL_DONE_EVERY steps
        if len(state.eos) and step % ALL_DONE_EVERY == 0 and state.done.all():
            break
        # SDPA's span: the longest row's slots, max_len - max_new_tokens + step, rounded up
        span = (None if cache.flash else
                min(-(-(max_len - max_new_tokens + step) // SPAN_BUCKET) * SPAN_BUCKET, max_len))
        if pool is None:
            step_fn(model, cache, state, span)
        elif span in graphs:
            graphs[span].replay()
        else:
            graphs[span] = capture(lambda: step_fn(model, cache, state, span), pool,
                                   capture_stream(cache.k.device))
    return state


def check_model(model):
    config = model.config
    if config.model_type not in FAMILIES:
        raise ValueError(f"rollout.generate supports model types {FAMILIES}, "
                         f"got '{config.model_type}'")
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):
        raise ValueError("rollout.generate does not implement sliding-window attention layers")
    for layer in model.model.layers:  # fuse_projections' weights: still those the layers hold
        for module, first in ((layer.self_attn, "q_proj"), (layer.mlp, "gate_proj")):
            weight = getattr(module, first).weight
            if hasattr(module, "fused") and (weight.untyped_storage().data_ptr()
                                             != module.fused[0].untyped_storage().data_ptr()):
                raise ValueError("the model's weights were replaced after fuse_projections: fuse "
                                 "them again (rollout.unfuse_projections, then fuse_projections)")


@torch.no_grad()
def prefilled(model, prompts, max_new_tokens):
    """An empty cache for the prompts' rows, prefilled. Cache slots hold the rows longest prompt
    first, so neighbouring slots have similar lengths; identical prompts share one prefill (the
    distinct ones, also longest first, take the first slots), copied to each of their slots.
    Returns (cache, next-token logits (rows, V) in slot order, row_of_slot (rows,))."""
    param = next(model.parameters())
    device = param.device
    distinct = sorted(dict.fromkeys(map(tuple, prompts)), key=len, reverse=True)
    index = {prompt: i for i, prompt in enumerate(distinct)}
    slot_rows = sorted(range(len(prompts)), key=lambda row: -len(prompts[row]))
    source = torch.tensor([index[tuple(prompts[row])] for row in slot_rows], device=device)

    num_rows, max_prompt = len(prompts), max(len(p) for p in prompts)
    shape = cache_shape(model, num_rows, max_prompt + max_new_tokens)
    cache = KVCache(
        # zeros: masked slots must not be NaN
        k=torch.zeros(shape, dtype=param.dtype, device=device),
        v=torch.zeros(shape, dtype=param.dtype, device=device),
        seqlens=torch.zeros(num_rows, dtype=torch.int32, device=device),
        flash=flash_choice(device, param.dtype)[0],
    )
    logits = prefill(model, distinct, cache)
    # slot s <- the prefilled slot of its prompt, layer by layer
    for layer_cache in (*cache.k, *cache.v):
        layer_cache[:, :max_prompt] = layer_cache[source, :max_prompt]  # (the right side is a copy)
    cache.seqlens[:] = cache.seqlens[source]
    return cache, logits[source], torch.tensor(slot_rows, device=device)


@torch.no_grad()
def generate(model, prompts, max_new_tokens, temperature=1.0, top_p=1.0, eos_token_id=None,
             generator=None, static=None, cuda_graphs=True, max_rows=None, compiled=False):
    """Sample one response per prompt (a list of token-id lists). `eos_token_id`: int, list or None
    (then exactly max_new_tokens tokens per row). `generator`: a torch.Generator on the model's
    device. `static`: decode with the fixed-shape loop (True) or by compaction (False); None picks
    the faster where the model is: fixed shape on CUDA, compaction on a CPU (docs/benchmarks.md).
    `cuda_graphs`: on CUDA, replay the fixed-shape step as a CUDA graph (False: eagerly, to
    debug); `compiled`: the fixed-shape step compiled first (compiled_step). `max_rows`: decode at
    most this many rows at a time (their KV cache is what takes the memory: kv_bytes); every row
    still draws the uniforms of its own index, so the samples are those of one call, up to float
    rounding."""
    check_model(model)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token-id lists")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature} and {top_p}")
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"max_rows must be None or >= 1, got {max_rows}")
    device = next(model.parameters()).device
    eos = ([] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int)
           else list(eos_token_id))
    eos = torch.tensor(eos, dtype=torch.long, device=device)
    num_rows = len(prompts)
    if static is None:  # the faster loop where the model is (docs/benchmarks.md)
        static = device.type == "cuda"

    # One uniform per (row, step), drawn up front: a row's samples depend on the seed and its row
    # index only, not on which other rows are still running, nor on how the rows are chunked.
    uniforms = torch.rand(num_rows, max_new_tokens, generator=generator, device=device,
                          dtype=torch.float64)
    tokens_out = torch.zeros(num_rows, max_new_tokens, dtype=torch.long, device=device)
    logprobs_out = torch.zeros(num_rows, max_new_tokens, dtype=torch.float32, device=device)
    lengths = torch.full((num_rows,), max_new_tokens, device=device)
    chunk = max_rows or num_rows
    for start in range(0, num_rows, chunk):
        rows = slice(start, start + chunk)  # views: decode_rows writes into the outputs
        decode_rows(model, prompts[rows], uniforms[rows], eos, temperature, top_p, static,
                    cuda_graphs, compiled, tokens_out[rows], logprobs_out[rows], lengths[rows])

    width = int(lengths.max())
    response_mask = (torch.arange(width, device=device) < lengths[:, None]).float()
    return Rollout(
        tokens=tokens_out[:, :width] * response_mask.long(),
        token_logprobs=logprobs_out[:, :width] * response_mask,
        response_mask=response_mask,
    )


def decode_rows(model, prompts, uniforms, eos, temperature, top_p, static, cuda_graphs, compiled,
                tokens_out, logprobs_out, lengths):
    """Prefill `prompts` and decode them to the end, by the fixed-shape loop (static) or by
    compaction, writing each row's tokens, log-probs and response length into the (rows, T) /
    (rows,) outputs, in row order."""
    max_new_tokens = uniforms.shape[1]
    cache, logits, row_of_slot = prefilled(model, prompts, max_new_tokens)
    if static:
        state = new_decoding(uniforms[row_of_slot], eos, temperature, top_p)
        static_decode(model, cache, logits, state, cuda_graphs, compiled)
        # slot order -> row order
        tokens_out[row_of_slot], logprobs_out[row_of_slot] = state.tokens_out, state.logprobs_out
        lengths[row_of_slot] = state.lengths
        return
    max_prompt = max(len(p) for p in prompts)
    for step in range(max_new_tokens):
        tokens, logprobs = sample(logits, temperature, top_p, uniforms[row_of_slot, step])
        tokens_out[row_of_slot, step] = tokens
        logprobs_out[row_of_slot, step] = logprobs
        if step == max_new_tokens - 1:
            break
        done = torch.isin(tokens, eos)
        if done.any():  # finished rows leave the batch
            lengths[row_of_slot[done]] = step + 1
            order = compact(cache, done, max_prompt + step + 1)
            if len(order) == 0:
                break
            tokens, row_of_slot = tokens[order], row_of_slot[order]
        logits = decode(model, tokens, cache)


def cache_shape(model, num_rows, max_len):
    """The shape of the K (and of the V) cache: (layers, rows, slots, kv_heads, head_dim)."""
    config = model.config
    return (config.num_hidden_layers, num_rows, max_len, config.num_key_value_heads,
            model.model.layers[0].self_attn.head_dim)


def kv_bytes(model, num_rows, max_len):
    """Bytes of the KV cache prefilled() allocates for num_rows rows of max_len slots (K and V,
    every layer, in the model's dtype)."""
    return 2 * math.prod(cache_shape(model, num_rows, max_len)) * next(
        model.parameters()).element_size()
