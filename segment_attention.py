"""Attention by segments: logprobs.token_logprobs' packed passes compute only the pairs the pack's
mask lets through, when asked (by_segments; issue 35).

logprobs.token_logprobs packs an RLOO group as one sequence, the prompt once and then each response,
with a block mask (pack_layout); SDPA under that mask computes every (query, key) pair of the L x L
pack, although the mask lets few through (12.4% at the 1-GPU recipe's shapes: a pack of 160 prompt
tokens and 5 responses of 1,024).
By segments, each pack's attention is computed piece by piece:
- the prompt over itself, causal (`is_causal`);
- each response over the prompt and its own earlier tokens: the causal mask aligned to the
  bottom-right corner of its (n, P + n) block, query i seeing keys 0 .. P + i (a boolean mask:
  PyTorch's `causal_lower_right` object does not survive a TorchDispatchMode such as
  lab/bench_train.py's op count);
- padding over itself (its output is its own value, as under the block mask; no real token sees it).
So only the allowed pairs are computed (and each response's prompt block): the same attention as
the block mask, the same log-probs to float rounding (tests/test_segment_attention.py).

Measured on an H200 at the Qwen2.5-1.5B shape (docs/benchmarks.md), when each segment went to SDPA
as a 3-D tensor (its math kernels): a no-grad pass took 0.87 of the block mask's time in fp32 and
0.84 in bf16x6, a gradient pass 1.22. Since, the segments are 4-D, so SDPA may pick a fused kernel
(a CPU's flash kernel does): at the default run's shapes, on one CPU thread, a no-grad pass by
segments took 1.003 of the block mask's time, 1.096 in 3-D (studies/segments-cpu); not yet on a GPU.
train.py keeps the block mask in every pass for now: the values of the KL in the reward (no-grad
passes) and in the loss (the gradient pass, whose own values it uses where the two passes share a
dtype) come from one computation, and the gradient pass was slower by segments. The rule that
decides at the next GPU measurement, and its prediction, are registered in docs/benchmarks.md.
`attention(model)` makes segment_attention `model`'s attention function inside a `with` (a
transformers attention function: the model's forward passes its `segments` keyword down to it).
"""
import contextlib

import torch
import torch.nn.functional as F

NAME = "packed_segments"


def layout(packs, P):
    """Each pack's segments, from logprobs.pack_layout's packs: (the prompt's first column, P, the
    responses' [first column, end) spans)."""
    return [(P - len(prompt), P, [(P + offset, P + offset + length)
                                  for _, offset, length in members])
            for prompt, members in packs]


def segment_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      segments=(), **kwargs):
    """transformers' attention interface: query (packs, heads, L, d), key and value (packs,
    kv_heads, L, d); returns (packs, L, heads, d). The mask is ignored: `segments` (layout's, one
    entry a pack) says the same."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    packs = []
    for j, (start, P, responses) in enumerate(segments):
        # (1, heads, L, d): 4-D, so that SDPA may pick a fused kernel (3-D runs its math)
        q, k, v = query[j:j + 1], key[j:j + 1], value[j:j + 1]
        parts = [v[:, :, :start],  # left padding: itself
                 F.scaled_dot_product_attention(q[:, :, start:P], k[:, :, start:P],
                                                v[:, :, start:P], is_causal=True, scale=scaling)]
        for first, end in responses:
            keys = torch.cat([k[:, :, start:P], k[:, :, first:end]], 2)
            values = torch.cat([v[:, :, start:P], v[:, :, first:end]], 2)
            mask = torch.ones(end - first, keys.shape[2], dtype=torch.bool,
                              device=q.device).tril(keys.shape[2] - (end - first))
            parts.append(F.scaled_dot_product_attention(q[:, :, first:end], keys, values,
                                                        attn_mask=mask, scale=scaling))
        last = responses[-1][1] if responses else P
        parts.append(v[:, :, last:])  # right padding (shorter packs): itself
        packs.append(torch.cat(parts, 2))
    return torch.cat(packs).transpose(1, 2).contiguous(), None


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
