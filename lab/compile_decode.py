"""Compile time of the sampler's compiled decode step (issue 55): cuda_decode.compiled_step, the
regional compile (a decoder layer's two regions around attention, each compiled once for every
layer), against the whole decode compiled as one graph (compiled_step before 2026-11-29), both
with Inductor, on a random-weight model of SmolLM2-135M's shape (lab/bench_rollout.py's SHAPES;
--layers fewer), projections fused as train.py's GPU sampler has them. Each compile runs in a fresh process with Inductor's
caches off, the two alternating; each prints the first step's seconds (compile and run), a later
step's, and the graphs compiled.

    python -m lab.compile_decode --rounds 2 --rows 8
"""
import argparse
import json
import os
import subprocess
import sys
import time

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--rounds", type=int, default=2, help="alternated pairs of compiles")
parser.add_argument("--rows", type=int, default=8, help="rows decoded")
parser.add_argument("--layers", type=int, default=30, help="decoder layers (SmolLM2: 30)")
parser.add_argument("--threads", type=int, default=1, help="torch threads of each compile")
parser.add_argument("--one", choices=("regional", "whole"), help=argparse.SUPPRESS)
args = parser.parse_args()

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)


def one(kind):
    """Compile the step `kind` and return its figures (in this process)."""
    import torch
    from torch._dynamo.utils import counters
    from transformers import LlamaConfig, LlamaForCausalLM

    import rollout
    from systems import cuda_decode

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2, num_hidden_layers=args.layers)).eval()
    cuda_decode.fuse_projections(model)
    if kind == "regional":
        step = cuda_decode.compiled_step()
    else:  # compiled_step as it was: decode, every layer unrolled, one graph
        whole = torch.compile(cuda_decode.decode, fullgraph=True, dynamic=True)

        @torch.no_grad()
        def step(model, cache, state, span):
            rollout.record_sample(whole(model, state.tokens, cache, span), state,
                                  draw=cuda_decode.inverse_cdf)
    prompts = [[5 + row, 6, 7, 8] * (1 + row % 3) for row in range(args.rows)]
    cache, logits, _ = rollout.cache_for_prompts(model, prompts, 8, cuda_decode.forward)
    state = rollout.new_decoding(torch.rand(args.rows, 8, dtype=torch.float64),
                                 torch.tensor([], dtype=torch.long), 1.0, 1.0)
    rollout.record_sample(logits, state)
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        step(model, cache, state, cache.k.shape[2])
        seconds.append(time.perf_counter() - start)
    return dict(kind=kind, first_step_s=seconds[0], later_step_s=seconds[-1],
                graphs=counters["stats"]["unique_graphs"])


if args.one:
    print(json.dumps(one(args.one)))
    sys.exit()
environment = dict(os.environ, TORCHINDUCTOR_FORCE_DISABLE_CACHES="1",
                   OMP_NUM_THREADS=str(args.threads))
for round_ in range(args.rounds):
    for kind in ("regional", "whole")[::1 if round_ % 2 == 0 else -1]:
        result = subprocess.run([sys.executable, "-m", "lab.compile_decode", "--one", kind,
                                 "--rows", str(args.rows), "--layers", str(args.layers),
                                 "--threads", str(args.threads)],
                                env=environment, capture_output=True, text=True, check=True)
        print(result.stdout.strip().splitlines()[-1], flush=True)
