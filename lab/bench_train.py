"""The trainer's speed on one GPU: each phase of a training step, its MFU and peak memory (issue 35).

One step of the 1-GPU recipe (docs/gpu.md: Qwen2.5-1.5B, --group-size 5, --micro-batch 8, 1,024-token
responses) on random-weight models built from configs in the shapes of Qwen2.5 (no download: speed and
memory do not depend on the weights), through the trainer's own functions:
- train: 0.5B and 1.5B shapes, fp32 master weights and AdamW, bf16 compute. Phases, each timed
  alone (CUDA synchronized): sampling (rollout.generate, EOS off, --sample-tokens new tokens: the
  sampler's speed per decode step, docs/benchmarks.md has it in full), the policy's and the
  reference's no-grad log-prob passes (logprobs.no_grad_logprobs in train.py's --logprob-dtype auto:
  bf16x6 on CUDA since 2026-11-28, fp32 before and on a CPU), and the
  update (train.update: the gradient pass over the micro-batches, forward and backward, then the
  AdamW step, timed apart) with activation checkpointing on and off. The training passes run on
  fixed-length random responses of --response-tokens tokens.
- nograd: the 3B and 7B shapes, where a policy with AdamW does not fit one card: one no-grad pass.
- precision: the no-grad pass at the 1.5B shape in fp32, fp32 with TF32 matmuls, fp32 with its
  matmuls from bf16 pieces (bf16x6, systems/split_matmul.py), bf16 and fp16 autocast (fp32
  accumulation), each timed (their KL floors: lab/kl_floor.py --device cuda).
- attention_ops_*: the attention ops one group's passes dispatch (AttentionOps), which says which SDPA
  kernel runs under the packed block mask, or whether the math fallback builds the L x L scores.
- attention: at the 1.5B shape, the no-grad and the gradient pass with the block mask (train.py's,
  in every pass) and by segments (systems/segment_attention.py: each response attends as its
  own sequence), timed, with peak memory, each pass's attention ops and the log-probs' largest
  difference.
- recompute (not in the default --parts): the gradient pass at the 1.5B shape (forward and backward
  over the micro-batches, no optimizer step) under each --recompute choice (full, selective, none:
  systems/recompute.py), with its peak memory beside lab/memory_plan.py's trace of it, then by
  sequences under the fastest choice; the JSON is rewritten after each measurement.
- profile (not in the default --parts): where one group's passes spend their time at the 1.5B shape,
  torch.profiler's kernels (a CPU's ops) largest first: the gradient pass (forward and backward,
  activation checkpointing on, as train.py runs it) and the no-grad pass (train.py's --logprob-dtype
  auto), each with its wall time, its kernels' time and the MFU of each.
MFU is model FLOPs over time over the card's dense bf16 peak: 2 FLOPs a weight a position forward
(6 with the backward; the recomputation of activation checkpointing is not counted, as is usual),
plus attention's 4 L^2 d a layer forward over every pair the dense mask lets through, on the
positions the passes compute (a group packs its prompt once and its responses after it). Peak
memory is torch.cuda.max_memory_allocated over each phase. The JSON is rewritten after each part,
so a timeout keeps what finished.

    python -m lab.bench_train --out bench_train.json           # on a GPU, ~5 min on an H100
    python -m lab.bench_train --allow-cpu --shapes tiny --out /tmp/bench_train.json   # this script
"""
import argparse
import contextlib
import gc
import json
import platform
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import logprobs
import rollout
from systems import recompute
from systems import runtime
from systems import segment_attention
import train
from systems.split_matmul import bf16_pieces

# Qwen2.5's configs (config.json on the hub), with the trainer's fp32 master weights
SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True),
    "0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                 tie_word_embeddings=True),
    "1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                 tie_word_embeddings=True),
    "3B": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
               num_attention_heads=16, num_key_value_heads=2, vocab_size=151936,
               tie_word_embeddings=True),
    "7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
               tie_word_embeddings=False),
}
# dense bf16 tensor-core peaks (FLOP/s, fp32 accumulation, no sparsity), by the first of these
# words in torch.cuda.get_device_name(): NVIDIA's datasheets (H100, H200, B200, A100, L40S, L4, A10,
# RTX A6000) and the Ada whitepaper (RTX 4090). Order matters: "H100 PCIe" before "H100", "A100"
# before "A10", "L40S" before "L4". A card not listed gets no MFU (None)
BF16_PEAK = [("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200 NVL", 835e12),
             ("H200", 989e12), ("B200", 2250e12), ("A100", 312e12), ("L40S", 362e12),
             ("L4", 121e12), ("RTX A6000", 155e12), ("A10", 125e12), ("RTX 4090", 165e12)]
# bf16x6: fp32 matmuls from six bf16 tensor-core products (systems/split_matmul.py)
PRECISIONS = ("float32", "tf32", "bf16x6", "bfloat16", "float16")

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--out", default="bench_train.json", help="the JSON report")
parser.add_argument("--parts", nargs="+", default=["train", "nograd", "precision", "attention"],
                    choices=("train", "nograd", "precision", "attention", "profile", "recompute"))
parser.add_argument("--shapes", nargs="+", default=["0.5B", "1.5B", "3B", "7B"], choices=SHAPES,
                    help="train uses those up to 1.5B (and tiny), nograd the larger ones, "
                         "precision the 1.5B (or the largest train shape given)")
parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS,
                    help="the precision part's options (bf16x6: systems/split_matmul.py)")
parser.add_argument("--prompts", type=int, default=16,
                    help="prompts of the step (the recipe's 64, reduced to keep a step short; the "
                         "phases' times are per token, so they scale)")
parser.add_argument("--group-size", type=int, default=5, help="completions per prompt (recipe: 5)")
parser.add_argument("--prompt-tokens", type=int, default=160, help="tokens of each prompt")
parser.add_argument("--response-tokens", type=int, default=1024,
                    help="tokens of each response in the training passes (recipe: 1,024)")
parser.add_argument("--sample-tokens", type=int, default=128,
                    help="new tokens of the timed sampling (EOS off)")
parser.add_argument("--micro-batch", type=int, default=8, help="train.py's --micro-batch")
parser.add_argument("--allow-cpu", action="store_true",
                    help="run without CUDA (to try this script: tiny shapes, no memory figures)")


def build(shape, device, seed=0):
    """A Qwen2ForCausalLM of `shape` with random fp32 weights, made on `device`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, rope_theta=1e6)
    with torch.device(device):
        return Qwen2ForCausalLM(config).float()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device, fn, *args, **kwargs):
    """(fn's result, seconds, peak bytes allocated during it or None on a CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    sync(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return result, seconds, peak


def batch_of(args, vocab_size, device):
    """(prompts, responses, mask): --prompts random prompts, each --group-size times (an RLOO group
    is contiguous), and fixed-length random responses."""
    g = torch.Generator().manual_seed(0)
    distinct = [torch.randint(vocab_size, (args.prompt_tokens,), generator=g).tolist()
                for _ in range(args.prompts)]
    prompts = [prompt for prompt in distinct for _ in range(args.group_size)]
    responses = torch.randint(vocab_size, (len(prompts), args.response_tokens), generator=g)
    return prompts, responses.to(device), torch.ones(responses.shape, device=device)


def attention_pairs(args):
    """(allowed, computed): the (query, key) pairs of one pack that the block mask lets through (the
    prompt causally, each response over the prompt and its own prefix), and the pairs SDPA computes
    under that mask (every pair of the L x L pack). The MFU counts the first: the model's work."""
    P, R, G = args.prompt_tokens, args.response_tokens, args.group_size
    allowed = P * (P + 1) // 2 + G * (R * P + R * (R + 1) // 2)
    return allowed, (P + G * R) ** 2


def pass_flops(model, args, num_rows, backward, pairs="allowed"):
    """Model FLOPs of one pass over `num_rows` rows packed as logprobs.token_logprobs packs them;
    attention over the pairs the mask allows, or with pairs="computed" over every pair SDPA computes
    with the block mask (what PyTorch's FlopCounterMode counts)."""
    config = model.config
    packs = num_rows // args.group_size
    length = args.prompt_tokens + args.group_size * args.response_tokens  # a pack's positions
    kept = args.group_size * args.response_tokens + 1  # positions that reach the output layer
    head = config.vocab_size * config.hidden_size
    body = sum(p.numel() for p in model.model.layers.parameters())
    counted = dict(zip(("allowed", "computed"), attention_pairs(args)))[pairs]
    attention = 4 * counted * config.hidden_size * config.num_hidden_layers  # QK^T and AV
    forward = packs * (2 * body * length + 2 * head * kept + attention)
    return 3 * forward if backward else forward


def mfus(model, args, num_rows, backward, seconds, peak):
    """{"mfu": over the pairs the mask allows, "mfu_all_pairs": over every pair computed}."""
    return {"mfu": mfu(pass_flops(model, args, num_rows, backward), seconds, peak),
            "mfu_all_pairs": mfu(pass_flops(model, args, num_rows, backward, "computed"), seconds,
                                 peak)}


class AttentionOps(TorchDispatchMode):
    """The aten ops of attention a pass dispatches: which SDPA kernel PyTorch picked (flash,
    efficient, cudnn, the CPU's), or the math fallback's bmm and softmax over the L x L scores."""

    WORDS = ("scaled_dot_product", "attention", "softmax", "bmm")

    def __enter__(self):
        self.ops = set()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if any(word in name for word in self.WORDS):
            self.ops.add(name)
        return func(*args, **(kwargs or {}))


def attention_ops(fn, *args, **kwargs):
    """The sorted attention ops of fn(*args, **kwargs) (see AttentionOps)."""
    with AttentionOps() as mode:
        fn(*args, **kwargs)
    return sorted(mode.ops)


def mfu(flops, seconds, peak):
    return None if peak is None else flops / seconds / peak


def trainer_args(args, dtype):
    """train.py's flags for update(): the recipe's, K1 in the reward, one minibatch."""
    flags = train.parser.parse_args(["--kl", "k1", "--place", "reward", "--group-size",
                                     str(args.group_size), "--micro-batch", str(args.micro_batch)])
    flags.dtype = str(dtype).removeprefix("torch.")
    flags.by_segments = False  # the block mask (train.main resolves it: runtime.BY_SEQUENCES_ON)
    flags.share_prefix = False  # a pack a group, as on a GPU (runtime.SHARED_PREFIX_ON)
    return flags


def train_part(args, shape, device, peak):
    """One training step's phases at `shape` (see the docstring)."""
    dtype = runtime.compute_dtype("auto", device)
    policy, result = build(shape, device), {"shape": shape}
    reference = build(shape, device).requires_grad_(False)
    num_params = sum(p.numel() for p in policy.parameters())
    prompts, responses, mask = batch_of(args, policy.config.vocab_size, device)
    result.update(params=num_params, rows=len(prompts), response_tokens=args.response_tokens)

    sampler = runtime.make_sampler(policy, device, dtype, fsdp=False)
    generator = torch.Generator(device=device).manual_seed(0)
    rows = prompts[:args.prompts * args.group_size]
    _, seconds, memory = timed(device, rollout.generate, sampler, rows, args.sample_tokens, 1.0,
                               1.0, None, generator, decoder=runtime.sampler_decoder(device))
    result["sampling"] = {"s": seconds, "ms_per_step": 1e3 * seconds / args.sample_tokens,
                          "peak_bytes": memory}
    runtime.release_sampler(sampler, policy)

    warm = slice(0, args.group_size)  # one group first: kernels chosen, memory pools grown
    logprob_dtype = runtime.logprob_dtype("auto", device)  # as train.py's default resolves it
    result["logprob_dtype"] = str(logprob_dtype).removeprefix("torch.")
    result["attention_ops_nograd"] = attention_ops(
        logprobs.no_grad_logprobs, policy, prompts[warm], responses[warm], mask[warm], 1.0,
        logprob_dtype, args.micro_batch)
    for name, model in (("policy_nograd", policy), ("reference_nograd", reference)):
        (logp, _), seconds, memory = timed(device, logprobs.no_grad_logprobs, model, prompts,
                                           responses, mask, 1.0, logprob_dtype, args.micro_batch,
                                           entropy=name == "policy_nograd")
        result[name] = {"s": seconds, "tokens_per_s": mask.sum().item() / seconds,
                        "peak_bytes": memory,
                        **mfus(policy, args, len(prompts), False, seconds, peak)}
    del reference

    flags = trainer_args(args, dtype)
    batch = train.Batch(prompts, responses, mask, logp, logp, logp,
                        torch.randn(len(prompts), device=device))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-7, weight_decay=0.01)
    optimizer_seconds = []
    step = optimizer.step

    def timed_step(*a, **k):  # the AdamW step alone, inside update()
        sync(device)
        start = time.perf_counter()
        out = step(*a, **k)
        sync(device)
        optimizer_seconds.append(time.perf_counter() - start)
        return out

    optimizer.step = timed_step  # a reference cycle: main() collects it before the next part
    with AttentionOps() as mode:  # the gradient pass's attention, forward and backward, one group
        logp_warm, _ = logprobs.token_logprobs(policy, prompts[warm], responses[warm], mask[warm],
                                               1.0, dtype)
        logp_warm.sum().backward()
    result["attention_ops_gradient"] = sorted(mode.ops)
    policy.zero_grad(set_to_none=True)
    for checkpointing in (True, False):
        set_recompute(policy, "full" if checkpointing else "none")
        try:
            _, seconds, memory = timed(device, train.update, flags, policy, optimizer, batch,
                                       torch.arange(len(prompts)), True)
        except torch.OutOfMemoryError as error:
            result[f"update_checkpointing_{checkpointing}"] = {"error": str(error).splitlines()[0]}
            continue
        gradient_s = seconds - optimizer_seconds[-1]
        result[f"update_checkpointing_{checkpointing}"] = {
            "s": seconds, "gradient_pass_s": gradient_s, "optimizer_s": optimizer_seconds[-1],
            "tokens_per_s": mask.sum().item() / gradient_s, "peak_bytes": memory,
            **mfus(policy, args, len(prompts), True, gradient_s, peak)}
    nograd = result["policy_nograd"]["s"] + result["reference_nograd"]["s"]
    update = result["update_checkpointing_True"].get("s")
    result["nograd_share_of_training"] = None if update is None else nograd / (nograd + update)
    return result


def nograd_part(args, shape, device, peak, precisions=("float32", "bfloat16")):
    """One no-grad log-prob pass at `shape` in each of `precisions` (tokens/s, MFU, peak)."""
    model = build(shape, device).requires_grad_(False)
    prompts, responses, mask = batch_of(args, model.config.vocab_size, device)
    result = {"shape": shape, "params": sum(p.numel() for p in model.parameters()),
              "rows": len(prompts)}
    warm = slice(0, args.group_size)  # one group first: kernels chosen, memory pools grown
    result["attention_ops_float32"] = attention_ops(
        logprobs.no_grad_logprobs, model, prompts[warm], responses[warm], mask[warm], 1.0,
        torch.float32, args.micro_batch)
    for precision in precisions:
        tf32 = precision == "tf32"
        dtype = torch.float32 if precision in ("tf32", "bf16x6") else getattr(torch, precision)
        if device.type != "cuda" and dtype == torch.float16:
            result[precision] = {"skipped": "fp16 autocast is timed on CUDA only"}
            continue
        previous = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        try:
            with bf16_pieces(6) if precision == "bf16x6" else contextlib.nullcontext():
                logprobs.no_grad_logprobs(model, prompts[warm], responses[warm], mask[warm], 1.0,
                                          dtype, args.micro_batch)  # this precision's kernels
                _, seconds, memory = timed(device, logprobs.no_grad_logprobs, model, prompts,
                                           responses, mask, 1.0, dtype, args.micro_batch)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = previous
        result[precision] = {"s": seconds, "tokens_per_s": mask.sum().item() / seconds,
                             "peak_bytes": memory,
                             **mfus(model, args, len(prompts), False, seconds, peak)}
    return result


def profile_part(args, shape, device, peak):
    """Where one group's gradient pass and no-grad pass spend their time (see the docstring)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    dtype, logprob_dtype = (runtime.compute_dtype("auto", device),
                            runtime.logprob_dtype("auto", device))  # as train.py resolves them
    policy = build(shape, device)
    set_recompute(policy, "full")
    prompts, responses, mask = batch_of(args, policy.config.vocab_size, device)
    group = slice(0, args.group_size)

    def gradient_pass():
        logp, _ = logprobs.token_logprobs(policy, prompts[group], responses[group], mask[group],
                                          1.0, dtype)
        logp.sum().backward()
        policy.zero_grad(set_to_none=True)

    def nograd_pass():
        logprobs.no_grad_logprobs(policy, prompts[group], responses[group], mask[group], 1.0,
                                  logprob_dtype, args.micro_batch)

    def own_ms(event):  # the kernel's own device time, or on a CPU the op's own time
        return (event.self_device_time_total if cuda else event.self_cpu_time_total) / 1e3

    result = {"shape": shape, "rows": args.group_size,
              "logprob_dtype": str(logprob_dtype).removeprefix("torch.")}
    for name, run, backward in (("gradient_pass", gradient_pass, True),
                                ("nograd_pass", nograd_pass, False)):
        run()  # warm: kernels chosen, memory pools grown
        sync(device)
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            started = time.perf_counter()
            run()
            sync(device)
            wall = time.perf_counter() - started
        kernels = sorted(((own_ms(event), event.count, event.key) for event in prof.key_averages()
                          if own_ms(event) > 0), reverse=True)
        busy = sum(ms for ms, _, _ in kernels) / 1e3
        result[name] = {"wall_s": wall, "kernels_s": busy,
                        **mfus(policy, args, args.group_size, backward, wall, peak),
                        "mfu_of_kernel_time": mfus(policy, args, args.group_size, backward, busy,
                                                   peak)["mfu"],
                        "kernels": [dict(kernel=key, ms=ms, calls=count)
                                    for ms, count, key in kernels[:40]]}
    return result


def set_recompute(model, choice):
    """--recompute `choice` (full, train.py's default on a CPU; selective; none:
    systems/recompute.py) on the model, in place of the one it had."""
    getattr(model, "activation_checkpointing_disable", model.gradient_checkpointing_disable)()
    runtime.checkpoint_activations(model, choice)  # as train.py applies --recompute


def gradient_pass(model, args, batch, dtype, by_segments=False, micro_batches=None):
    """train.py's gradient pass without its losses: each micro-batch's packed forward under
    autocast to `dtype` (by segments or with the block mask), then its backward (by segments
    around the backward too: activation checkpointing replays the forward there); the gradients
    dropped at the end. micro_batches: (start, size) pairs, else logprobs.micro_batch_sizes'."""
    prompts, responses, mask = batch
    with segment_attention.attention(model) if by_segments else contextlib.nullcontext():
        for start, size in micro_batches or zip(*micro_batch_starts(prompts, args.micro_batch)):
            rows = slice(start, start + size)
            logp, _ = logprobs.token_logprobs(model, prompts[rows], responses[rows], mask[rows],
                                              1.0, dtype, by_segments=by_segments)
            logp.sum().backward()
    model.zero_grad(set_to_none=True)


def recompute_part(args, shape, device, peak, save=lambda result: None):
    """The gradient pass at `shape` under each --recompute choice (full, selective, none:
    systems/recompute.py), block mask, each after one group's warm pass: its time, peak memory
    (with the bytes allocated before it: weights and AdamW's moments), MFU (the recomputation not
    counted: the model's FLOPs) and lab/memory_plan.py's trace of its largest micro-batch (the
    pass without its gradients); then by sequences under the fastest choice that ran. A choice out
    of memory is reported as such; save(result) after each measurement."""
    from lab import memory_plan

    dtype = runtime.compute_dtype("auto", device)
    model = build(shape, device)
    # AdamW's two moments, resident as in a run
    moments = [torch.zeros_like(param) for param in model.parameters() for _ in range(2)]
    batch = batch_of(args, model.config.vocab_size, device)
    prompts = batch[0]
    largest = max(logprobs.micro_batch_sizes(prompts, args.micro_batch))
    result = {"shape": shape, "rows": len(prompts), "micro_batch_rows": largest,
              "dtype": str(dtype).removeprefix("torch."),
              "adamw_moments_bytes": sum(m.numel() * m.element_size() for m in moments)}
    warm = [(0, args.group_size)]
    for choice in (*recompute.CHOICES, "by_sequences"):
        by_segments = choice == "by_sequences"
        if by_segments:  # under the fastest choice that ran
            ran = [c for c in recompute.CHOICES if "s" in result.get(c, {})]
            if not ran:
                break
            best = min(ran, key=lambda c: result[c]["s"])
            result[choice] = {"recompute": best}
        set_recompute(model, best if by_segments else choice)
        try:
            gradient_pass(model, args, batch, dtype, by_segments, warm)
            before = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
            _, seconds, memory = timed(device, gradient_pass, model, args, batch, dtype,
                                       by_segments)
        except torch.OutOfMemoryError as error:
            result[choice] = {**result.get(choice, {}), "error": str(error).splitlines()[0]}
            model.zero_grad(set_to_none=True)
            save(result)
            continue
        result[choice] = {**result.get(choice, {}), "s": seconds, "peak_bytes": memory,
                          "allocated_before_bytes": before,
                          "tokens_per_s": batch[2].sum().item() / seconds,
                          **mfus(model, args, len(prompts), True, seconds, peak)}
        if not by_segments:
            result[choice]["planned_pass_bytes"] = memory_plan.traced_gradient_pass(
                model.config, prompts[:largest], args.response_tokens, dtype, choice)
        save(result)
    return result


def attention_part(args, shape, device, peak):
    """The packed passes with the block mask and by segments (systems/segment_attention.py): the fp32
    no-grad pass and the gradient pass (forward and backward in the compute dtype, no optimizer,
    activation checkpointing on as in train.py), each timed with its peak memory and attention ops,
    and the log-probs' largest difference; by segments also the no-grad pass with fp32 matmuls from
    bf16 pieces (bf16x6). A variant out of memory is reported as such, and the other still runs."""
    dtype = runtime.compute_dtype("auto", device)
    model = build(shape, device)
    set_recompute(model, "full")
    prompts, responses, mask = batch_of(args, model.config.vocab_size, device)
    result = {"shape": shape, "rows": len(prompts)}
    logps, warm = {}, slice(0, args.group_size)

    def grad_pass(by_segments, micro_batches=None):
        gradient_pass(model, args, (prompts, responses, mask), dtype, by_segments, micro_batches)

    def variant(name):
        by_segments = name == "segments"
        ops = attention_ops(logprobs.no_grad_logprobs, model, prompts[warm], responses[warm],
                            mask[warm], 1.0, torch.float32, args.micro_batch,
                            by_segments=by_segments)
        (logps[name], _), nograd_s, nograd_peak = timed(
            device, logprobs.no_grad_logprobs, model, prompts, responses, mask, 1.0, torch.float32,
            args.micro_batch, by_segments=by_segments)
        result[name] = {"nograd_s": nograd_s, "nograd_peak_bytes": nograd_peak,
                        "attention_ops_nograd": ops}  # kept if the gradient pass fails
        result[name]["attention_ops_gradient"] = attention_ops(  # one group, forward and backward
            grad_pass, by_segments, [(0, args.group_size)])
        _, grad_s, grad_peak = timed(device, grad_pass, by_segments)
        result[name] |= {"gradient_pass_s": grad_s, "gradient_peak_bytes": grad_peak}
        if by_segments:  # with fp32 matmuls from bf16 pieces too (docs/precision.md)
            logprobs.no_grad_logprobs(model, prompts[warm], responses[warm], mask[warm], 1.0,
                                      "bf16x6", args.micro_batch, by_segments=True)
            _, result[name]["nograd_bf16x6_s"], _ = timed(
                device, logprobs.no_grad_logprobs, model, prompts, responses, mask, 1.0, "bf16x6",
                args.micro_batch, by_segments=True)

    for name in ("block_mask", "segments"):
        try:
            variant(name)
        except torch.OutOfMemoryError as error:
            result.setdefault(name, {})["error"] = str(error).splitlines()[0]
            model.zero_grad(set_to_none=True)
    if len(logps) == 2:
        result["max_abs_logp_difference"] = (
            (logps["block_mask"] - logps["segments"]).abs().max().item())
    return result


def micro_batch_starts(prompts, micro_batch):
    """(starts, sizes) of logprobs.micro_batch_sizes' micro-batches."""
    sizes = logprobs.micro_batch_sizes(prompts, micro_batch)
    return [sum(sizes[:i]) for i in range(len(sizes))], sizes


def machine(device):
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    peak = next((flops for word, flops in BF16_PEAK if word in name), None)
    return {"device": name or platform.machine(), "torch": torch.__version__,
            "bf16_peak_flops": peak, "compute_dtype": str(runtime.compute_dtype("auto", device))}


def main(argv=None):
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        raise SystemExit("bench_train: no CUDA device; --allow-cpu runs it on the CPU (tiny shapes)")
    device = torch.device("cuda" if cuda else "cpu")
    report = {"machine": machine(device), "flags": vars(args), "parts": {}}
    peak = report["machine"]["bf16_peak_flops"]
    out = Path(args.out)

    def save():
        out.write_text(json.dumps(report, indent=1) + "\n")

    save()
    small = [s for s in args.shapes if s in ("tiny", "0.5B", "1.5B")]
    large = [s for s in args.shapes if s in ("3B", "7B")]
    jobs = [("train", s, train_part) for s in small] + [("nograd", s, nograd_part) for s in large]
    if "precision" in args.parts and small:
        jobs.append(("precision", small[-1],
                     lambda a, s, d, p: nograd_part(a, s, d, p, a.precisions)))
    if "attention" in args.parts and small:
        jobs.append(("attention", small[-1], attention_part))
    if "profile" in args.parts and small:
        jobs.append(("profile", small[-1], profile_part))
    if "recompute" in args.parts and small:
        def partial_save(result, name=f"recompute/{small[-1]}"):  # after each measurement
            report["parts"][name] = result
            save()
        jobs.append(("recompute", small[-1],
                     lambda a, s, d, p: recompute_part(a, s, d, p, partial_save)))
    for part, shape, run in jobs:
        if part not in args.parts:
            continue
        started = time.perf_counter()
        try:
            result = run(args, shape, device, peak)
        except Exception as error:  # noqa: BLE001 - one failed part must not lose the others
            result = {"shape": shape, "error": f"{type(error).__name__}: {error}".splitlines()[0]}
        result["part_s"] = time.perf_counter() - started
        report["parts"][f"{part}/{shape}"] = result
        save()
        print(f"{part}/{shape}: {json.dumps(result)}", flush=True)
        gc.collect()  # what this part allocated must not count in the next part's peaks
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return report


if __name__ == "__main__":
    main()
