"""Processes, devices and precision: the set-up train.py and eval.py share, and their collectives.

- `start(dtype)`: this process's device, then the process group when torchrun launched us (NCCL on
  CUDA, bound to that device; gloo on CPU), and the compute dtype. Ranks: RANK (global, over every
  node) decides what a process does (its share of the data, its RNG, its checkpoint files, rank 0
  the writing), LOCAL_RANK (on its own node) only which GPU it takes. "auto" is bf16 where the
  device computes it natively (CUDA compute capability 8.0 or higher, CPUs with AVX512-BF16 or AMX)
  and fp32 elsewhere: a V100 or T4 (7.0, 7.5) and an AVX2-only CPU emulate bf16 (on the CPU about
  3x slower than fp32).
- `stop_if_any_rank`, `all_reduce_sums`, `all_reduce_max`, `barrier`: the collectives of the loop.
  Every rank calls them at the same point, so a rank never stops alone and leaves the others waiting
  in a collective.
- `make_sampler`, `release_sampler`, `refresh_sampler`: the compute-dtype copy of the policy that
  rollout.generate samples from, its memory given to the training pass in between;
  `sampler_decoder`, the decoder it samples with on this device (the GPU's machinery, or
  rollout's own).
- `resolve_device_defaults`: the features a GPU run has yet to decide, resolved in one place.
- `wrap` / `unwrap`: the policy under DDP or FSDP2 (`shard`), and the plain model inside it;
  `no_dropout` for the train mode that activation checkpointing needs; `checkpoint_activations`
  applies --recompute (systems/recompute.py).
- `return_freed_memory()`: gives freed memory back to the system (glibc; lab/memory_plan.py);
  `keep_freed_memory()`, its opposite for a CPU run: every freed block kept (start calls it).
"""
import copy
import ctypes
import functools
import math
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from systems import activations, cuda_decode, recompute, split_matmul

try:  # glibc, for return_freed_memory and keep_freed_memory
    _libc = ctypes.CDLL("libc.so.6")
    _libc.malloc_trim.argtypes = [ctypes.c_size_t]
    _libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
except (OSError, AttributeError):
    _libc = None
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


def fail(message, prog=None):
    """Stop with a one-line message and exit status 1, as `prog: error: message` on stderr."""
    raise SystemExit(f"{prog or os.path.basename(sys.argv[0])}: error: {message}")


def bf16_is_native(device):
    """Whether bf16 arithmetic runs natively: a CUDA GPU of compute capability 8.0 or higher (the
    current one: start sets it), or a CPU with AVX512-BF16 (or AMX)."""
    if device.type == "cuda":
        # is_bf16_supported() alone also counts sm70/75, which emulate bf16
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()


def compute_dtype(name, device):
    """The torch dtype of --dtype `name` on `device` ("auto": bf16 where it is native, else
    fp32)."""
    if name == "auto":
        name = "bfloat16" if bf16_is_native(device) else "float32"
    return getattr(torch, name)


# --logprob-dtype auto on CUDA: the pick of the rule registered in docs/precision.md (issue 35), the
# fastest option whose KL floor is negligible. Measured on an H200: TF32, fp16 and bf16 missed the
# float64 K1 by 94% to 15,000% (2026-11-27); fp32 from six bf16 products (split_matmul.py) kept K1
# and K3 within 0.14%, in 0.83 of fp32's time (2026-11-28)
CUDA_LOGPROB_DTYPE = "bf16x6"


# ...but only on the cards where it pays: six bf16 products cost less than one fp32 GEMM only where
# dense bf16 tensor cores run ~15x fp32 or more (A100 sm80 16x, H100/H200 sm90 15x, B200/B300 sm100/
# sm103 ~30x); at 2-4x (sm86/sm89: A10, A6000, L4, RTX 4090; sm120: RTX 5090) they are slower than
# fp32, and before sm80 (V100, T4) a bf16 GEMM with an fp32 output does not run. docs/precision.md
BF16X6_PAYS_ON = {(8, 0), (9, 0), (10, 0), (10, 3)}


# where the sampler's own copy fuses its q/k/v and gate/up projections
# (cuda_decode.fuse_projections): a GPU, where k_proj's and v_proj's GEMMs ran at a tenth of the
# card's bandwidth (the rule that keeps it is registered in docs/benchmarks.md); not a CPU, where
# fused was no faster (studies/fused-cpu)
FUSED_PROJECTIONS_ON = ("cuda",)


# where train.py's sampler compiles its decode step unless --compile-sampler says
# (cuda_decode.compiled_step): nowhere until a GPU has timed it against the graphed step (the rule
# that decides "cuda" is registered in docs/benchmarks.md)
COMPILED_SAMPLER_ON = ()


# where the sampler's decode step attends with FlexAttention when flash-attn cannot run
# (cuda_decode.attention_choice): each row's own blocks of slots, where SDPA reads a span common to
# the rows. Nowhere until a GPU has timed it against SDPA (the rule that decides "cuda" is
# registered in docs/benchmarks.md)
FLEX_DECODE_ON = ()


# --recompute auto on CUDA: each decoder layer's whole forward again in the backward pass, as
# before, until a GPU has timed selective and none at the 1.5B shape (lab/bench_train.py --parts
# recompute; the rule that picks this default is registered in docs/benchmarks.md). A CPU keeps
# "full", the least memory (a CPU's memory is shared with everything else on the machine)
CUDA_RECOMPUTE = "full"


# where train.py computes attention by sequences (systems/segment_attention.py) in every pass, the
# no-grad passes and the gradient pass alike, so the KL's values in the reward and in the loss stay
# one computation: nowhere until a GPU has timed it (the rule that adds "cuda" is registered in
# docs/benchmarks.md, "attention by sequences"); a CPU keeps the block mask (studies/sequences-cpu)
BY_SEQUENCES_ON = ()


# where train.py's passes compute the prompts' common prefix once a micro-batch, all its groups in
# one sequence (logprobs.shared_prefix_pack, where it costs fewer FLOPs than a pack a group): a
# CPU, where every pass runs at the matmul rate (the default run's prompts share 143 of their ~172
# tokens: docs/benchmarks.md); not yet a GPU, whose passes are not timed with it
SHARED_PREFIX_ON = ("cpu",)


def describe_run(args, policy, world_size, device, dtype, examples, resume_from):
    """train.py's first line(s): the model, the ranks and device, the compute dtype, the task, the
    configuration, the resume; on CUDA also what the sampler will attend with, by its rule."""
    num_params = sum(p.numel() for p in unwrap(policy).parameters())
    line = (f"{args.model}: {num_params / 1e6:.0f}M parameters on {world_size} x {device.type}, "
            f"{str(dtype)[6:]} compute, {args.task} ({len(examples)} problems), "
            f"{args.kl}-in-{args.place} beta={args.beta}"
            + (f", resuming {resume_from}" if resume_from else
               ", no checkpoint to resume" if args.resume else ""))
    if device.type == "cuda":
        line += "\n" + cuda_decode.attention_choice(device, dtype)[1]
    return line


def resolve_device_defaults(args, device):
    """Resolve in `args` what waits for a GPU run's verdict (the rules in docs/benchmarks.md): the
    compiled sampler (--compile-sampler unset: COMPILED_SAMPLER_ON), attention by sequences in
    every pass (BY_SEQUENCES_ON: args.by_segments), the prompts' common prefix once in every pass
    (SHARED_PREFIX_ON: args.share_prefix, a CPU's); the sampler's FlexAttention (FLEX_DECODE_ON) is
    cuda_decode.attention_choice's. Each is off on a GPU until a GPU run turns it on."""
    if args.compile_sampler is None:
        args.compile_sampler = device.type in COMPILED_SAMPLER_ON
    args.by_segments = device.type in BY_SEQUENCES_ON
    args.share_prefix = device.type in SHARED_PREFIX_ON and not args.by_segments


# --generate-rows auto: the share of the GPU memory free when a rollout starts that its KV cache may
# take (the rest: the prefill's activations, the sampling step's logits over the vocabulary)
KV_SHARE = 0.5


def rows_that_fit(sampler, prompts, max_new_tokens):
    """--generate-rows auto: on CUDA, how many rows' KV caches (the longest prompt + max_new_tokens
    slots each) fit in KV_SHARE of the memory free now; None on a CPU (all rows at once)."""
    device = next(sampler.parameters()).device
    if device.type != "cuda":
        return None
    per_row = kv_bytes(sampler, 1, max(map(len, prompts)) + max_new_tokens)
    return max(1, int(KV_SHARE * cuda_free_for_tensors(device) // per_row))


def kv_bytes(model, num_rows, max_len):
    """Bytes of the KV cache rollout.cache_for_prompts allocates for num_rows rows of max_len slots
    (K and V, every layer, in the model's dtype)."""
    import rollout

    return 2 * math.prod(rollout.cache_shape(model, num_rows, max_len)) * next(
        model.parameters()).element_size()


def cuda_free_for_tensors(device):
    """Bytes a new tensor may take on the GPU: what the driver has free, plus what PyTorch's caching
    allocator holds unused (the last training pass's temporaries, which it frees and retries with
    before it runs out of memory), lab/memory_plan.py's premise."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def bf16x6_cannot_run(device, capability=None):
    """Why --logprob-dtype bf16x6 cannot run on `device` (None where it can: any CPU, whose pieces'
    products are exact fp32; a CUDA card of compute capability 8.0 or higher with torch 2.8's
    out_dtype GEMM). `capability`: the card's (major, minor), else torch.cuda's answer."""
    if device.type != "cuda":
        return None
    major, minor = capability or torch.cuda.get_device_capability(device)
    if major < 8:
        return (f"--logprob-dtype bf16x6 needs bf16 tensor cores (compute capability 8.0 or "
                f"higher); this GPU has {major}.{minor}: use --logprob-dtype float32 (auto picks "
                f"it here)")
    if not split_matmul.OUT_DTYPE:
        return (f"--logprob-dtype bf16x6 needs torch.mm's out_dtype on CUDA (torch 2.8 or later), "
                f"this is {torch.__version__}: use --logprob-dtype float32 (auto picks it here)")
    return None


def pass_dtypes(args, device):
    """(--dtype, --logprob-dtype) as train.py's main resolved them: the gradient pass's, the
    no-grad ones'."""
    return getattr(torch, args.dtype), logprob_dtype(args.logprob_dtype, device)


def logprob_dtype(name, device, capability=None):
    """The torch dtype of the no-grad log-prob passes for --logprob-dtype `name` on `device`, or
    "bf16x6" (fp32 whose linear layers' matmuls are six bf16 tensor-core products: split_matmul.py).
    "auto": CUDA_LOGPROB_DTYPE on the cards of BF16X6_PAYS_ON where it runs, fp32 on every other
    card and on a CPU, where bf16 rounding puts a floor under every KL: docs/precision.md. bf16x6
    named on a card that cannot run it stops with a one-line error. `capability`: the card's
    (major, minor) where it is not this machine's (lab/memory_plan.py plans for one)."""
    if name == "auto":
        name = "float32"
        if device.type == "cuda":
            capability = capability or torch.cuda.get_device_capability(device)
            name = CUDA_LOGPROB_DTYPE
            if name == "bf16x6" and (tuple(capability) not in BF16X6_PAYS_ON
                                     or bf16x6_cannot_run(device, capability)):
                name = "float32"
    if name == "bf16x6" and (reason := bf16x6_cannot_run(device, capability)):
        fail(reason)
    return name if name == "bf16x6" else getattr(torch, name)


def start(dtype="auto"):
    """(rank, world_size, device, dtype): this process's device (GPU LOCAL_RANK of its node), set
    before torchrun's process group is joined, so NCCL binds to it (device_id) and not to cuda:0;
    the global rank and world size; the compute dtype."""
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        keep_freed_memory()
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    return rank, world_size, device, compute_dtype(dtype, device)


def keep_freed_memory():
    """A CPU run's memory, once its pages are faulted in, stays this process's: glibc serves every
    allocation from its heap (M_MMAP_MAX 0: no block of its own mmap, as each one over 32 MB was,
    unmapped when freed) and never trims the heap's top (M_TRIM_THRESHOLD -1). Each micro-batch
    and each step allocate the same shapes, so the blocks freed are the next ones' and no page is
    faulted in twice: before, the tied embedding's gradient (113 MB) and its zeros took ~0.9 s
    and ~0.8 s a micro-batch in fresh pages on a 2-core AVX2 CPU (docs/benchmarks.md, "Every
    freed block kept"). A no-op without glibc, and where the environment sets glibc's allocator
    (a MALLOC_*_ variable or GLIBC_TUNABLES: lab/memory_plan.py --measure gives each tensor pages of
    its own); a GPU run's host memory is left alone."""
    set_by_environment = any(name.startswith("MALLOC_") for name in os.environ) or (
        "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""))
    if _libc is not None and not set_by_environment:
        _libc.mallopt(M_MMAP_MAX, 0)
        _libc.mallopt(M_TRIM_THRESHOLD, -1)


def finish():
    if dist.is_initialized():
        dist.destroy_process_group()


def return_freed_memory():
    """Give the pages of freed memory back to the operating system (glibc's malloc_trim, which
    keep_freed_memory's settings do not stop; a no-op elsewhere): lab/memory_plan.py's baseline
    before a run. train.py no longer calls it: a trim before each pass, then once a step, made the
    next gradient pass fault its pages in again (its forward up to 2x slower on a 2-core AVX2
    CPU, the peak no lower: docs/benchmarks.md, "The heap kept across steps")."""
    if _libc is not None:
        _libc.malloc_trim(0)


def stop_if_any_rank(message, prog=None):
    """If any rank has a message, every rank stops with it; call it on every rank at the same
    point."""
    messages = [message]
    if dist.is_initialized():
        messages = [None] * dist.get_world_size()
        dist.all_gather_object(messages, message)
    message = next((m for m in messages if m), None)
    if message:
        fail(message, prog)


def all_reduce_sums(sums, device):
    """{name: number} summed over all ranks, in one collective (float64)."""
    total = torch.tensor(list(sums.values()), dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(total)
    return dict(zip(sums, total.tolist()))


def all_reduce_max(value, device):
    """The largest of one float over all ranks."""
    total = torch.tensor(value, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.MAX)
    return total.item()


def barrier():
    if dist.is_initialized():
        dist.barrier()


def shard(model):
    """FSDP2: each decoder layer is one shard group, the rest (embeddings, norm, head) the root
    group. Weights are gathered in fp32, so the fp32 log-prob passes are fp32; the gradient pass
    casts under autocast."""
    from torch.distributed.fsdp import fully_shard

    for module in model.modules():
        if type(module).__name__ in (model._no_split_modules or ()):  # e.g. LlamaDecoderLayer
            fully_shard(module)
    return fully_shard(model)


def wrap(model, device, fsdp):
    """The model to train: sharded (FSDP2), replicated (DDP, over 2 or more ranks), or as it is."""
    if fsdp:
        return shard(model)
    if dist.is_initialized() and dist.get_world_size() > 1:
        # gradients as views into DDP's all-reduce buckets: one copy of them, not two
        return DDP(model.to(device), device_ids=[device.index] if device.type == "cuda" else None,
                   gradient_as_bucket_view=True)
    return model.to(device)


def unwrap(model):
    """The transformers model inside DDP (FSDP2 shards it in place: it is its own)."""
    return model.module if isinstance(model, DDP) else model


def no_dropout(model):
    """Dropout off in train mode too (modules, and transformers' functional attention_dropout), so
    the gradient pass computes the same pi as the no-grad passes and the sampler."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def recompute_choice(name, device, config=None, worst_shape=None, room=None):
    """--recompute `name` on `device`: "auto" is CUDA_RECOMPUTE on CUDA; on a CPU "none" where one
    micro-batch of worst_shape fits `room` bytes without recomputation, else "full"
    (systems/activations.py, which also says how a CPU run's room is reckoned; "full" without
    them)."""
    if name != "auto":
        return name
    if device.type == "cuda":
        return CUDA_RECOMPUTE
    if config is None:
        return "full"
    return activations.recompute_on_cpu(config, worst_shape, room)


def checkpoint_activations(policy, choice="full"):
    """--recompute `choice` (systems/recompute.py): each decoder layer checkpointed, all of its
    activations recomputed in the backward pass (full) or its elementwise ops only (selective);
    none leaves the policy as it is."""
    if choice == "none":
        return
    # recent transformers 5 call it activation_checkpointing_enable
    enable = getattr(policy, "activation_checkpointing_enable",
                     policy.gradient_checkpointing_enable)
    enable(recompute.checkpoint_kwargs(choice))
    policy.train()  # transformers checkpoints only in train mode: keep dropout off, as in eval
    no_dropout(policy)


def make_sampler(policy, device, dtype, fsdp):
    """The copy of the policy that rollout.generate samples from: its weights in the compute dtype,
    made without a second fp32 copy (each weight is cast as it is copied). Buffers keep their dtype:
    the rotary frequencies rounded to bf16 would turn every position's angle (a 0.2% error in a
    frequency is 0.3 radians at position 200). In fp32, without FSDP, the policy itself is the
    sampler. On a GPU the copy's q/k/v and gate/up weights are fused (cuda_decode.fuse_projections:
    4 GEMMs a layer, not 7; FUSED_PROJECTIONS_ON); the policy's, which the optimizer updates,
    never."""
    if dtype == torch.float32 and not fsdp:
        return policy.to(device)
    memo = {id(p): torch.nn.Parameter(p.detach().to(device, dtype), requires_grad=False)
            for p in policy.parameters()}  # deepcopy takes these for the weights, copies the rest
    sampler = copy.deepcopy(policy, memo).to(device).eval()
    if device.type in FUSED_PROJECTIONS_ON:
        cuda_decode.fuse_projections(sampler)
    return sampler


def sampler_decoder(device, compiled=False):
    """The decoder rollout.generate samples with on `device`, chosen once where the sampler is made
    (gpt-fast rebinds its decode step in main()): the GPU's machinery (cuda_decode.decoder: CUDA
    graphs, fused weights, flash-attn) on CUDA, and wherever the step is compiled (--compile-
    sampler); rollout's own forward and step elsewhere, a CPU's default."""
    import rollout

    if device.type == "cuda" or compiled:
        return functools.partial(cuda_decode.decoder, compiled=compiled)
    return rollout.own_decoder


def release_sampler(sampler, policy):
    """Free the sampler's weights until refresh_sampler writes them again: the training pass between
    the two needs the memory more (nothing to free where the policy samples itself)."""
    if sampler is not unwrap(policy):
        for param in sampler.parameters():
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        cuda_decode.unfuse_projections(sampler)  # the fused weights they were views of


@torch.no_grad()
def refresh_sampler(sampler, policy):
    """The sampler's weights: the fp32 master weights cast to its dtype (FSDP gathers one at a
    time)."""
    if sampler is unwrap(policy):
        return
    weights = dict(unwrap(policy).named_parameters())
    # a layer's old fused weights go as its views are replaced
    cuda_decode.unfuse_projections(sampler)
    for name, param in sampler.named_parameters():
        weight = weights[name]
        weight = weight.full_tensor() if isinstance(weight, DTensor) else weight
        param.data = weight.detach().to(param.dtype, copy=True)
    if next(sampler.parameters()).device.type in FUSED_PROJECTIONS_ON:
        cuda_decode.fuse_projections(sampler)  # fused again from the new weights
