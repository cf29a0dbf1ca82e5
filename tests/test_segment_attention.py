"""systems/segment_attention.py: the packed passes by segments equal the block mask's.

Two packs of different lengths (the shorter one right-padded), prompts of different lengths (the
shorter one left-padded), responses that end early, for tiny Llama, Qwen2 and Qwen3 models with
grouped-query attention, in fp32: the log-probs, entropies and the parameter gradient equal the
block mask's (the sequences in one SDPA call a layer or in several, activation checkpointing off and
on), and the segment function is the one that ran only where asked (train.py keeps the block mask
in every pass). A lone response and an empty one; bf16 autocast's dtype kept."""
import contextlib

import pytest
import torch

import logprobs
from systems import segment_attention
from test_rollout import FAMILIES, tiny_model

PROMPTS = [[5, 6, 7, 8, 9, 10]] * 3 + [[11, 12]] * 2


def batch(model):
    torch.manual_seed(1)
    responses = torch.randint(3, model.config.vocab_size, (len(PROMPTS), 9))
    mask = torch.ones(len(PROMPTS), 9)
    mask[1, 5:], mask[3, 2:], mask[4, 7:] = 0, 0, 0
    return responses * mask.long(), mask


@pytest.fixture
def calls(monkeypatch):
    """The layers' calls of segment_attention (as transformers finds it: by its registered name)."""
    calls, function = [], segment_attention.segment_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return function(*args, **kwargs)
    monkeypatch.setattr(segment_attention, "segment_attention", counted)
    return calls


@pytest.mark.parametrize("bucket, checkpointing", [(128, False), (4, False), (128, True)])
@pytest.mark.parametrize("family", FAMILIES)
def test_segments_equal_the_block_mask(family, bucket, checkpointing, calls, monkeypatch):
    """In one SDPA call a layer (the sequences' lengths, 4 to 15, share a bucket of 128), in three
    (buckets of 4 tokens: sequences right-padded to different lengths), and under activation
    checkpointing (the backward recomputes the forward: inside segment_attention.attention)."""
    monkeypatch.setattr(segment_attention, "SEQUENCE_BUCKET", bucket)
    model = tiny_model(family)
    if checkpointing:
        getattr(model, "activation_checkpointing_enable",  # as train.py turns it on
                model.gradient_checkpointing_enable)({"use_reentrant": False})
        model.train()
    responses, mask = batch(model)
    implementation = model.config._attn_implementation

    def run(by_segments):
        model.zero_grad(set_to_none=True)
        around = segment_attention.attention(model) if by_segments and checkpointing else (
            contextlib.nullcontext())
        with around:
            logp, entropy = logprobs.token_logprobs(model, PROMPTS, responses, mask, 0.7,
                                                    torch.float32, entropy=True,
                                                    by_segments=by_segments)
            logp.sum().backward()
        return logp.detach(), entropy, [p.grad.clone() for p in model.parameters()]
    (logp, entropy, grads), (ours, our_entropy, our_grads) = run(False), run(True)
    # by segments only when asked; under checkpointing a layer runs again in the backward
    assert len(calls) == model.config.num_hidden_layers * (1 + checkpointing)
    assert model.config._attn_implementation == implementation  # restored
    torch.testing.assert_close(ours, logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(our_entropy, entropy, atol=1e-5, rtol=0)
    for ours_grad, grad in zip(our_grads, grads):
        torch.testing.assert_close(ours_grad, grad, atol=1e-5, rtol=1e-4)


def test_a_lone_response_and_an_empty_one(calls):
    """A group of one response, and a response of no tokens (its row all mask 0): the same values
    as the block mask's, 0 in the empty row."""
    model = tiny_model("llama3")
    prompts = [[5, 6, 7]] + [[8, 9, 10, 11]] * 2
    responses, mask = torch.randint(3, model.config.vocab_size, (3, 6)), torch.ones(3, 6)
    mask[1] = 0
    with torch.no_grad():
        block = logprobs.token_logprobs(model, prompts, responses, mask, 1.0, torch.float32, True)
        ours = logprobs.token_logprobs(model, prompts, responses, mask, 1.0, torch.float32, True,
                                       by_segments=True)
    for got, expected in zip(ours, block):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert ours[0][1].abs().sum() == 0 and len(calls) == model.config.num_hidden_layers


def test_in_bf16_autocast_attention_stays_bf16(calls, monkeypatch):
    """In the gradient pass's bf16 autocast, rope leaves q and k in fp32 (cos and sin take the fp32
    embeddings' dtype) and v in bf16: the sequences are gathered in bf16, and the output is bf16
    as SDPA's own (not promoted to fp32 by a zero row of another dtype)."""
    outputs, function = [], segment_attention.segment_attention

    def recorded(*args, **kwargs):
        out, weights = function(*args, **kwargs)
        outputs.append(out)
        return out, weights
    monkeypatch.setattr(segment_attention, "segment_attention", recorded)
    model = tiny_model("qwen2")
    responses, mask = batch(model)
    with torch.no_grad():
        block, _ = logprobs.token_logprobs(model, PROMPTS, responses, mask, 1.0, torch.bfloat16)
        ours, _ = logprobs.token_logprobs(model, PROMPTS, responses, mask, 1.0, torch.bfloat16,
                                          by_segments=True)
    assert {out.dtype for out in outputs} == {torch.bfloat16}
    torch.testing.assert_close(ours, block, atol=0.1, rtol=0)  # bf16's rounding, either way


def test_no_grad_passes_by_segments_and_train_pys_block_mask(calls):
    """logprobs.no_grad_logprobs(by_segments=True) attends by segments, micro-batch by micro-batch,
    with the block mask's values; by default (train.py's no-grad passes and its gradient pass) the
    block mask, so the reward's and the loss's log-probs come from one computation."""
    model = tiny_model("qwen2")
    responses, mask = batch(model)
    logp, entropy = logprobs.no_grad_logprobs(model, PROMPTS, responses, mask, 1.0, torch.float32,
                                              micro_batch=3, entropy=True, by_segments=True)
    assert len(calls) == 2 * model.config.num_hidden_layers  # two micro-batches: 3 rows, 2 rows
    block, block_entropy = logprobs.no_grad_logprobs(model, PROMPTS, responses, mask, 1.0,
                                                     torch.float32, micro_batch=3, entropy=True)
    with torch.no_grad():
        logprobs.token_logprobs(model, PROMPTS, responses, mask, 1.0, torch.float32)
    assert len(calls) == 2 * model.config.num_hidden_layers
    torch.testing.assert_close(logp, block, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, block_entropy, atol=1e-5, rtol=0)
