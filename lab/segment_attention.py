"""An experiment for train.token_logprobs' packed passes (issue 35): attention by segments.

token_logprobs packs a group as one sequence (the prompt once, then each response) with a block
mask, and SDPA computes every (query, key) pair of the L x L pack although the mask lets few
through (8.8% at the 1-GPU recipe's shapes, docs/benchmarks.md). Here each pack's attention is
computed piece by piece:
- the prompt over itself, causal (`is_causal`);
- each response over the prompt and its own earlier tokens: the causal mask aligned to the
  bottom-right corner of its (n, P + n) block, query i seeing keys 0 .. P + i (a boolean mask:
  PyTorch's `causal_lower_right` object does not survive a TorchDispatchMode such as
  bench_train's op count);
- padding over itself (its output is its own value, as under the block mask; no real token sees it).
So only the allowed pairs are computed (and each response's prompt block): the same attention as
the block mask, the same log-probs to float rounding (tests/test_segment_attention.py).
`segments(model)` turns it on for a model inside a `with` (a transformers attention function);
`lab.bench_train --parts attention` times both on a GPU. train.py keeps the block mask until that
run says which pays.
"""
import contextlib

import torch
import torch.nn.functional as F

import train

NAME = "packed_segments"
LAYOUT = []  # the packs of the pass running now: [(prompt start, P, [(first column, end), ...])]


def segment_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      **kwargs):
    """transformers' attention interface: query (packs, heads, L, d), key and value (packs,
    kv_heads, L, d); returns (packs, L, heads, d). The mask is ignored: LAYOUT says the same."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    packs = []
    for j, (start, P, responses) in enumerate(LAYOUT):
        q, k, v = query[j], key[j], value[j]  # (heads, L, d)
        parts = [v[:, :start],  # left padding: itself
                 F.scaled_dot_product_attention(q[:, start:P], k[:, start:P], v[:, start:P],
                                                is_causal=True, scale=scaling)]
        for first, end in responses:
            keys = torch.cat([k[:, start:P], k[:, first:end]], 1)
            values = torch.cat([v[:, start:P], v[:, first:end]], 1)
            mask = torch.ones(end - first, keys.shape[1], dtype=torch.bool,
                              device=q.device).tril(keys.shape[1] - (end - first))
            parts.append(F.scaled_dot_product_attention(q[:, first:end], keys, values,
                                                        attn_mask=mask, scale=scaling))
        last = responses[-1][1] if responses else P
        parts.append(v[:, last:])  # right padding (shorter packs): itself
        packs.append(torch.cat(parts, 1))
    return torch.stack(packs).transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def segments(model):
    """Run `model`'s packed passes with segment_attention inside the block."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, segment_attention)
    config = getattr(model, "module", model).config
    implementation, pack_layout = config._attn_implementation, train.pack_layout

    def layout(prompts, response_mask):  # token_logprobs' layout, kept for segment_attention
        packs, P, L, pack_of_row, kept_column = pack_layout(prompts, response_mask)
        LAYOUT[:] = [(P - len(prompt), P, [(P + offset, P + offset + length)
                                           for _, offset, length in members])
                     for prompt, members in packs]
        return packs, P, L, pack_of_row, kept_column

    config._attn_implementation, train.pack_layout = NAME, layout
    try:
        yield
    finally:
        config._attn_implementation, train.pack_layout = implementation, pack_layout
        LAYOUT.clear()
