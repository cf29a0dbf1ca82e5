"""segment_attention.py: the packed passes by segments equal the block mask's.

Two packs of different lengths (the shorter one right-padded), prompts of different lengths (the
shorter one left-padded), responses that end early, for tiny Llama, Qwen2 and Qwen3 models with
grouped-query attention, in fp32: the log-probs, entropies and the parameter gradient equal the
block mask's, with the sequences in one SDPA call or in several, and the segment function is the one that ran only where asked (train.py keeps the
block mask in every pass)."""
import pytest
import torch

import logprobs
import segment_attention
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


@pytest.mark.parametrize("bucket", [128, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_segments_equal_the_block_mask(family, bucket, calls, monkeypatch):
    """In one SDPA call a layer (the sequences' lengths, 3 to 15, share a bucket of 128), and in
    three (buckets of 4 tokens: sequences right-padded to different lengths)."""
    monkeypatch.setattr(segment_attention, "SEQUENCE_BUCKET", bucket)
    model = tiny_model(family)
    responses, mask = batch(model)
    implementation = model.config._attn_implementation

    def run(by_segments):
        model.zero_grad(set_to_none=True)
        logp, entropy = logprobs.token_logprobs(model, PROMPTS, responses, mask, 0.7, torch.float32,
                                                entropy=True, by_segments=by_segments)
        logp.sum().backward()
        return logp.detach(), entropy, [p.grad.clone() for p in model.parameters()]
    (logp, entropy, grads), (ours, our_entropy, our_grads) = run(False), run(True)
    assert len(calls) == model.config.num_hidden_layers  # by segments only when asked
    assert model.config._attn_implementation == implementation  # restored
    torch.testing.assert_close(ours, logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(our_entropy, entropy, atol=1e-5, rtol=0)
    for ours_grad, grad in zip(our_grads, grads):
        torch.testing.assert_close(ours_grad, grad, atol=1e-5, rtol=1e-4)


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
