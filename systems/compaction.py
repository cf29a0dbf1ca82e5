"""The sampler's CPU speed machinery: rollout.decode_loop's samples, finished rows leaving the
batch.

On a CPU, where a decode step is compute-bound, a row that emits EOS leaves the batch: the last live
rows move into its cache slots, so the next steps run on fewer rows, and each bucket of rows
attends over the slots of its own longest row (forward). Each of these choices asks the host for a
number (a sync) and gives a new shape when a row finishes, which a GPU's CUDA graph cannot replay
(systems/cuda_decode.py runs rollout's fixed-shape step there). Tokens are drawn by cuda_decode's
inverse CDF by blocks (it pays on a CPU too: studies/cdf-blocks-cpu). It draws the same tokens from
the same uniforms as rollout.decode_loop, up to float rounding (tests/test_static_decode.py), and
exactly what the CPU loop drew before the reader's edition (the default run's metrics unchanged).
Kept by the registered rule of studies/one-loop-cpu: without it the default run's whole train step
took 1.038 of its CPU time (mean of 4 paired rounds, above the rule's 1.03; 95% interval 0.92 to
1.16). rollout.py's decode_rows calls it on a CPU (generate(fast=None)); generate(fast=False) runs
rollout's own loop.
"""
import math

import torch

import rollout
from systems import cuda_decode  # its inverse CDF by blocks: it pays on a CPU too


@torch.no_grad()
def decode_rows(model, prompts, uniforms, eos, temperature, top_p, tokens_out, logprobs_out,
                lengths):
    """rollout.decode_rows by compaction: prefill `prompts`, then decode the live rows only,
    writing each row's tokens, log-probs and response length into the outputs, in row order."""
    max_new_tokens = uniforms.shape[1]
    cache, logits, row_of_slot = rollout.prefilled(model, prompts, max_new_tokens)
    lengths[:] = max_new_tokens  # rows that never emit EOS
    max_prompt = max(len(p) for p in prompts)
    for step in range(max_new_tokens):
        tokens, logprobs = rollout.sample(logits, temperature, top_p, uniforms[row_of_slot, step],
                                          draw=cuda_decode.inverse_cdf)  # by blocks
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
        # the live rows' slots: a view, so decode writes into `cache`
        n = len(tokens)
        live = rollout.KVCache(cache.k[:, :n], cache.v[:, :n], cache.seqlens[:n])
        logits = model.lm_head(forward(model, tokens[:, None], live)[:, 0]).float()


def forward(model, input_ids, cache):
    """rollout.forward with attention by buckets of rows (rollout.BUCKETS), each bucket reading the
    slots up to its own longest row (a host sync per bucket): the compaction loop's, as timed by
    studies/one-loop-cpu (rows sorted longest prompt first keep a bucket's lengths close)."""
    base, config = model.model, model.config
    n, L = input_ids.shape
    positions = cache.seqlens[:, None].long() + torch.arange(L, device=input_ids.device)
    groups = config.num_attention_heads // config.num_key_value_heads
    size = math.ceil(n / rollout.BUCKETS)
    buckets = [(rows, rollout.causal_bias(positions[rows], int(cache.seqlens[rows].max()) + L,
                                          groups, cache.k.dtype))
               for rows in (slice(start, min(start + size, n)) for start in range(0, n, size))]
    x = base.embed_tokens(input_ids).flatten(0, 1)
    cos, sin = base.rotary_emb(x, positions)
    cos, sin = cos[:, :, None], sin[:, :, None]
    for i, layer in enumerate(base.layers):
        attn, h = layer.self_attn, layer.input_layernorm(x)
        q, k, v = (proj(h).view(n, L, -1, attn.head_dim)
                   for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = rollout.rope(q, cos, sin), rollout.rope(k, cos, sin)
        out = torch.cat([rollout.sdpa_attention(q[rows], k[rows], v[rows], cache.k[i, rows],
                                                cache.v[i, rows], positions[rows], bias,
                                                attn.scaling)
                         for rows, bias in buckets])
        x = x + attn.o_proj(out.reshape(n * L, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    cache.seqlens += L
    return base.norm(x).view(n, L, -1)


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
