"""The child process of one exercise: the only process that runs submitted code. The grader starts
it as `python -I -c <this file's text> FD` in a sandbox directory (the project's files and the
submission's, never the grader's), sends one JSON line of set-up and then one JSON line per case on
stdin, and reads one JSON line per answer from file descriptor FD. A probe calls the submitted
functions with a case's inputs and returns only their outputs: values, gradients, shapes. Whether
they are right is decided by the grader, in its own process. Tensors travel as
{"tensor": dtype, "shape": [...], "data": [...]}, nothing else but JSON."""
import json
import os
import sys
import traceback
import types

import torch

MODULES = {}  # name -> the imported project module (or a placeholder that raises)


def encode(x):
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        data = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
        return {"tensor": str(x.dtype).replace("torch.", ""), "shape": list(x.shape),
                "data": data.flatten().tolist()}
    if isinstance(x, (list, tuple)):
        return [encode(v) for v in x]
    if isinstance(x, dict):
        return {str(k): encode(v) for k, v in x.items()}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return {"unreadable": type(x).__name__}


def decode(x):
    if isinstance(x, dict) and "tensor" in x:
        return torch.tensor(x["data"], dtype=getattr(torch, x["tensor"])).reshape(x["shape"])
    if isinstance(x, list):
        return [decode(v) for v in x]
    if isinstance(x, dict):
        return {k: decode(v) for k, v in x.items()}
    return x


def first_lines(error, limit=4):
    """The exception's own lines (a SyntaxError's file, line and caret), after the line of the
    submission's file that raised it, the sandbox path removed."""
    here = os.getcwd() + "/"
    frames = [frame for frame in traceback.extract_tb(error.__traceback__)
              if frame.filename.startswith(here)]
    where = ([f'  File "{frames[-1].filename}", line {frames[-1].lineno}',
              f"    {frames[-1].line}"] if frames and not isinstance(error, SyntaxError) else [])
    text = "\n".join(where) + "\n" + "".join(traceback.format_exception_only(type(error), error))
    lines = [line for line in text.replace(here, "").splitlines() if line.strip()]
    return [line[:300] for line in lines[-limit:]]


def placeholder(name, error):
    """A module that stands for a file of another exercise that does not import: its functions
    raise, so only the exercises that call them lose points."""
    module = types.ModuleType(name)

    def missing(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)

        def raises(*args, **kwargs):
            raise RuntimeError(f"{name}.py does not import ({error}), so {name}.{attr} is missing")
        return raises

    module.__getattr__ = missing
    return module


def with_grad(x):
    return x.clone().requires_grad_()


def gradient(output, x):
    """d sum(output) / d x, or None when output is not connected to x."""
    if not (torch.is_tensor(output) and output.requires_grad):
        return None
    (grad,) = torch.autograd.grad(output.sum(), x, allow_unused=True)
    return grad


# ---- probes: one per way a check calls the submission ------------------------------------------


def kl_estimate(logp, ref_logp, kind, clamp="none", grad=False):
    x = with_grad(logp) if grad else logp
    value = MODULES["kl"].estimate(x, ref_logp, kind, clamp)
    return {"value": value, "grad": gradient(value, x) if grad else None}


def shape_rewards(scores, logp, ref_logp, mask, kind, place, beta):
    value = MODULES["kl"].shape_rewards(scores, with_grad(logp), ref_logp, mask, kind, place, beta)
    return {"value": value, "requires_grad": bool(getattr(value, "requires_grad", False))}


def kl_loss(logp, ref_logp, mask, kind, place, beta, num_tokens, grad_of="logp"):
    logp, ref_logp = with_grad(logp), (with_grad(ref_logp) if grad_of == "ref_logp" else ref_logp)
    value = MODULES["kl"].kl_loss(logp, ref_logp, mask, kind, place, beta, num_tokens)
    return {"value": value, "grad": gradient(value, logp if grad_of == "logp" else ref_logp)}


def kl_to_go(logp, ref_logp, mask, kind):
    value = MODULES["kl"].kl_to_go(with_grad(logp), ref_logp, mask, kind)
    return {"value": value, "requires_grad": bool(getattr(value, "requires_grad", False))}


def expected_gradient(kind, place, T, theta, ref):
    return {"value": MODULES["toy"].expected_gradient(kind, place, T, tuple(theta), tuple(ref))}


def rloo(returns, group_size):
    return {"value": MODULES["advantage"].rloo(returns, group_size)}


def policy_loss(logits, tokens, old_logp, advantages, mask, num_tokens, clip_eps):
    logits = with_grad(logits)
    logp = logits.log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
    old = logp.detach() if old_logp is None else old_logp
    loss, frac = MODULES["advantage"].policy_loss(logp, old, advantages, mask, num_tokens, clip_eps)
    return {"value": loss, "clip_frac": frac, "grad": gradient(loss, logits)}


def sample(logits, temperature, top_p, uniform):
    tokens, logprobs = MODULES["rollout"].sample(logits, temperature, top_p, uniform)
    return {"tokens": tokens, "logprobs": logprobs}


def tiny_llama(config, seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**config)).eval()


def generate(config, seed, prompts, new, temperature, sample_seed=None):
    model = tiny_llama(config, seed)
    generator = None if sample_seed is None else torch.Generator().manual_seed(sample_seed)
    out = MODULES["rollout"].generate(model, prompts, new, temperature=temperature,
                                      generator=generator)
    return {"response_ids": out.response_ids, "logprobs": out.response_logprobs}


def decode_feeds(config, seed, prompts, new):
    """Greedy generation, counting decode calls and the tokens each forward pass embeds."""
    rollout, model = MODULES["rollout"], tiny_llama(config, seed)
    shapes, calls, real_decode = [], [], rollout.decode
    hook = model.model.embed_tokens.register_forward_hook(
        lambda module, args, output: shapes.append(list(args[0].shape)))
    rollout.decode = lambda m, tokens, *rest: (calls.append(len(tokens)),
                                               real_decode(m, tokens, *rest))[1]
    try:
        rollout.generate(model, prompts, new, temperature=0.0)  # rollout's own loop, train.py's
    finally:
        rollout.decode = real_decode
        hook.remove()
    return {"decode_calls": len(calls), "shapes": shapes}


def render_plot(runs, submitted):
    """plot.py's figure of `runs`, compared pixel by pixel with the submitted PNG."""
    import tempfile

    import matplotlib.image

    import plot

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "plot.png")
        plot.main([*runs, "--out", out])
        rendered = torch.tensor(matplotlib.image.imread(out))[..., :3]
    try:
        mine = torch.tensor(matplotlib.image.imread(submitted))[..., :3]
    except Exception as error:  # noqa: BLE001  not a PNG matplotlib can read
        return {"rendered": list(rendered.shape), "submitted": None, "why": first_lines(error)[-1]}
    same = mine.shape == rendered.shape
    agree = ((mine - rendered).abs().amax(-1) < 0.1).float().mean().item() if same else 0.0
    return {"rendered": list(rendered.shape), "submitted": list(mine.shape), "agree": agree}


# ---- the loop -----------------------------------------------------------------------------------


def main():
    channel = os.fdopen(int(sys.argv[1]), "w")
    os.dup2(2, 1)  # the submission's prints go to stderr, never into the answers
    sys.path.insert(0, os.getcwd())
    torch.set_num_threads(1)  # small tensors: one thread is fastest on a shared CPU
    setup = json.loads(sys.stdin.readline())
    errors = {}
    for name in setup["others"]:  # other exercises' files: a placeholder if they do not import
        try:
            MODULES[name] = __import__(name)
        except BaseException as error:  # noqa: BLE001  a submission may raise anything
            sys.modules[name] = MODULES[name] = placeholder(name, first_lines(error)[-1])
    for name in setup["own"]:
        try:
            MODULES[name] = __import__(name)
        except BaseException as error:  # noqa: BLE001
            errors[name] = first_lines(error)
    standins = {}
    exec(setup["standins"], standins)  # noqa: S102  the grader's stand-ins, if this one needs any
    for module, attr in setup["patch"]:
        if module in MODULES:
            setattr(MODULES[module], attr, standins[attr])
    channel.write(json.dumps({"ready": True, "import_errors": errors}) + "\n")
    channel.flush()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            answer = {"out": encode(globals()[request["probe"]](**decode(request["args"])))}
        except BaseException as error:  # noqa: BLE001
            answer = {"error": first_lines(error, limit=1)[-1][:300]}
        channel.write(json.dumps({"id": request["id"], **answer}) + "\n")
        channel.flush()


main()
