"""The CPU sampler's fp32 linear layers through oneDNN's matmul: rollout.py's own decoder, the same
computation, its GEMMs by another library.

On a CPU, torch runs an fp32 nn.Linear as MKL's sgemm (a bf16 one already goes to oneDNN). A decode
step's GEMMs have one row per sequence (32 at the default run) against weights read once a step,
and at that shape oneDNN's fp32 matmul ran 1.3-1.5x MKL's on a 2-core AMD EPYC with AVX2 (the
weights as the layers hold them: no packed copy, which would be stale after every update and as
large as the model). The results are the same products summed in another order: the same samples
up to float rounding (tests/test_static_decode.py), as a GPU's decoder. Measured and decided in
docs/benchmarks.md ("The CPU sampler's linear layers through oneDNN"); chosen where the sampler is
made (runtime.sampler_decoder, runtime.ONEDNN_LINEAR_ON).
"""
import functools

import torch

import rollout


def decoder(model):
    """rollout.own_decoder's (forward, step) for one generate's rows of `model`, every nn.Linear of
    it through oneDNN during each call (through_onednn) where its weights are fp32; rollout's own
    as they are otherwise (bf16 linears run through oneDNN already)."""
    forward, step = rollout.own_decoder(model)
    if next(model.parameters()).dtype != torch.float32:
        return forward, step
    linears = [module for module in model.modules() if isinstance(module, torch.nn.Linear)]
    return through_onednn(forward, linears), through_onednn(step, linears)


def through_onednn(function, linears):
    """`function`, each call running the nn.Linear modules `linears` as onednn_linear: each one's
    forward replaced for the call's duration, and given back however the call ends."""
    @functools.wraps(function)
    def wrapped(*args, **kwargs):
        for linear in linears:  # an instance's forward comes before its class's
            vars(linear)["forward"] = functools.partial(onednn_linear, linear)
        try:
            return function(*args, **kwargs)
        finally:
            for linear in linears:
                vars(linear).pop("forward", None)
    return wrapped


def onednn_linear(linear, x):
    """linear(x) = x W^T + b by oneDNN's matmul, W read where the layer holds it. No gradient: the
    sampler runs under no_grad."""
    return torch.ops.mkldnn._linear_pointwise(x, linear.weight, linear.bias, "none", [], "")
