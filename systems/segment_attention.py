"""Attention by sequences: logprobs.token_logprobs' packed passes compute only the pairs the pack's
mask lets through, when asked (by_segments; issue 35).

logprobs.token_logprobs packs an RLOO group as one sequence, the prompt once and then each response,
with a block mask (pack_layout); SDPA under that mask computes every (query, key) pair of the L x L
pack, although the mask lets few through (12.4% at the 1-GPU recipe's shapes: a pack of 160 prompt
tokens and 5 responses of 1,024), and a mask keeps SDPA off its flash kernel.
By sequences, the attention (only the attention: the linear layers still see each prompt token
once) takes each response as the sequence it stands for, its prompt and then itself, gathered from
the pack's queries, keys and values (rope is already in them):
- plain causal attention over it (`is_causal`, no mask: SDPA's flash kernel on a GPU, in bf16; the
  memory-efficient one in fp32; a CPU's flash kernel), a query seeing its prompt and its own
  earlier tokens, exactly what the block mask lets it see;
- the responses of similar lengths batched together (SEQUENCE_BUCKET), right-padded: padding comes
  last, so under the causal mask no real position sees it;
- the prompt's columns take their output from the pack's first sequence; padding's output is 0
  (the block mask's padding saw itself; no real token sees it and no log-prob reads it).
So each response's attention is that of its own sequence, the same log-probs to float rounding
(tests/test_segment_attention.py). It computes about R x S^2 / 2 pairs (R responses, S = prompt +
response) where the block mask computes L^2 a pack: at the recipe's pack, 3.5M against 27.9M. The
prompt's own pairs are computed once for each of its responses: where prompts are long and
responses short (500 tokens against 5 x 20) that is more than the block mask's.

Measured on an H200 at the Qwen2.5-1.5B shape (docs/benchmarks.md), in an earlier version (each
segment a 3-D tensor under a boolean mask, SDPA's math kernels): a no-grad pass took 0.87 of the
block mask's time in fp32, a gradient pass 1.22. train.py takes one way in every pass (by sequences
on the devices runtime.BY_SEQUENCES_ON names: none yet), so the values of the KL in the reward
(no-grad passes) and in the loss (the gradient pass, whose own values it uses where the two passes
share a dtype) come from one computation. The rule that decides at the next GPU measurement, and
its prediction, are registered in docs/benchmarks.md.
`attention(model)` makes segment_attention `model`'s attention function inside a `with` (a
transformers attention function: the model's forward passes its `segments` keyword down to it).
"""
import collections
import contextlib
import math

import torch
import torch.nn.functional as F

NAME = "packed_segments"
SEQUENCE_BUCKET = 128  # sequences whose lengths round up to the same multiple share one SDPA call


def layout(packs, P, L, device):
    """The sequences of logprobs.pack_layout's packs (prompts left-padded to P, packs of L columns):
    (buckets, source). Each bucket is (pack (R,), column (R, S)): sequence r is pack[r]'s columns
    column[r], its prompt's then its response's, then padding (column 0) up to the bucket's longest
    S. source (packs, L) is the row of the buckets' outputs, flattened and concatenated, then a
    zero row, that each pack column takes."""
    by_size = collections.defaultdict(list)  # the sequences, (pack, first of its pack?, columns)
    for j, (prompt, members) in enumerate(packs):
        for i, (_, offset, length) in enumerate(members):
            columns = list(range(P - len(prompt), P)) + list(range(P + offset, P + offset + length))
            by_size[math.ceil(len(columns) / SEQUENCE_BUCKET)].append((j, i == 0, columns))
    buckets, placed, offset = [], [], 0  # placed: (pack, column, the outputs' row it takes)
    for _, members in sorted(by_size.items()):
        S = max(len(columns) for _, _, columns in members)
        column = torch.zeros(len(members), S, dtype=torch.long)
        for r, (j, first, columns) in enumerate(members):
            column[r, :len(columns)] = torch.tensor(columns)
            # the prompt's columns from the pack's first sequence, the response's from its own
            start = 0 if first else len(packs[j][0])
            placed += [(j, c, offset + r * S + i) for i, c in enumerate(columns) if i >= start]
        buckets.append((torch.tensor([j for j, _, _ in members], device=device),
                        column.to(device)))
        offset += len(members) * S
    source = torch.full((len(packs), L), offset, dtype=torch.long)  # offset: the zero row's
    if placed:
        j, c, r = torch.tensor(placed).T
        source[j, c] = r
    return buckets, source.to(device)


def segment_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      segments=None, **kwargs):
    """transformers' attention interface: query (packs, heads, L, d), key and value (packs,
    kv_heads, L, d); returns (packs, L, heads, d). The mask is ignored: `segments` (layout's) says
    the same."""
    buckets, source = segments
    if torch.is_autocast_enabled(query.device.type):  # SDPA would cast q, k, v: gather them cast
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    outputs = []
    for pack, column in buckets:
        # the bucket's sequences, (R, heads, S, d), gathered from their packs' columns
        q, k, v = (x.transpose(1, 2)[pack[:, None], column].transpose(1, 2)
                   for x in (query, key, value))
        groups = q.shape[1] // k.shape[1]  # grouped-query attention: each kv head serves `groups`
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling)
        outputs.append(out.transpose(1, 2).flatten(0, 1))  # (R * S, heads, d)
    outputs.append(outputs[-1].new_zeros(1, *outputs[-1].shape[1:]))  # padding's output
    return torch.cat(outputs)[source], None


@contextlib.contextmanager
def attention(model):
    """Inside the block, `model` (or the module a DDP wrapper holds) attends with
    segment_attention; its forward must be given `segments`."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, segment_attention)
    config = getattr(model, "module", model).config
    implementation, config._attn_implementation = config._attn_implementation, NAME
    try:
        yield
    finally:
        config._attn_implementation = implementation
