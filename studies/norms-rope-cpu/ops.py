"""Aten ops (not views) of one fixed-shape decode step on a CPU, rollout.py at b17f244 against the
working tree's, on random models of SmolLM2-135M's and Qwen2.5-7B's layouts (narrow: an op count does
not depend on the width), projections separate and joined (rollout.fuse_projections), greedy:
`python studies/norms-rope-cpu/ops.py > studies/norms-rope-cpu/ops.txt`. A CPU runs the norms' ops as
the modules do (F.rms_norm's composite); on CUDA each norm is one fused kernel."""
import importlib.util
import subprocess
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import rollout as after  # noqa: E402

source = subprocess.run(["git", "-C", str(ROOT), "show", "b17f244:rollout.py"],
                        capture_output=True, text=True, check=True).stdout
Path("/tmp/rollout_b17f244.py").write_text(source)
spec = importlib.util.spec_from_file_location("rollout_before", "/tmp/rollout_b17f244.py")
before = importlib.util.module_from_spec(spec)
spec.loader.exec_module(before)


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.count[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


LAYOUTS = {  # tests/test_static_decode.py's smollm2_layout, and Qwen2.5-7B's heads and biases
    "SmolLM2-135M": lambda: LlamaForCausalLM(LlamaConfig(
        vocab_size=96, hidden_size=72, intermediate_size=96, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)),
    "Qwen2.5-7B": lambda: Qwen2ForCausalLM(Qwen2Config(
        vocab_size=96, hidden_size=224, intermediate_size=96, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, head_dim=8, tie_word_embeddings=False)),
}
for layout, make in LAYOUTS.items():
    for joined in (False, True):
        counts = {}
        for name, module in (("before", before), ("after", after)):
            torch.manual_seed(0)
            model = make().eval()
            if joined:
                module.fuse_projections(model)
            prompts = [[5, 6, 7, 8 + row] for row in range(4)]
            with torch.no_grad():
                cache, logits, _ = module.prefilled(model, prompts, 8)
                state = module.new_decoding(torch.rand(4, 8, dtype=torch.float64),
                                            torch.tensor([95]), 0.0, 1.0)
                module.take(logits, state)
                with Ops() as ops:
                    module.static_step(model, cache, state, cache.k.shape[2])
            counts[name] = ops.count
        print(f"{layout}, {'joined' if joined else 'separate'}: before {sum(counts['before'].values())}"
              f" ops, after {sum(counts['after'].values())}; by op, before -> after: "
              + ", ".join(f"{op} {counts['before'][op]} -> {counts['after'][op]}"
                          for op in sorted(counts["before"] | counts["after"])
                          if counts["before"][op] != counts["after"][op]))
