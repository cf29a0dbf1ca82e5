"""E7: rollout.sdpa_attention and rollout.decode, the KV cache, against Hugging Face on tiny random
Llamas (grouped-query heads), with the oracle's sampler in place of E6's."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import oracle
import rollout
from conftest import cases


@pytest.fixture(autouse=True)
def reference_sampler(monkeypatch):
    monkeypatch.setattr(rollout, "sample", oracle.sample)


def draw(rng):
    heads = rng.choice([2, 4])
    config = LlamaConfig(vocab_size=rng.randint(40, 120), hidden_size=16 * heads,
                         intermediate_size=48, num_hidden_layers=rng.randint(1, 3),
                         num_attention_heads=heads, num_key_value_heads=rng.choice([1, heads // 2]),
                         max_position_embeddings=128)
    prompts = [[rng.randrange(1, config.vocab_size) for _ in range(rng.randint(1, 20))]
               for _ in range(rng.randint(2, 6))]
    return rng.randrange(2**31), config, prompts, rng.randint(3, 10)


def model_of(seed, config):
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


@pytest.mark.points(3)
@pytest.mark.parametrize("c", cases("e7-greedy", draw))
def test_greedy_equals_hugging_face_generate(c):
    """Greedy tokens of rollout.generate, row by row, equal Hugging Face's generate()."""
    seed, config, prompts, new = c
    model = model_of(seed, config)
    out = rollout.generate(model, prompts, new, temperature=0.0)
    for row, prompt in enumerate(prompts):
        hf = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                                                              dtype=torch.long),
                            max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None)
        want, got = hf[0, len(prompt):].tolist(), out.response_ids[row]
        if got != want:  # a near-tie of the two best logits may go either way in float32
            first = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            with torch.no_grad():
                logits = model(torch.tensor([prompt + want[:first]])).logits[0, -1]
            top2 = logits.topk(2).values
            assert top2[0] - top2[1] < 1e-4, (
                f"row {row} (prompt of {len(prompt)} tokens) differs from token {first} on")


@pytest.mark.points(2)
@pytest.mark.parametrize("c", cases("e7-logprobs", draw))
def test_logprobs_equal_the_full_forward_pass(c):
    """Sampled at temperature 1: each token's log-prob equals Hugging Face's full forward pass."""
    seed, config, prompts, new = c
    model = model_of(seed, config)
    out = rollout.generate(model, prompts, new, generator=torch.Generator().manual_seed(seed))
    for row, prompt in enumerate(prompts):
        response = out.response_ids[row]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1]
        want = logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None])[:, 0]
        error = (torch.tensor(out.logprobs[row]) - want).abs().max().item()
        assert error < 1e-4, f"row {row}: log-probs off by {error:.2g}"


@pytest.mark.points(2)
@pytest.mark.parametrize("c", cases("e7-one-token", draw, public=1, hidden=3))
def test_decode_feeds_one_token_per_live_row(c):
    """After the prefill, every forward pass feeds exactly one new token per live row (a hook on
    the embeddings counts): nothing recomputes the prefix."""
    seed, config, prompts, new = c
    model = model_of(seed, config)
    shapes = []
    hook = model.model.embed_tokens.register_forward_hook(
        lambda module, args, output: shapes.append(tuple(args[0].shape)))
    try:
        decode_calls = []
        real_decode = rollout.decode
        rollout.decode = lambda m, tokens, cache: (decode_calls.append(len(tokens)),
                                                   real_decode(m, tokens, cache))[1]
        rollout.generate(model, prompts, new, temperature=0.0)
    finally:
        rollout.decode = real_decode
        hook.remove()
    assert len(decode_calls) == new - 1, f"{len(decode_calls)} decode calls for {new} new tokens"
    decode_shapes = shapes[-len(decode_calls):]
    assert all(shape == (len(prompts), 1) for shape in decode_shapes), (
        f"decode fed {decode_shapes[:3]}..., expected ({len(prompts)}, 1) each step")
