"""One-off (machine B as AVX2, 2026-12-04): what the decode step's attention would cost if each row
read only its own slots past the shared prompt, the bound on reading the prompt's K/V once for all
rows. SDPA as rollout.sdpa_attention calls it (SmolLM2-135M's 3 K/V heads of 64, 3 query heads
each, 32 rows of one new token, the additive mask), over random caches of 30 layers (read as a
step reads them, one layer after another), at the spans of bench_llamacpp's shape: 213 slots (the
173-token prompt and 40 new tokens) and 40 (the new tokens alone). Each span timed twice, the two
alternated, each time the median of 5 rounds of 100 calls; printed: the median of the two. Its
printed lines: decode_attention_span.txt. No prediction: a bound, read by the doc, decides nothing.
`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python
studies/cpu-step/decode_attention_span.py`."""
import statistics
import time

import torch
import torch.nn.functional as F

ROWS, KV_HEADS, GROUPS, HEAD_DIM, LAYERS = 32, 3, 3, 64, 30
torch.manual_seed(0)


def per_call_ms(span, rounds=5, calls=100):
    k = [torch.randn(ROWS, span, KV_HEADS, HEAD_DIM) for _ in range(LAYERS)]
    v = [torch.randn(ROWS, span, KV_HEADS, HEAD_DIM) for _ in range(LAYERS)]
    q = torch.randn(ROWS, KV_HEADS, GROUPS, HEAD_DIM)
    bias = torch.zeros(ROWS, 1, GROUPS, span)

    def call(layer):
        return F.scaled_dot_product_attention(q, k[layer].transpose(1, 2), v[layer].transpose(1, 2),
                                              attn_mask=bias, scale=HEAD_DIM ** -0.5)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for i in range(calls):
            call(i % LAYERS)
        times.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(times)


results = {span: [] for span in (213, 40)}
for _ in range(2):
    for span in results:
        results[span].append(per_call_ms(span))
for span, ms in results.items():
    layer_ms = statistics.median(ms)
    print(f"span {span}: {layer_ms:.3f} ms a layer ({LAYERS * layer_ms:.1f} ms a step), rounds' "
          f"medians {', '.join(f'{m:.3f}' for m in ms)}")
