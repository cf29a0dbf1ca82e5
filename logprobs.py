"""Step 3 of train.py: log pi(y_t | x, y<t) of every sampled token, a forward pass a micro-batch.

The trainer runs this pass three times a step: under the policy and the reference with no gradient
(no_grad_logprobs: the values that feed kl.py's estimators, the ratio and the reward's shaping; fp32
by default, docs/precision.md), and under the policy with a gradient (token_logprobs, in
train.update); twice where the gradient pass's values are the no-grad pass's (one CPU process,
on-policy, fp32: train.policy_logprobs keeps its graphs for the update). Each RLOO group is one
packed sequence (pack_layout): its prompt once, then each response in its own length, every
response attending to the prompt and to its own earlier tokens, so a token sees exactly what it
would see alone. Micro-batches keep a group whole
(micro_batch_sizes). systems/segment_attention.py computes the same attention without the pack's
dense mask. On a CPU (runtime.SHARED_PREFIX_ON) the groups of a micro-batch share one sequence,
their prompts' common prefix (the chat template, the few-shot examples) computed once
(shared_prefix_pack), where that costs fewer FLOPs (sharing_pays).
"""
import contextlib
import itertools
import os

import torch
from torch.distributed.fsdp import FSDPModule

from systems import runtime
from systems import segment_attention
from systems import split_matmul


def response_lengths(response_mask):
    """Each row's length, up to its last response token (a list)."""
    t = torch.arange(1, response_mask.shape[1] + 1)
    return torch.where(response_mask.detach().cpu() != 0, t, 0).max(1).values.tolist()


def response_tokens(response_mask):
    """(row, column) of every response token (the mask's nonzero entries), host tensors."""
    return (response_mask.detach().cpu() != 0).nonzero(as_tuple=True)


def pack_layout(prompts, response_mask):
    """How token_logprobs packs the rows: (packs, P, L, pack_of_row, kept_column). Runs of rows with
    the same prompt (an RLOO group is contiguous) share a pack, a list of (row, offset, length):
    the prompt once, left-padded to the width P, then each response in its own `length` columns
    (up to its last response token: padding takes no column) at P + offset. L is the longest
    pack. The logits kept start at column P - 1 (the prompt's last, which predicts every
    response's token 0); kept_column (B, T) is the kept index that predicts token t of each row
    (0 past its length, where the mask is 0)."""
    B, T = response_mask.shape
    lengths = response_lengths(response_mask)
    packs = []  # (prompt, [(row, offset, length), ...])
    for row, prompt in enumerate(prompts):
        if not packs or packs[-1][0] != prompt:
            packs.append((prompt, []))
        members = packs[-1][1]
        offset = members[-1][1] + members[-1][2] if members else 0
        members.append((row, offset, lengths[row]))
    P = max(len(prompt) for prompt, _ in packs)
    L = P + max(offset + length for _, members in packs for _, offset, length in members[-1:])
    pack_of_row, kept_column = torch.zeros(B, dtype=torch.long), torch.zeros(B, T, dtype=torch.long)
    for j, (_, members) in enumerate(packs):
        for row, offset, length in members:
            pack_of_row[row] = j
            # token t >= 1 is predicted by column P + offset + t - 1: kept index offset + t
            kept_column[row, 1:length] = offset + torch.arange(1, max(length, 1))
    return packs, P, L, pack_of_row, kept_column


def shared_layout(prompts, response_mask):
    """shared_prefix_pack's plan: (groups: (prompt, its rows) for each run of rows with the same
    prompt, each row's length up to its last response token, the prompts' common prefix's length,
    the sequence's length L)."""
    lengths = response_lengths(response_mask)
    groups = []
    for row, prompt in enumerate(prompts):
        if not groups or groups[-1][0] != prompt:
            groups.append((prompt, []))
        groups[-1][1].append(row)
    shared = len(os.path.commonprefix([prompt for prompt, _ in groups]))
    L = shared + sum(len(prompt) - shared + sum(lengths[row] for row in rows)
                     for prompt, rows in groups)
    return groups, lengths, shared, L


def sharing_pays(config, prompts, response_mask):
    """Whether shared_prefix_pack's one sequence costs fewer FLOPs than pack_layout's packs: 2 a
    weight of a decoder layer at each position, and under the dense block mask 4 x hidden size a
    layer at each (query, key) pair the sequence computes, allowed or not (L^2 a sequence)."""
    packs, _, L, _, _ = pack_layout(prompts, response_mask)
    shared_L = shared_layout(prompts, response_mask)[3]
    d = config.hidden_size
    per_position = 2 * (4 * d * d + 3 * d * config.intermediate_size)  # ~ a layer's weights
    cost = lambda positions, pairs: positions * per_position + pairs * 4 * d  # noqa: E731
    return cost(shared_L, shared_L ** 2) < cost(len(packs) * L, len(packs) * L ** 2)


def shared_prefix_pack(prompts, responses, response_mask):
    """token_logprobs' layout with share_prefix: every row in one sequence, the prompts' longest
    common prefix once at its start, then each group (a run of rows with the same prompt) in turn:
    the rest of its prompt, then each of its responses in its own length. The rest attends to the
    prefix and to itself; a response to the prefix, its group's rest and its own earlier tokens,
    each at the position it has alone. Returns (input_ids (L,), position_ids (L,), allowed (L, L),
    keep: the columns whose logits are needed, kept_column (B, T): the index into keep that
    predicts token t of each row, 0 past its length)."""
    B, T = response_mask.shape
    groups, lengths, shared, L = shared_layout(prompts, response_mask)
    device = responses.device
    input_ids = torch.zeros(L, dtype=torch.long, device=device)
    position_ids = torch.zeros_like(input_ids)
    allowed = torch.zeros(L, L, dtype=torch.bool, device=device)

    def place(start, tokens, first_position, sees):  # tokens at columns start..., causal
        n = len(tokens)
        input_ids[start:start + n] = torch.as_tensor(tokens, device=device)
        position_ids[start:start + n] = torch.arange(first_position, first_position + n)
        allowed[start:start + n, start:start + n] = torch.ones(n, n, dtype=torch.bool).tril()
        for first, stop in sees:
            allowed[start:start + n, first:stop] = True
        return start + n
    at = place(0, groups[0][0][:shared], 0, [])
    keep, kept_column = [], torch.zeros(B, T, dtype=torch.long)
    for prompt, rows in groups:
        rest = (at, place(at, prompt[shared:], shared, [(0, shared)]))
        at = rest[1]
        last_prompt_column = at - 1 if len(prompt) > shared else shared - 1
        for row in rows:
            n, start = lengths[row], at
            at = place(at, responses[row, :n], len(prompt), [(0, shared), rest])
            # token 0 from the prompt's last column, token t >= 1 from the column of t - 1
            kept_column[row, :max(n, 1)] = len(keep) + torch.arange(max(n, 1))
            keep += [last_prompt_column, *range(start, start + n - 1)]
    return input_ids, position_ids, allowed, torch.tensor(keep, device=device), kept_column


def packed_inputs(model, prompts, responses, response_mask, by_segments):
    """token_logprobs' inputs in pack_layout's packs, a group each: (input_ids, position_ids,
    allowed, the logits to keep, pack_of_row, kept_column, by_segments' model keywords and
    attention context)."""
    packs, P, L, pack_of_row, kept_column = pack_layout(prompts, response_mask)
    segments, attention = {}, contextlib.nullcontext()
    device = responses.device
    input_ids = torch.zeros(len(packs), L, dtype=torch.long, device=device)
    position_ids = torch.zeros_like(input_ids)
    # allowed[j, query, key]: padding sees itself only
    allowed = torch.eye(L, dtype=torch.bool, device=device).repeat(len(packs), 1, 1)
    for j, (prompt, members) in enumerate(packs):
        start, n = P - len(prompt), len(prompt)
        input_ids[j, start:P] = torch.tensor(prompt)
        position_ids[j, start:P] = torch.arange(n)
        allowed[j, start:P, start:P] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        for row, offset, length in members:
            columns = slice(P + offset, P + offset + length)
            input_ids[j, columns] = responses[row, :length]
            position_ids[j, columns] = torch.arange(n, n + length)
            allowed[j, columns, start:P] = True
            allowed[j, columns, columns] = torch.ones(length, length, dtype=torch.bool,
                                                      device=device).tril()
    # by_segments: what `allowed` allows, as each response's own sequence
    # (systems/segment_attention.py)
    if by_segments:
        segments = {"segments": segment_attention.layout(packs, P, L, device)}
        attention = segment_attention.attention(model)
    return (input_ids, position_ids, allowed, L - P + 1, pack_of_row, kept_column, segments,
            attention)


def token_logprobs(model, prompts, responses, response_mask, temperature, dtype, entropy=False,
                   by_segments=False, share_prefix=False):
    """log pi(y_t | x, y<t) of each response token, (B, T) in fp32, and with entropy=True the
    entropy of pi there (detached; else None: the gradient pass skips its two (B, T, vocab)
    temporaries). by_segments: attention by sequences, each response with its prompt, causal, no
    mask (systems/segment_attention.py), the same values to float rounding (~4e-5 on SmolLM2:
    another order of fp32 sums); a gradient pass by segments under activation checkpointing keeps
    segment_attention.attention(model) around its backward too (the recomputation runs there).

    Rows with the same prompt (an RLOO group is contiguous) are packed into one sequence
    (pack_layout): the prompt once, then each of its responses in its own length, every response
    attending to the prompt and to its own earlier tokens only (a block attention mask, position
    ids restarting after the prompt). Each token sees exactly what it would see in its own
    sequence, but the prompt is computed once per group instead of G times, and padding after a
    response's end is not computed at all. Prompts are left-padded, so the responses start at
    column P and only the columns from P - 1 on reach the output layer. share_prefix: all the rows
    in one sequence, their prompts' common prefix once (shared_prefix_pack), where sharing_pays;
    only the columns that predict a response token reach the output layer.
    """
    segments, attention, device = {}, contextlib.nullcontext(), responses.device
    # share_prefix: one sequence, the prompts' common prefix once, where that costs fewer FLOPs
    if share_prefix and sharing_pays(runtime.unwrap(model).config, prompts, response_mask):
        input_ids, position_ids, allowed, to_keep, kept_column = shared_prefix_pack(
            prompts, responses, response_mask)
        input_ids, position_ids, allowed = input_ids[None], position_ids[None], allowed[None]
        pack_of_row = torch.zeros(len(prompts), dtype=torch.long)
    else:
        input_ids, position_ids, allowed, to_keep, pack_of_row, kept_column, segments, attention = (
            packed_inputs(model, prompts, responses, response_mask, by_segments))
    # no cast cache: each weight is used once per forward, and a cache would hold a bf16 copy of all
    # of them (0.25 GiB) through the pass
    with (torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32,
                         cache_enabled=False), attention):
        logits = model(input_ids=input_ids, attention_mask=allowed.unsqueeze(1),
                       position_ids=position_ids, use_cache=False, logits_to_keep=to_keep,
                       **segments).logits
    # only the response tokens' rows of logits, (N, vocab): the padding after each response's end
    # (up to the batch's longest) never reaches the log-softmax, forward or backward
    row, column = response_tokens(response_mask)
    logits = logits[pack_of_row[row].to(device), kept_column[row, column].to(device)]
    logits = logits.float() if temperature == 1 else logits.float() / temperature  # no copy at 1
    logp_all = logits.log_softmax(-1)
    del logits  # the entropy's (N, vocab) temporary takes its place: two such tensors at a time
    row, column = row.to(device), column.to(device)
    logp = logp_all.gather(-1, responses[row, column].unsqueeze(-1)).squeeze(-1)
    logp = torch.zeros(response_mask.shape, device=device).index_put((row, column), logp)  # (B, T)
    if not entropy:
        return logp * response_mask, None
    with torch.no_grad():
        entropy = -logp_all.exp().mul_(logp_all).sum(-1)  # one (N, vocab) temporary, not two
        entropy = torch.zeros(response_mask.shape, device=device).index_put((row, column), entropy)
    return logp * response_mask, entropy * response_mask


def micro_batch_sizes(prompts, micro_batch):
    """The rows' micro-batches, as sizes of consecutive runs: at most `micro_batch` rows each, and
    an RLOO group (a run of rows with the same prompt) never split across two unless it is larger
    than `micro_batch`. token_logprobs pads every pack of a micro-batch to the longest, so a
    micro-batch that straddled two groups computed up to a group's length twice: 1.5x the response
    tokens at the 1-GPU recipe's --group-size 5 --micro-batch 8 (docs/benchmarks.md)."""
    sizes, joinable = [], False  # joinable: the last micro-batch holds whole groups only
    for _, run in itertools.groupby(map(tuple, prompts)):
        group = len(list(run))
        if joinable and sizes[-1] + group <= micro_batch:
            sizes[-1] += group
            continue
        full, rest = divmod(group, micro_batch)
        sizes += [micro_batch] * full + [rest] * (rest > 0)
        joinable = full == 0
    return sizes


def no_grad_logprobs(model, prompts, responses, response_mask, temperature, dtype, micro_batch,
                     entropy=False, by_segments=False, share_prefix=False):
    """token_logprobs (and with entropy=True the entropies, else None) of the whole batch,
    micro-batch by micro-batch (micro_batch_sizes), no gradient. dtype "bf16x6": fp32 whose linear
    layers' matmuls are six bf16 tensor-core products (systems/split_matmul.py), CUDA's default.
    by_segments: token_logprobs'; train.py's on the devices runtime.BY_SEQUENCES_ON names (none
    yet: its gradient pass was faster with the block mask on an H200), in every pass alike;
    share_prefix: token_logprobs', train.py's on the devices runtime.SHARED_PREFIX_ON names."""
    parts, start = [], 0
    pieces = contextlib.nullcontext()
    if dtype == "bf16x6":
        pieces, dtype = split_matmul.bf16_pieces(6), torch.float32
    with torch.no_grad(), pieces:
        for size in micro_batch_sizes(prompts, micro_batch):
            rows, start = slice(start, start + size), start + size
            parts.append(token_logprobs(model, prompts[rows], responses[rows], response_mask[rows],
                                        temperature, dtype, entropy, by_segments, share_prefix))
    if isinstance(model, FSDPModule):  # FSDP2 keeps a root gathered after a forward until its
        model.reshard()  # backward, which a no-grad pass never runs (4.4 GB a rank at 7B)
    logp, entropies = zip(*parts)
    return torch.cat(logp), torch.cat(entropies) if entropy else None
