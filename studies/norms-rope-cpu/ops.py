"""Aten ops (not views) of one fixed-shape decode step on a CPU, rollout.py at b17f244 against the
working tree's, on random models of SmolLM2-135M's and Qwen2.5-7B's layouts (narrow: an op count
does not depend on the width), projections separate and joined (rollout.fuse_projections), greedy;
and a layer's own, (ops with all the layers - ops with 2) / (layers - 2):
`python studies/norms-rope-cpu/ops.py > studies/norms-rope-cpu/ops.txt`. A CPU runs the norms' ops
as the modules do (F.rms_norm's composite); on CUDA each norm is one fused kernel."""
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "studies")]
from rollout_at import rollout_at  # noqa: E402

before = rollout_at("b17f244")
# the change as its review reran it: the working tree's rollout.py has since become the reader's
# (one loop; the step's fewer kernels moved to systems/cuda_decode.py, issue 54)
after = rollout_at("333a2b0")


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.count[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


LAYOUTS = {  # tests/test_static_decode.py's smollm2_layout, and Qwen2.5-7B's heads and biases
    "SmolLM2-135M": lambda layers: LlamaForCausalLM(LlamaConfig(
        vocab_size=96, hidden_size=72, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)),
    "Qwen2.5-7B": lambda layers: Qwen2ForCausalLM(Qwen2Config(
        vocab_size=96, hidden_size=224, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=28, num_key_value_heads=4, head_dim=8, tie_word_embeddings=False)),
}


def step_ops(module, model, joined):
    """Counter of the aten ops of one fixed-shape step of `module` (a rollout.py) on `model`."""
    if joined:
        module.fuse_projections(model)
    prompts = [[5, 6, 7, 8 + row] for row in range(4)]
    with torch.no_grad():
        cache, logits, _ = module.prefilled(model, prompts, 8)
        state = module.new_decoding(torch.rand(4, 8, dtype=torch.float64), torch.tensor([95]),
                                    0.0, 1.0)
        module.take(logits, state)
        with Ops() as ops:
            module.static_step(model, cache, state, cache.k.shape[2])
    return ops.count


for layout, make in LAYOUTS.items():
    layers = {"SmolLM2-135M": 30, "Qwen2.5-7B": 28}[layout]
    for joined in (False, True):
        counts, per_layer = {}, {}
        for name, module in (("before", before), ("after", after)):
            torch.manual_seed(0)
            counts[name] = step_ops(module, make(layers).eval(), joined)
            torch.manual_seed(0)
            two_layers = sum(step_ops(module, make(2).eval(), joined).values())
            per_layer[name] = (sum(counts[name].values()) - two_layers) / (layers - 2)
        print(f"{layout}, {'joined' if joined else 'separate'}: before "
              f"{sum(counts['before'].values())} ops ({per_layer['before']:.0f} a layer), after "
              f"{sum(counts['after'].values())} ({per_layer['after']:.0f} a layer); by op, before "
              "-> after: " + ", ".join(f"{op} {counts['before'][op]} -> {counts['after'][op]}"
                                      for op in sorted(counts["before"] | counts["after"])
                                      if counts["before"][op] != counts["after"][op]))
