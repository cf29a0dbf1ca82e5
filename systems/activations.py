"""What a CPU run's gradient pass keeps for its backward, in bytes, by a closed form, and the two
choices made by it (issue 62; machinery, not the paper's: the gradient is the same either way):

- `recompute_on_cpu`: --recompute auto on a CPU is "none" (no layer's forward again in the backward,
  about a quarter of the gradient pass's time on an AVX2 CPU: docs/benchmarks.md) where one
  micro-batch's pass without recomputation fits the budget, "full" otherwise.
- `keeps_graphs`: train.py's one policy pass a step (train.policy_logprobs): the log-probs step
  keeps each micro-batch's graph for the update, so that the no-grad policy pass is not run at all,
  where every micro-batch's graph fits the budget at once; otherwise the two passes of before.

The budget: a run on a CPU may take RUN_SHARE of the machine's memory (physical, or the container's
limit where lower), shared among the ranks on it; what the weights, gradients, AdamW's moments and
the reference take (PROCESS_BYTES more for Python, torch and transformers) comes off first.

The closed form counts what autograd keeps of a Llama-family decoder layer (Llama, Qwen2, Qwen3) in
fp32 at each packed position (logprobs.pack_layout, or shared_prefix_pack's one sequence): 7.5 d +
4.125 d_q + 4.375 i numbers (d hidden, d_q the query heads' width, i the MLP's: the RMSNorms' inputs
and outputs, attention's inputs and output, the MLP's gate, up, SiLU(gate) and their product), with
Qwen3's q and k norms 2 (d_q + d_kv) more, and attention's mask as an fp32 L x L a layer. The
coefficients are fitted to lab/memory_plan.py's trace of the pass (FakeTensorMode, every op's
storages), one width changed at a time; under --recompute full a layer keeps its input only (d).
The output layer's log-softmax over the vocabulary, rows x T x V, is kept either way, and its
backward makes two more of its size (the pass takes the response tokens' rows only: an overcount
where responses end before T, exact for the worst shape). tests/test_activations.py holds the form
against the trace.
"""
import os

import logprobs

RUN_SHARE = 0.5  # of the machine's memory, the most a CPU run's plan may take
PROCESS_BYTES = 0.4e9  # Python, torch and transformers, resident before any tensor (a rank)
FLOAT = 4  # bytes: the CPU passes that keep graphs are fp32


def machine_bytes():
    """The memory this process may use: physical memory, or the cgroup's limit where lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            limit = open(path).read().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = min(total, int(limit))
    return total


def budget(num_params, reference, ranks_here=1, sharded_over=1):
    """Bytes a rank's activations may take: its share of RUN_SHARE of the machine, less its fp32
    weights, gradients and AdamW moments (16 bytes a parameter; split over the ranks under FSDP),
    the fp32 reference (4) and PROCESS_BYTES."""
    fixed = num_params * (16 + 4 * reference) / sharded_over + PROCESS_BYTES
    return RUN_SHARE * machine_bytes() / ranks_here - fixed


def kept_per_position(config, recompute):
    """Bytes a decoder layer keeps for its backward at one packed position (module docstring)."""
    d, i = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or d // config.num_attention_heads
    d_q, d_kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    if recompute == "full":
        return FLOAT * d
    # selective keeps less than none (its matmuls' outputs): counted as none, an upper bound
    numbers = 7.5 * d + 4.125 * d_q + 4.375 * i
    if config.model_type == "qwen3":  # its q and k norms, inputs and outputs
        numbers += 2 * (d_q + d_kv)
    return FLOAT * numbers


def micro_batch_shapes(config, prompts, response_mask, micro_batch, share_prefix=False):
    """(positions, rows, T, mask) of each micro-batch the passes make of these rows
    (micro_batch_sizes): positions as token_logprobs lays them out (pack_layout's packs x its
    longest pack L, or with share_prefix where it pays the one sequence's L), the attention mask's
    packs x L x L entries."""
    shapes, start = [], 0
    for size in logprobs.micro_batch_sizes(prompts, micro_batch):
        rows = slice(start, start + size)
        packs, _, length, _, _ = logprobs.pack_layout(prompts[rows], response_mask[rows])
        packs = len(packs)
        if share_prefix and logprobs.sharing_pays(config, prompts[rows], response_mask[rows]):
            packs, length = 1, logprobs.shared_layout(prompts[rows], response_mask[rows])[3]
        shapes.append((packs * length, size, response_mask.shape[1], packs * length ** 2))
        start += size
    return shapes


def graph_bytes(config, shape, recompute):
    """What one micro-batch's gradient pass keeps from its forward to its backward."""
    positions, rows, T, mask = shape
    head = FLOAT * rows * T * config.vocab_size  # the log-softmax over the vocabulary
    # without recomputation each layer also keeps attention's mask, as floats
    per_layer = positions * kept_per_position(config, recompute) + (
        FLOAT * mask if recompute != "full" else 0)
    return config.num_hidden_layers * per_layer + head


def backward_bytes(config, shape, recompute):
    """What the backward of one micro-batch adds while it runs: the log-softmax's gradient and its
    softmax (two of the head's size), and under full one layer's forward again."""
    positions, rows, T, mask = shape
    again = (positions * kept_per_position(config, "none") + FLOAT * mask
             if recompute == "full" else 0)
    return 2 * FLOAT * rows * T * config.vocab_size + again


def pass_peak(config, shape, recompute):
    """One micro-batch's gradient pass at its peak, beside the parameters' gradients: as its
    backward starts, or at its end, where the embedding's gradient is made (with a tied output
    layer, three of its size as the two uses' gradients are summed)."""
    embedding = FLOAT * config.vocab_size * config.hidden_size
    tied = getattr(config, "tie_word_embeddings", False)
    return max(graph_bytes(config, shape, recompute) + backward_bytes(config, shape, recompute),
               (3 if tied else 1) * embedding)


def recompute_on_cpu(config, worst_shape, room):
    """--recompute auto on a CPU: "none" where one micro-batch of worst_shape fits `room` bytes
    (budget) without recomputation, else "full"."""
    return "none" if pass_peak(config, worst_shape, "none") <= room else "full"


def keeps_graphs(config, shapes, recompute, room):
    """Whether every micro-batch's graph (shapes: micro_batch_shapes) fits `room` at once, with the
    largest one's backward."""
    kept = sum(graph_bytes(config, shape, recompute) for shape in shapes)
    return kept + max(backward_bytes(config, shape, recompute) for shape in shapes) <= room


def worst_shape(prompt_tokens, group_size, micro_batch, rows_per_rank, max_new_tokens):
    """The largest micro-batch a run can make (micro_batch_sizes): as many whole groups as
    micro_batch holds (a pack each, its prompt prompt_tokens long), or micro_batch rows of one
    group larger than it, every response at max_new_tokens: (positions, rows, T, mask); where
    the prompts share a prefix (share_prefix) an upper bound."""
    rows = min(micro_batch, rows_per_rank)
    packs, per_pack = (rows // group_size, group_size) if group_size <= rows else (1, rows)
    length = prompt_tokens + per_pack * max_new_tokens
    return packs * length, packs * per_pack, max_new_tokens, packs * length ** 2
