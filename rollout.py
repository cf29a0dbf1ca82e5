"""Our own batched sampler with a KV cache: rollouts y_1:T ~ pi_theta(.|x) of Sec. 2, and the
log-prob of each sampled token under the distribution it was drawn from, log pi_theta_old(o_t |
x, o_<t) of eq. (4), which the trainer's importance ratio and behaviour policy need.

What the paper needs:
- Sampling: the temperature tau scales the logits (T is the response length, as in the paper);
  top-p keeps the smallest set of most likely tokens whose mass reaches p (the token that crosses
  p included: Hugging Face's TopPLogitsWarper rule) and renormalizes. The returned log-prob is
  under exactly that distribution, log softmax(z / tau) renormalized over the nucleus.
  temperature=0 is greedy, a point mass, so its log-probs are 0 (= log 1).
- Tokens are drawn by inverse CDF with one uniform per (row, step) drawn up front from
  `generator`: a row's sample depends on the seed and its row index only.
- A row ends at its first EOS (included in the response); the rest is padding: token 0, log-prob
  0, mask 0.

How: we reuse the Hugging Face model's modules and weights (Llama, Qwen2 and Qwen3 families) and
write only the attention over a preallocated cache. Prefill runs each distinct prompt once (the
trainer passes each prompt G times); then one decode loop runs every row every step, a finished
row writing padding (gpt-fast's fixed shape: nothing in a step waits for the host). Every device
runs this loop: a GPU's machinery (systems/cuda_decode.py) wraps its forward and step and comes in
as generate's `decoder`; this file imports nothing from systems/.
"""
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FAMILIES = ("llama", "qwen2", "qwen3")
PREFILL_BUCKETS = 4  # the prefill splits the prompts into this many buckets of similar length
ALL_DONE_EVERY = 8  # the loop asks "all rows done?" (a host sync) every this many steps
SPAN_BUCKET = 128  # a step attends over slots 0..span-1, span a multiple of this (one CUDA graph)


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
    def response_logprobs(self):
        lengths = self.response_mask.sum(1).long().tolist()
        return [row[:n] for row, n in zip(self.token_logprobs.tolist(), lengths)]


@dataclass
class KVCache:
    """Row b holds its own prompt from slot 0 (no left padding), so the token at slot j has
    position j, as Hugging Face places an unpadded prompt."""
    k: torch.Tensor  # (layers, rows, max_len, kv_heads, head_dim)
    v: torch.Tensor
    seqlens: torch.Tensor  # (rows,) int32: slots filled in each row


def causal_bias(positions, span, groups, dtype):
    """Additive mask (n, 1, groups * L, span) for sdpa_attention: slot j is visible to the query at
    position p iff j <= p (each row's own positions; slots past a row's length are masked)."""
    n, L = positions.shape
    visible = torch.arange(span, device=positions.device) <= positions[:, :, None]  # (n, L, span)
    bias = (torch.zeros(n, L, span, dtype=dtype, device=positions.device)
            .masked_fill(~visible, -float("inf")))
    return bias[:, None, None].expand(n, 1, groups, L, span).reshape(n, 1, groups * L, span)


def sdpa_attention(q, k, v, k_cache, v_cache, positions, bias, scale):
    """Write this step's keys and values into the cache and attend over it. q (n, L, heads, d) and
    k, v (n, L, kv_heads, d) are the step's n rows of L new tokens; k_cache, v_cache (n, max_len,
    kv_heads, d) are those rows' cache slots, one layer; positions (n, L) each new token's slot;
    bias (n, 1, groups * L, span) from causal_bias, span = the slots to read (0..span-1). Query
    head h reads key/value head h // groups (grouped-query attention, groups = heads / kv_heads).
    Returns (n, L, kv_heads, groups, d)."""
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


def rope(x, cos, sin):
    """Hugging Face's apply_rotary_pos_emb on one tensor x (n, L, heads, head_dim), cos and sin
    (n, L, 1, head_dim): x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def forward(model, input_ids, cache, span, setup_fn=None, layer_fn=None, norm_fn=None):
    """Run the decoder on input_ids (n, L) for the n cache rows, appending their K/V after
    seqlens and attending over slots 0..span-1. Returns the final hidden states (n, L, hidden).
    The one layer loop of the project: a device's machinery (systems/cuda_decode.py) passes its
    own forms of attention_setup, decoder_layer and the final norm (`setup_fn`, `layer_fn`,
    `norm_fn`: fused weights, flash-attn or FlexAttention, compiled layers)."""
    base = model.model
    n, L = input_ids.shape
    positions = cache.seqlens[:, None].long() + torch.arange(L, device=input_ids.device)
    x = base.embed_tokens(input_ids).flatten(0, 1)  # (n * L, hidden): 2-D matmuls, fewer ops
    cos, sin = base.rotary_emb(x, positions)  # the model's own rope, scaling included
    # (n, L, 1, head_dim): over the heads
    mask, cos, sin = (setup_fn or attention_setup)(model, cache, positions, span,
                                                   cos[:, :, None], sin[:, :, None])
    for i, layer in enumerate(base.layers):
        x = (layer_fn or decoder_layer)(layer, x, cache.k[i], cache.v[i], positions, mask, cos,
                                        sin)
    cache.seqlens += L
    return (norm_fn(base.norm, x) if norm_fn else base.norm(x)).view(n, L, -1)


def attention_setup(model, cache, positions, span, cos, sin):
    """What every layer's attention reads: the causal bias over slots 0..span-1, and rope's cos
    and sin as the model gives them."""
    groups = model.config.num_attention_heads // model.config.num_key_value_heads
    return causal_bias(positions, span, groups, cache.k.dtype), cos, sin


def decoder_layer(layer, x, k_cache, v_cache, positions, bias, cos, sin):
    """One decoder layer on the hidden states x (n * L, hidden) of positions (n, L): attention
    (its K/V written into this layer's cache rows k_cache, v_cache), then the MLP, each with its
    residual."""
    n, L = positions.shape
    attn, h = layer.self_attn, layer.input_layernorm(x)
    q, k, v = (proj(h).view(n, L, -1, attn.head_dim)
               for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm on each head before rope
        q, k = attn.q_norm(q), attn.k_norm(k)
    out = sdpa_attention(rope(q, cos, sin), rope(k, cos, sin), v, k_cache, v_cache, positions,
                         bias, attn.scaling)
    x = x + attn.o_proj(out.reshape(n * L, -1))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def prefill(model, prompts, cache, forward_fn=forward):
    """Run the prompts (one per cache row, longest first) through `forward_fn`; return next-token
    logits (rows, V).
    The prompts' common prefix (the chat template and few-shot examples: 143 of the default run's
    ~172 tokens) runs once, in row 0, and its K/V is copied to every row; then each of
    PREFILL_BUCKETS buckets of rows runs the rest of its prompts after it, right-padded to its
    own longest. Padding sits after each prompt, so causal attention keeps it out of every real
    token's view; its K/V slots are overwritten by decode, which writes at seqlens = the true
    prompt length."""
    device, size = cache.seqlens.device, -(-len(prompts) // PREFILL_BUCKETS)
    shared = common_prefix_length(prompts)
    if shared:
        first = KVCache(cache.k[:, :1], cache.v[:, :1], cache.seqlens[:1])
        forward_fn(model, torch.tensor([prompts[0][:shared]], device=device), first, span=shared)
        for kv in (cache.k, cache.v):
            kv[:, 1:len(prompts), :shared] = kv[:, :1, :shared]
        cache.seqlens[:len(prompts)] = shared
    logits = []
    for start in range(0, len(prompts), size):
        bucket = prompts[start:start + size]
        rows = slice(start, start + len(bucket))
        lengths = torch.tensor([len(p) for p in bucket], device=device)
        input_ids = torch.zeros(len(bucket), int(lengths.max()) - shared, dtype=torch.long,
                                device=device)
        for row, prompt in enumerate(bucket):
            input_ids[row, : len(prompt) - shared] = torch.tensor(prompt[shared:], device=device)
        # the bucket's rows as a cache of their own: views, so forward writes into `cache`
        rows_cache = KVCache(cache.k[:, rows], cache.v[:, rows], cache.seqlens[rows])
        hidden = forward_fn(model, input_ids, rows_cache, span=int(lengths.max()))
        cache.seqlens[rows] = lengths.int()
        # the last token's
        last = hidden[torch.arange(len(bucket), device=device), lengths - shared - 1]
        logits.append(model.lm_head(last).float())
    return torch.cat(logits)


def common_prefix_length(prompts):
    """The tokens every prompt starts with, short of each one's last (whose logits the row needs);
    0 for a single prompt, which has nothing to share."""
    if len(prompts) < 2:
        return 0
    return min(len(os.path.commonprefix(prompts)), min(map(len, prompts)) - 1)


def decode(model, tokens, cache, span, forward_fn=forward):
    """One step for every cache row: feed each row its last sampled token (tokens: (rows,)) after
    its cached slots, and return the next-token logits (rows, V), float32. Only the new token goes
    through the model (`forward_fn`); the prefix is in the cache."""
    hidden = forward_fn(model, tokens[:, None], cache, span)
    return model.lm_head(hidden[:, 0]).float()


def sample(logits, temperature, top_p, uniform, draw=None):
    """Draw one token per row with its uniform (n,) in [0, 1); return (tokens (n,), their log-probs
    (n,) under the distribution sampled from). `draw`: called in inverse_cdf's place, with its
    arguments and results (a GPU's step passes one by blocks)."""
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
    tokens, total = (draw or inverse_cdf)(probs, uniform)
    # its log-prob under the distribution sampled from: log(p / total), total = 1 without top-p
    return tokens[:, 0], (probs.gather(-1, tokens) / total).log().float()[:, 0]


def inverse_cdf(probs, uniform):
    """Inverse-CDF sampling: each row's first token (in vocabulary order) whose cumulative
    probability exceeds uniform * total mass, the sums in float64 (so rare tokens keep their own
    rate). probs (n, V), uniform (n,); returns (tokens (n, 1), total mass (n, 1))."""
    cdf = probs.cumsum(-1, dtype=torch.float64)
    total = cdf[:, -1:]
    return (torch.searchsorted(cdf, uniform[:, None] * total, right=True)
            .clamp(max=probs.shape[1] - 1), total)


@dataclass
class Decoding:
    """The decode loop's state, rows in cache-slot order: tensors written in place, never replaced
    (so a CUDA graph captured on them reads each step's new values at the same addresses)."""
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


def record_sample(logits, state, draw=None):
    """Sample every row's token at state.step from logits (B, V) and record it; a finished row
    records padding (token 0, log-prob 0) and stays finished."""
    uniform = state.uniforms.index_select(1, state.step)[:, 0]
    tokens, logprobs = sample(logits, state.temperature, state.top_p, uniform, draw)
    live = ~state.done
    state.tokens_out.index_copy_(1, state.step, (tokens * live)[:, None])
    state.logprobs_out.index_copy_(1, state.step, (logprobs * live)[:, None])
    state.lengths += live
    state.done |= (tokens[:, None] == state.eos).any(-1)
    state.tokens.copy_(tokens)
    state.step += 1


@torch.no_grad()
def sample_step(model, cache, state, span, forward_fn=forward, draw=None):
    """One step of the loop: every row feeds its last token, reads `span` slots and samples its
    next one. Same shapes every step, no host sync."""
    record_sample(decode(model, state.tokens, cache, span, forward_fn), state, draw)


@torch.no_grad()
def sample_loop(model, cache, logits, state, step=sample_step):
    """From the prefill's logits to the last token, or until every row is done."""
    max_len, max_new_tokens = cache.k.shape[2], state.uniforms.shape[1]
    record_sample(logits, state)  # token 0, from the prefill
    for t in range(1, max_new_tokens):
        # the loop's only host sync, once every ALL_DONE_EVERY steps
        if len(state.eos) and t % ALL_DONE_EVERY == 0 and state.done.all():
            break
        # the slots to read: the longest row's (max_len - max_new_tokens + t), rounded up
        step(model, cache, state, min(math.ceil((max_len - max_new_tokens + t) / SPAN_BUCKET)
                                      * SPAN_BUCKET, max_len))
    return state


def check_model(model):
    config = model.config
    if config.model_type not in FAMILIES:
        raise ValueError(f"rollout.generate supports model types {FAMILIES}, "
                         f"got '{config.model_type}'")
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):
        raise ValueError("rollout.generate does not implement sliding-window attention layers")


@torch.no_grad()
def cache_for_prompts(model, prompts, max_new_tokens, forward_fn=forward):
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
    cache = KVCache(  # zeros: masked slots must not be NaN
        k=torch.zeros(shape, dtype=param.dtype, device=device),
        v=torch.zeros(shape, dtype=param.dtype, device=device),
        seqlens=torch.zeros(num_rows, dtype=torch.int32, device=device))
    logits = prefill(model, distinct, cache, forward_fn)
    # slot s <- the prefilled slot of its prompt, layer by layer
    for layer_cache in (*cache.k, *cache.v):
        layer_cache[:, :max_prompt] = layer_cache[source, :max_prompt]  # (the right side is a copy)
    cache.seqlens[:] = cache.seqlens[source]
    return cache, logits[source], torch.tensor(slot_rows, device=device)


def own_decoder(model):
    """rollout's own decoder: (the prefill's forward, the loop's step) for one generate's rows of
    `model`. A device's (systems/cuda_decode.decoder) has the same form."""
    return forward, sample_step


@torch.no_grad()
def generate(model, prompts, max_new_tokens, temperature=1.0, top_p=1.0, eos_token_id=None,
             generator=None, max_rows=None, decoder=own_decoder):
    """Sample one response per prompt (a list of token-id lists). `eos_token_id`: int, list or None
    (then exactly max_new_tokens tokens per row). `generator`: a torch.Generator on the model's
    device. `max_rows`: decode at most this many rows at a time (their KV cache takes the memory);
    every row still draws the uniforms of its own index, so the samples are those of one call, up
    to float rounding. `decoder`: a function of the model giving (forward, step) for each batch of
    rows, own_decoder or a device's (systems/runtime.sampler_decoder, where the sampler is made):
    the same samples up to float rounding."""
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

    # One uniform per (row, step), drawn up front: a row's samples depend on the seed and its row
    # index only, not on which other rows are still running, nor on how the rows are chunked.
    uniforms = torch.rand(num_rows, max_new_tokens, generator=generator, device=device,
                          dtype=torch.float64)
    tokens_out = torch.zeros(num_rows, max_new_tokens, dtype=torch.long, device=device)
    logprobs_out = torch.zeros(num_rows, max_new_tokens, dtype=torch.float32, device=device)
    lengths = torch.zeros(num_rows, dtype=torch.long, device=device)
    chunk = max_rows or num_rows
    for start in range(0, num_rows, chunk):
        rows = slice(start, start + chunk)  # views: sample_rows writes into the outputs
        sample_rows(model, prompts[rows], uniforms[rows], eos, temperature, top_p, decoder,
                    tokens_out[rows], logprobs_out[rows], lengths[rows])

    width = int(lengths.max())
    response_mask = (torch.arange(width, device=device) < lengths[:, None]).float()
    return Rollout(tokens=tokens_out[:, :width], token_logprobs=logprobs_out[:, :width],
                   response_mask=response_mask)


def sample_rows(model, prompts, uniforms, eos, temperature, top_p, decoder, tokens_out,
                logprobs_out, lengths):
    """Prefill `prompts` and decode them to the end with `decoder`'s forward and step, writing
    each row's tokens, log-probs and response length into the (rows, T) / (rows,) outputs, in row
    order."""
    forward_fn, step = decoder(model)
    cache, logits, row_of_slot = cache_for_prompts(model, prompts, uniforms.shape[1], forward_fn)
    state = new_decoding(uniforms[row_of_slot], eos, temperature, top_p)
    sample_loop(model, cache, logits, state, step)
    # slot order -> row order
    tokens_out[row_of_slot], logprobs_out[row_of_slot] = state.tokens_out, state.logprobs_out
    lengths[row_of_slot] = state.lengths


def cache_shape(model, num_rows, max_len):
    """The shape of the K (and of the V) cache: (layers, rows, slots, kv_heads, head_dim)."""
    config = model.config
    return (config.num_hidden_layers, num_rows, max_len, config.num_key_value_heads,
            model.model.layers[0].self_attn.head_dim)
