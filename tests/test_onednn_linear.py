"""systems/onednn_linear.py, a CPU's default decoder (runtime.sampler_decoder): rollout's own step
with every fp32 nn.Linear through oneDNN's matmul, on test_rollout.py's tiny random Llama, Qwen2
(q/k/v biases) and Qwen3 models. Its samples against rollout's own: test_static_decode.py's
test_the_same_samples_as_the_full_forward_pass."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import rollout
from systems import onednn_linear, runtime
from test_rollout import FAMILIES, PROMPTS, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


class Ops(TorchDispatchMode):
    """The names of the ops run inside it."""
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_a_decode_step_runs_every_linear_layer_through_onednn(family):
    """A decode step through the CPU's default decoder: one oneDNN matmul per linear layer (lm_head
    included), no MKL GEMM (mm, addmm), each output equal to F.linear's up to float rounding; the
    layers' own forward given back after the step."""
    model = tiny_model(family)
    assert runtime.sampler_decoder(torch.device("cpu")) is onednn_linear.decoder
    cache, logits, _ = rollout.cache_for_prompts(model, PROMPTS, 4)
    state = rollout.new_decoding(torch.rand(len(PROMPTS), 4, dtype=torch.float64),
                                 torch.tensor([], dtype=torch.long), 1.0, 1.0)
    rollout.record_sample(logits, state)
    _, step = onednn_linear.decoder(model)
    with Ops() as ops:
        step(model, cache, state, cache.k.shape[2])
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert ops.names.count("_linear_pointwise") == len(linears)
    assert not {"mm", "addmm"} & set(ops.names)
    assert all("forward" not in vars(linear) for linear in linears)
    x = torch.randn(5, model.config.hidden_size)
    for linear in linears[:4]:
        if linear.in_features == x.shape[1]:
            torch.testing.assert_close(onednn_linear.onednn_linear(linear, x), linear(x),
                                       atol=1e-5, rtol=1e-5)


def test_the_layers_forward_is_given_back_when_the_call_raises():
    """A call that raises inside (here a span past the cache) leaves no layer patched: the model
    trains and samples as before."""
    model = tiny_model("llama3")
    forward, _ = onednn_linear.decoder(model)
    cache = rollout.KVCache(*(torch.zeros(rollout.cache_shape(model, 1, 4)) for _ in range(2)),
                            seqlens=torch.zeros(1, dtype=torch.int32))
    with pytest.raises(Exception):
        forward(model, torch.tensor([[1, 2, 3, 4, 5, 6]]), cache, span=6)
    assert all("forward" not in vars(m) for m in model.modules())


def test_a_bf16_model_samples_with_rollouts_own_step():
    """bf16 linear layers already run through oneDNN: the decoder is rollout's own, unwrapped."""
    model = tiny_model("qwen2").to(torch.bfloat16)
    assert onednn_linear.decoder(model) == rollout.own_decoder(model)
