"""FSDP2's moments on real ranks: every tensor its passes allocate, followed on 2 gloo ranks, so
lab/memory_plan.py's FSDP terms are checked where they are large. The model is random, untied, with
a root (embeddings and output layer: 0.81 GB fp32) 17x a decoder layer (Qwen2.5-7B's is 4.7x),
SmolLM2's tokenizer; `build` writes it, which --measure then runs as train.py's --model.

    python studies/memory-plan/fsdp_trace.py build /tmp/wide-root        # the model directory
    python studies/memory-plan/fsdp_trace.py trace /tmp/wide-root        # > fsdp_trace.txt

`trace` follows, on each rank, the storages that ops create (memory_plan.LiveBytes's rule) and the
weights FSDP2 gathers into storages it resizes (alloc_storage), so a pass's peak is what CUDA's
allocator counts of the tensors (max_memory_allocated; NCCL's own buffers are not tensors, and
gloo's copies run on its threads, unseen here). For each window (a no-grad pass, a gradient pass's
forward, its backward, its reduce-scatters as they run) it prints the peak and the tensors alive
there, after the plan's moments for CUDA.
"""
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
GB = 1e9


def build(path, hidden_size=2048, intermediate_size=256, num_hidden_layers=2,
          num_attention_heads=4, tie_word_embeddings=False):
    """A random untied Llama of 0.23B parameters, 0.20B of them the root (vocab 49,152 x 2,048,
    twice), with two small decoder layers, saved with SmolLM2's tokenizer in `path`; the keywords
    give another shape (one KV head, SmolLM2's vocabulary and special tokens, seed 0 as here)."""
    import transformers

    from systems import model

    tokenizer = model.load_tokenizer("smollm2-135m")
    smollm2 = transformers.AutoConfig.from_pretrained(model.resolve("smollm2-135m"))
    config = transformers.LlamaConfig(
        vocab_size=smollm2.vocab_size, hidden_size=hidden_size,
        intermediate_size=intermediate_size, num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads, num_key_value_heads=1,
        tie_word_embeddings=tie_word_embeddings, bos_token_id=smollm2.bos_token_id,
        eos_token_id=smollm2.eos_token_id, max_position_embeddings=4096)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def trace_worker(path):
    """On each rank: the policy sharded as train.py shards it, a no-grad pass with the entropy and a
    gradient pass of 4 rows (2 prompts of 151 tokens, responses of 32), each window's peak."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    import logprobs
    from systems import model
    from systems import runtime
    from lab import memory_plan

    class Tracker(memory_plan.LiveBytes):
        """LiveBytes with each storage's name, a snapshot at each window's peak, and the
        storages FSDP2 resizes (gathered weights) counted while they are allocated."""

        def __init__(self):
            super().__init__()
            self.names, self.window, self.peaks = {}, None, {}

        def add(self, key, nbytes, name):
            super().add(key, nbytes, name)
            self.names[key] = name
            if self.now > self.peaks.get(self.window, (0,))[0]:
                alive = sorted(((self.live[k], self.names[k]) for k in self.live
                                if self.live[k]), reverse=True)
                self.peaks[self.window] = (self.now, alive)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if "reduce_scatter" in func.__name__:  # what is alive as a reduce-scatter runs
                window, self.window = self.window, "gradient pass, at a reduce-scatter"
                self.add("marker", 0, "")
                self.release("marker")
                self.window = window
            return out

    tracker = None
    alloc_storage, free_storage = _fsdp_param.alloc_storage, _fsdp_param.free_storage

    def alloc(tensor):  # FSDP2 gathers into a weight's own storage, resized from 0
        alloc_storage(tensor)
        if tracker is not None:
            storage = tensor.untyped_storage()
            tracker.add(("resized", id(storage)), storage.nbytes(),
                        f"gathered weight {tuple(tensor.shape)}")

    def free(tensor):
        if tracker is not None and ("resized", id(tensor.untyped_storage())) in tracker.live:
            tracker.release(("resized", id(tensor.untyped_storage())))
        free_storage(tensor)
    _fsdp_param.alloc_storage, _fsdp_param.free_storage = alloc, free

    dist.init_process_group("gloo")
    policy = runtime.shard(model.load_model(path))
    prompts = [[1] + [100 + i] * 150 for i in range(2) for _ in range(2)]
    responses, mask = torch.randint(0, 1000, (4, 32)), torch.ones(4, 32)
    for step in range(2):  # the second as every later one: gradients and gathered storages exist
        tracker = Tracker()
        with tracker:
            tracker.window = "no-grad pass"
            with torch.no_grad():
                logprobs.token_logprobs(policy, prompts, responses, mask, 1.0, torch.float32, True)
            policy.reshard()  # as logprobs.no_grad_logprobs does
            tracker.window = "gradient pass, forward"
            logp, _ = logprobs.token_logprobs(policy, prompts, responses, mask, 1.0, torch.float32)
            tracker.window = "gradient pass, backward"
            logp.sum().backward()
        if dist.get_rank() == 0 and step == 1:
            for window, (peak, alive) in tracker.peaks.items():
                print(f"{window}: {peak / GB:.3f} GB of tensors the pass made, at its peak:")
                for nbytes, name in alive[:6]:
                    print(f"    {nbytes / GB:.3f}  {name}")
    dist.destroy_process_group()


def trace(path):
    import subprocess

    from lab import memory_plan
    import train

    # the worker's shapes: a rank's 4 rows, 2 prompts of 151 tokens x 2 responses of 32, in fp32
    flags = train.parser.parse_args(["--kl", "k1", "--place", "reward", "--fsdp", "--model", path,
                                     "--prompts-per-step", "4", "--group-size", "2",
                                     "--max-new-tokens", "32", "--micro-batch", "4",
                                     "--dtype", "float32"])
    table, facts = memory_plan.plan(flags, 2, 80 * GB, 151, "cuda")
    for phase, moments in facts["moments"].items():  # each besides the parts held all step
        print(f"plan for CUDA, {phase}: " + ", ".join(f"{moment} {nbytes / GB:.3f} GB"
                                                       for moment, nbytes in moments.items()))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc_per_node=2", __file__, "worker", path], check=True, env=env, cwd=ROOT)


if __name__ == "__main__":
    {"build": build, "trace": trace, "worker": trace_worker}[sys.argv[1]](sys.argv[2])
