"""Attention by blocks in logprobs.shared_prefix_pack's one sequence: only the pairs its mask can
let through are computed (the CPU's log-prob passes, issue 62).

shared_prefix_pack lays a micro-batch out as one sequence: the prompts' common prefix (the chat
template, the few-shot examples), then each group in turn (the rest of its prompt, then its
responses), under a dense (L, L) boolean mask. SDPA under that mask computes every one of the L^2
pairs, though at the default run's batch it lets ~10% through: a group's tokens see the prefix and
their own group only. Here the same attention is computed in two calls:
- the prefix's queries against the prefix's keys, causal (`is_causal`, no mask);
- each group's queries against the prefix's keys and then its own group's, under that group's block
  of the mask (all of the prefix, then what `allowed` lets through inside the group); the groups
  batched, right-padded to the longest, a padded query seeing only its own padded key.
Every real query sees exactly the keys the dense mask lets it see, so the outputs are the dense
mask's to float rounding (a softmax over fewer masked-out terms, summed in another order). Grouped-
query attention by SDPA's enable_gqa (no copy of the key and value heads). At the default batch
(a 143-token prefix, 8 groups of ~115 tokens) it computes ~0.25M pairs a head, against ~1.2M.
`attention(model)` (segment_attention's) makes it the model's attention function inside a `with`;
the model's forward passes `blocks` (layout's) down to it.
"""
import torch
import torch.nn.functional as F

NAME = "shared_prefix_blocks"


def layout(allowed, blocks):
    """The gathers and masks for prefix_attention: `allowed` (L, L) is shared_prefix_pack's mask,
    `blocks` each group's (start, stop) columns (the first starts where the prefix ends). Returns (queries
    (G, M): each group's columns, right-padded with column 0; keys (G, shared + M): the prefix's
    columns, then the group's; mask (G, 1, M, shared + M); source (L,): the row of the outputs
    (the prefix's, then the groups' flattened) that each column takes)."""
    device, shared = allowed.device, blocks[0][0]
    M = max(stop - start for start, stop in blocks)
    prefix = torch.arange(shared, device=device)
    queries = torch.zeros(len(blocks), M, dtype=torch.long, device=device)
    mask = torch.zeros(len(blocks), 1, M, shared + M, dtype=torch.bool, device=device)
    source = torch.arange(allowed.shape[0], device=device)  # the prefix's columns: their own rows
    for g, (start, stop) in enumerate(blocks):
        n = stop - start
        queries[g, :n] = torch.arange(start, stop, device=device)
        mask[g, 0, :n, :shared + n] = allowed[start:stop][:, torch.cat([prefix, queries[g, :n]])]
        mask[g, 0, n:, shared + n:] = torch.eye(M - n, dtype=torch.bool, device=device)
        source[start:stop] = shared + g * M + torch.arange(n, device=device)
    keys = torch.cat([prefix.expand(len(blocks), shared), queries], 1)
    return queries, keys, mask, source


def prefix_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     blocks=None, **kwargs):
    """transformers' attention interface: query (1, heads, L, d), key and value (1, kv_heads, L,
    d); returns (1, L, heads, d). The dense mask is ignored: `blocks` (layout's) says the same."""
    queries, keys, mask, source = blocks
    shared = keys.shape[1] - queries.shape[1]
    if torch.is_autocast_enabled(query.device.type):  # SDPA would cast q, k, v: gather them cast
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    query, key, value = query[0], key[0], value[0]  # (heads, L, d)
    outputs = []
    if shared:  # the prefix: causal over itself
        out = F.scaled_dot_product_attention(query[None, :, :shared], key[None, :, :shared],
                                             value[None, :, :shared], is_causal=True,
                                             scale=scaling, enable_gqa=True)
        outputs.append(out[0].transpose(0, 1))  # (shared, heads, d)
    # each group: the prefix's keys and its own, (G, heads, M or shared + M, d)
    q, k, v = (x[:, columns].transpose(0, 1) for x, columns in
               ((query, queries), (key, keys), (value, keys)))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
    outputs.append(out.transpose(1, 2).flatten(0, 1))  # (G * M, heads, d)
    return torch.cat(outputs)[source][None], None
