"""E7: rollout.sdpa_attention and rollout.decode, the KV cache, against Hugging Face on tiny random
Llamas (grouped-query heads), with the stand-in sampler in place of E6's."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from classroom.harness import Wrong, pick

OWN, OTHERS, PATCH = ["rollout"], [], [["rollout", "sample"]]


def draw(rng):
    heads = rng.choice([2, 4])
    config = dict(vocab_size=rng.randint(40, 120), hidden_size=16 * heads, intermediate_size=48,
                  num_hidden_layers=rng.randint(1, 3), num_attention_heads=heads,
                  num_key_value_heads=rng.choice([1, heads // 2]), max_position_embeddings=128)
    prompts = [[rng.randrange(1, config["vocab_size"]) for _ in range(rng.randint(1, 20))]
               for _ in range(rng.randint(2, 6))]
    return rng.randrange(2**31), config, prompts, rng.randint(3, 10)


def model_of(seed, config):
    torch.manual_seed(seed)  # the same weights as the child's (probes.tiny_llama)
    return LlamaForCausalLM(LlamaConfig(**config)).eval()


def rows(got, prompts, key):
    value = got[key]
    if not isinstance(value, list) or len(value) != len(prompts):
        raise Wrong(f"{key}: expected one list per prompt ({len(prompts)})")
    return value


def greedy(c, run):
    """Greedy tokens of rollout.generate, row by row, equal Hugging Face's generate()."""
    seed, config, prompts, new = c
    got = rows(run("generate", config=config, seed=seed, prompts=prompts, new=new,
                   temperature=0.0), prompts, "response_ids")
    model = model_of(seed, config)
    for row, prompt in enumerate(prompts):
        hf = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                                                              dtype=torch.long),
                            max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None)
        want, mine = hf[0, len(prompt):].tolist(), got[row]
        if mine != want:  # a near-tie of the two best logits may go either way in float32
            first = next((i for i, (a, b) in enumerate(zip(mine, want)) if a != b),
                         min(len(mine), len(want)))
            with torch.no_grad():
                logits = model(torch.tensor([prompt + want[:first]])).logits[0, -1]
            top2 = logits.topk(2).values
            if not (first < len(mine) and top2[0] - top2[1] < 1e-4):
                raise Wrong(f"row {row} (prompt of {len(prompt)} tokens) differs from Hugging "
                            f"Face's from token {first} on")


def logprobs(c, run):
    """Sampled at temperature 1: each token's log-prob equals Hugging Face's full forward pass."""
    seed, config, prompts, new = c
    got = run("generate", config=config, seed=seed, prompts=prompts, new=new, temperature=1.0,
              sample_seed=seed)
    responses, mine = rows(got, prompts, "response_ids"), rows(got, prompts, "logprobs")
    model = model_of(seed, config)
    for row, prompt in enumerate(prompts):
        response = responses[row]
        if len(response) != len(mine[row]) or not response:
            raise Wrong(f"row {row}: {len(response)} tokens but {len(mine[row])} log-probs")
        if not all(isinstance(t, int) and 0 <= t < config["vocab_size"] for t in response):
            raise Wrong(f"row {row}: a token outside the vocabulary")
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1]
        want = logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None])[:, 0]
        error = (torch.tensor(mine[row], dtype=torch.float64) - want).abs().max().item()
        if not error < 1e-4:
            raise Wrong(f"row {row}: log-probs off by {error:.2g}",
                        f"row {row}: log-probs off by more than 1e-4")


def one_token(c, run):
    """After the prefill, every forward pass feeds exactly one new token per row (a hook on
    the embeddings counts, in the child): nothing recomputes the prefix."""
    seed, config, prompts, new = c
    got = run("decode_feeds", config=config, seed=seed, prompts=prompts, new=new)
    calls, shapes = got["decode_calls"], got["shapes"]
    if calls != new - 1:
        raise Wrong(f"{calls} decode calls for {new} new tokens")
    fed = shapes[-calls:] if calls else []
    if not all(shape == [len(prompts), 1] for shape in fed):
        raise Wrong(f"decode fed {fed[:3]}..., expected [{len(prompts)}, 1] each step")


def tests(seed, hidden):
    draws = lambda name, **n: list(enumerate(pick(seed, hidden, name, draw, **n)))  # noqa: E731
    return [
        dict(name="greedy_equals_hugging_face_generate", points=3, seconds=60, check=greedy,
             hint="Each row's new K/V go to slot `positions`; attention covers the cached slots "
                  "with the causal bias.",
             cases=draws("e7-greedy")),
        dict(name="logprobs_equal_the_full_forward_pass", points=2, seconds=60, check=logprobs,
             hint="The cache must hold exactly what a full forward pass would see.",
             cases=draws("e7-logprobs")),
        dict(name="decode_feeds_one_token_per_live_row", points=2, seconds=60, check=one_token,
             hint="decode must not feed the prefix again: one token per row per step.",
             cases=draws("e7-one-token", public=1, secret=3)),
    ]
