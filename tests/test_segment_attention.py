"""lab/segment_attention.py: the packed passes by segments equal train.py's block-mask passes.

Two packs of different lengths (the shorter one right-padded), prompts of different lengths (the
shorter one left-padded), responses that end early, for tiny Llama, Qwen2 and Qwen3 models with
grouped-query attention, in fp32: the log-probs, entropies and the parameter gradient equal the
block mask's, and the segment function is the one that ran."""
import pytest
import torch

import train
from lab import segment_attention
from test_rollout import FAMILIES, tiny_model

PROMPTS = [[5, 6, 7, 8, 9, 10]] * 3 + [[11, 12]] * 2


@pytest.mark.parametrize("family", FAMILIES)
def test_segments_equal_the_block_mask(family, monkeypatch):
    model = tiny_model(family)
    torch.manual_seed(1)
    responses = torch.randint(3, model.config.vocab_size, (len(PROMPTS), 9))
    mask = torch.ones(len(PROMPTS), 9)
    mask[1, 5:], mask[3, 2:], mask[4, 7:] = 0, 0, 0
    responses = responses * mask.long()
    calls = []
    function = segment_attention.segment_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return function(*args, **kwargs)
    monkeypatch.setattr(segment_attention, "segment_attention", counted)

    def run(segments):
        model.zero_grad(set_to_none=True)
        with segment_attention.segments(model) if segments else torch.enable_grad():
            logp, entropy = train.token_logprobs(model, PROMPTS, responses, mask, 0.7,
                                                 torch.float32, entropy=True)
        logp.sum().backward()
        return logp.detach(), entropy, [p.grad.clone() for p in model.parameters()]
    (logp, entropy, grads), (ours, our_entropy, our_grads) = run(False), run(True)
    assert calls and len(calls) == model.config.num_hidden_layers
    assert model.config._attn_implementation != segment_attention.NAME  # restored
    torch.testing.assert_close(ours, logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(our_entropy, entropy, atol=1e-5, rtol=0)
    for ours_grad, grad in zip(our_grads, grads):
        torch.testing.assert_close(ours_grad, grad, atol=1e-5, rtol=1e-4)
