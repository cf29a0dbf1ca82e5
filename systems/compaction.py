"""The sampler's CPU speed machinery: rollout.decode_loop's samples, finished rows leaving the batch.

On a CPU, where a decode step is compute-bound, a row that emits EOS leaves the batch: the last live
rows move into its cache slots, so the next steps run on fewer rows, and attention reads the slots
of the longest live row only. Each of these choices asks the host for a number (a sync) and gives a
new shape when a row finishes, which a GPU's CUDA graph cannot replay (systems/cuda_decode.py runs
rollout's fixed-shape step there). It draws the same tokens from the same uniforms as
rollout.decode_loop, up to float rounding (tests/test_static_decode.py). Kept by the registered
rule of studies/one-loop-cpu: without it the default run's whole train step took 1.038 of its CPU
time (mean of 4 paired rounds, above the rule's 1.03; 95% interval 0.92 to 1.16). rollout.py's
decode_rows calls it on a CPU (generate(fast=None)); generate(fast=False) runs rollout's own loop.
"""
import torch

import rollout


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
        tokens, logprobs = rollout.sample(logits, temperature, top_p, uniforms[row_of_slot, step])
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
        logits = rollout.decode(model, tokens, live, int(live.seqlens.max()) + 1)  # the span


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
