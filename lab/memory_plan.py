"""Memory a rank of a train.py run takes, phase by phase, computed from the code before a GPU is
rented (issue 38; docs/gpu.md quotes its tables). The train.py flags after `--` are train.py's own.

    python -m lab.memory_plan --nproc 8 --gpu-gb 80 -- --kl k1 --place reward --fsdp \\
        --model Qwen/Qwen2.5-7B --group-size 5 --prompts-per-step 256 --micro-batch 4
    python -m lab.memory_plan --measure --nproc 2 -- --kl k1 --place reward --fsdp   # and a CPU run
    python -m lab.memory_plan --recipes               # docs/gpu.md's table: each recipe of the doc

Per rank, in each phase of a step (GB = 1e9 bytes); the phase's peak is its sum:
- resident in every phase, by arithmetic from the parameter count of the model built on the meta
  device: the policy's fp32 weights and AdamW's two fp32 moments, the reference in fp32 (none with
  --place none or --beta 0), DDP's gradient buckets (over 2+ ranks without --fsdp: they are the
  gradients, kept between steps). Under --fsdp all of these are split over the ranks.
- sampling: the sampler's copy in the compute dtype (none in fp32 without FSDP: the policy samples),
  the KV cache of one generate call at the longest prompt (its rows: --generate-rows, or as
  runtime.rows_that_fit picks them from --gpu-gb), the rollout's outputs, and the larger transient
  of a prefill bucket and of a decode step (logits, probabilities and their blocks over the vocab).
- no-grad passes: the log-prob pass (in --logprob-dtype) of one micro-batch, with the entropy (the
  policy's pass; the reference's has none). A CPU run of one process on-policy in fp32 skips the
  policy's (--one-policy-pass) and keeps the gradient pass's graphs of every micro-batch instead
  (systems/activations.py's closed form decides where they fit): the plan is that of
  --no-one-policy-pass, which --measure runs.
- gradient pass: the gradients (fp32) and one micro-batch's forward and backward in the compute
  dtype, under train.py's --recompute (systems/recompute.py); the phase's peak under each choice
  (full, selective, none) is printed after the table, and on CUDA which of them fit the card.
- FSDP (2+ ranks) adds to both passes the weights it gathers: the root (embeddings, norm, output
  layer) for the whole pass, and two decoder layers (the one computing and the next; in a no-grad
  pass an overcount: it peaks over the vocabulary with every layer resharded). A group's all-gather
  lands in a flat buffer of its size before it is copied out, and its gradients are copied into
  another for the reduce-scatter; the root's are the largest. So a pass's peak is the largest of
  its moments: at the root's all-gather (the buffer beside the gathered weights); in the pass
  (traced, in the gradient pass with the output layer's gradient kept from when it comes: FSDP2
  keeps it unsharded until the backward ends); and in the gradient pass at the root's gradient
  copy-in (its gradients beside their copy, its weights resharded) and as its reduce-scatter runs
  (the input, the output and the output layer's gradient, still held; on a CPU, gloo copies the
  input again). The table gives the largest moment's parts (studies/memory-plan/fsdp_trace.py
  follows these moments on real ranks).
- AdamW step: the gradients and AdamW's temporary (torch's foreach kernel on CUDA: the square root
  of every second moment at once; on a CPU one tensor at a time).
Each transient (a prefill bucket, a decode step, the two passes) is traced from rollout's and
logprobs.token_logprobs' own code on fake tensors (FakeTensorMode: shapes, no data), counting the
bytes of every storage alive after each op: the micro-batch is the largest that micro_batch_sizes
makes of the longest prompts with responses at full length (on CUDA the sampler's norms as their
fused kernel allocates: cuda_decode.rms_norm). A CUDA kernel's own workspace is not an op and is not
in the trace (docs/gpu.md compares the trace with the peaks an H200 measured); on CUDA, cuBLAS's
workspaces are resident: one for each thread and stream that runs a GEMM, kept to the end.
Host memory per node: each rank builds the fp32 model on its host (policy, then reference, one at a
time) before moving or sharding it.

--measure checks the plan against a real run on this machine: `torchrun train.py` with the same
flags and no stop token (every response at full length), each rank's peak per phase above its level
before the model loaded. On a CPU (gloo) the resident memory read from /proc (VmHWM, reset at each
phase's start), with tensors of 64 KiB or more in pages of their own (MALLOC_MMAP_THRESHOLD_),
returned when freed; on CUDA the bytes of the tensors allocated (max_memory_allocated, reset alike),
the plan then made for CUDA (give --gpu-gb the card's size, or --generate-rows).
"""
import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import logprobs  # noqa: E402
import rollout  # noqa: E402
from systems import activations  # noqa: E402
from systems import cuda_decode  # noqa: E402
from systems import runtime  # noqa: E402
from systems import split_matmul  # noqa: E402
from systems.recompute import CHOICES as RECOMPUTE  # noqa: E402
import train  # noqa: E402

GB = 1e9
# a cuBLAS workspace on a Hopper card (H100, H200): PyTorch's default CUBLAS_WORKSPACE_CONFIG there,
# 32 MiB, and cuBLASLt's 1 MiB (8.1 + 1 MiB on other cards)
CUBLAS_WORKSPACE = 33 * 2**20
# the paper's models (their config.json on the hub), so a plan needs no download
CONFIGS = {
    "Qwen/Qwen2.5-7B": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944,
                            num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                            vocab_size=152064, tie_word_embeddings=False),
    "Qwen/Qwen2.5-1.5B-Instruct": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960,
                                       num_hidden_layers=28, num_attention_heads=12,
                                       num_key_value_heads=2, vocab_size=151936,
                                       tie_word_embeddings=True),
    "meta-llama/Llama-3.1-8B-Instruct": dict(model_type="llama", hidden_size=4096,
                                             intermediate_size=14336, num_hidden_layers=32,
                                             num_attention_heads=32, num_key_value_heads=8,
                                             vocab_size=128256, tie_word_embeddings=False),
    "Qwen/Qwen3-4B-Instruct-2507": dict(model_type="qwen3", hidden_size=2560,
                                        intermediate_size=9728, num_hidden_layers=36,
                                        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                        vocab_size=151936, tie_word_embeddings=True),
}

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
group = parser.add_argument_group("the machines")
group.add_argument("--nproc", type=int, default=1, help="ranks (torchrun --nproc_per_node)")
group.add_argument("--nodes", type=int, default=1, help="nodes the ranks are spread over")
group.add_argument("--gpu-gb", type=float, default=80,
                   help="memory of one GPU, GB of 1e9 bytes (an H100 80GB holds 85.5)")
group.add_argument("--prompt-tokens", type=int, default=None,
                   help="the longest prompt of a step, tokens (default: the longest of --task's "
                        "training prompts in the model's chat template; offline, in the "
                        "embedded model's)")
group.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="where the run computes (cpu: the compute dtype and kernels of this CPU)")
group = parser.add_argument_group("what to print")
group.add_argument("--measure", action="store_true",
                   help="also run train.py here (torchrun --nproc_per_node NPROC, --steps 2) "
                        "and print each phase's measured peak beside the plan")
group.add_argument("--recipes", action="store_true",
                   help="print docs/gpu.md's memory table instead: each row's recipe planned "
                        "(prompts in the embedded model's tokens: the same table anywhere)")
group.add_argument("--json", default=None, help="also write the table (and measurement) here")

# docs/gpu.md's memory table starts with this line (recipe_rows writes it, recipes reads it)
MEMORY_TABLE = ("| recipe (flags after the 8-GPU command's) | GPUs | slots (prompt + response), "
                "rows a call of a rank's | sampling | no-grad passes | gradient pass | AdamW step "
                "| on one GPU |")
MATH_LONGEST_PROMPT = 2088  # the offline MATH-train file's longest chat prompt, SmolLM2's tokenizer


def config_of(name, trust_remote_code=False):
    """The model's config: CONFIGS, a local directory (or the embedded model), else the hub; a
    one-line error if none of them has it."""
    from transformers import AutoConfig

    from systems.hub import HubUnreachable
    from systems.model import _from_pretrained

    if name in CONFIGS:
        shape = dict(CONFIGS[name])
        return AutoConfig.for_model(shape.pop("model_type"), **shape)
    try:
        return _from_pretrained(AutoConfig, name, trust_remote_code=trust_remote_code)
    except (OSError, HubUnreachable) as error:
        runtime.fail(f"{str(error).splitlines()[0]} (known without a download: "
                     f"{', '.join(CONFIGS)})", "memory_plan")


def longest_prompt(flags, own_tokenizer=True):
    """(tokens, how they were counted): the longest chat prompt of --task's training set in
    --model's tokenizer; offline (or without own_tokenizer), in the embedded model's (a hub name's
    MATH: the local MATH-train file); MATH_LONGEST_PROMPT if neither loads."""
    import data
    from systems.model import EMBEDDED, load_tokenizer

    local_math = ROOT.parent / "shared" / "data" / "math_train.jsonl"
    for name in (flags.model, EMBEDDED)[not own_tokenizer:]:
        try:
            tokenizer = load_tokenizer(name)
            task = str(local_math) if flags.task == "math" and name != flags.model else flags.task
            examples = data.load_task(task, split="train", seed=flags.seed)
        except Exception:  # noqa: BLE001 - a hub name offline, a missing file: the next way
            continue
        return (max(len(data.prompt_ids(tokenizer, example)) for example in examples),
                f"the longest of {Path(task).name}'s prompts in {name}'s tokens")
    return MATH_LONGEST_PROMPT, "MATH-train's longest prompt in SmolLM2's tokens"


class LiveBytes(TorchDispatchMode):
    """The peak bytes of the tensor storages that ops create, each counted until it is freed (a
    storage's Python object lives exactly as long as the storage, saved for backward or not); views
    of the storages made before (weights, a cache) count nothing."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak, self.before = {}, 0, 0, {}

    def release(self, key):
        self.now -= self.live.pop(key)

    def add(self, key, nbytes, name):
        """A new storage alive (name: the op and shape that made it)."""
        self.live[key] = nbytes
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for tensor in tree_flatten((args, kwargs))[0]:
            if isinstance(tensor, torch.Tensor) and id(tensor.untyped_storage()) not in self.live:
                storage = tensor.untyped_storage()  # made before, or outside
                self.before[id(storage)] = weakref.ref(storage)
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = id(storage)
            made_before = key in self.before and self.before[key]() is storage
            if key in self.live or made_before:
                continue
            self.add(key, storage.nbytes(), f"{func.__name__} {tuple(tensor.shape)}")
            weakref.finalize(storage, self.release, key)
        return out


@contextlib.contextmanager
def real_layout():
    """logprobs.pack_layout and response_tokens read the response lengths (host values): on real
    tensors, every response full length."""
    pack_layout, response_tokens = logprobs.pack_layout, logprobs.response_tokens

    def layout(prompts, response_mask):
        with unset_fake_temporarily():
            return pack_layout(prompts, torch.ones(response_mask.shape))

    def tokens(response_mask):
        with unset_fake_temporarily():
            return response_tokens(torch.ones(response_mask.shape))
    logprobs.pack_layout, logprobs.response_tokens = layout, tokens
    try:
        yield
    finally:
        logprobs.pack_layout, logprobs.response_tokens = pack_layout, response_tokens


def fake_model(config, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval().requires_grad_(False)


@contextlib.contextmanager
def cuda_gemm():
    """split_matmul's GEMM as CUDA allocates it: its fp32 output only (torch.mm's out_dtype)."""
    gemm = split_matmul.mm_fp32
    split_matmul.mm_fp32 = lambda a, b: a.new_empty(a.shape[0], b.shape[0], dtype=torch.float32)
    try:
        yield
    finally:
        split_matmul.mm_fp32 = gemm


@contextlib.contextmanager
def cuda_rms_norm():
    """F.rms_norm as CUDA allocates it (aten._fused_rms_norm, one kernel: cuda_decode.rms_norm): its
    output in x's dtype; a CPU's composite makes fp32 copies of x first."""
    rms_norm = torch.nn.functional.rms_norm
    torch.nn.functional.rms_norm = lambda x, *args, **kwargs: torch.empty_like(x)
    try:
        yield
    finally:
        torch.nn.functional.rms_norm = rms_norm


def traced(run):
    """The peak bytes of the storages run() creates, on fake tensors."""
    tracker = LiveBytes()
    with tracker:
        run()
    return tracker.peak


def traced_sampling(config, dtype, rows, distinct, prompt_tokens, max_new_tokens, fused, cuda):
    """(prefill bucket, decode step) transient peaks, bytes: the forward over one prefill bucket
    of the call's `distinct` prompts (its next-token logits included), and a decode step (over all
    `rows` at the longest span, sampling included), both on `cuda` as CUDA runs them
    (cuda_decode's forward and static_step), else rollout's own, beside a KV cache of `rows` x
    (prompt_tokens + max_new_tokens) slots that is not counted here; `fused`: the projections
    fused, as runtime.make_sampler's copy has them; `cuda`: the norms as CUDA's fused kernel allocates
    them."""
    norms = cuda_rms_norm() if cuda else contextlib.nullcontext()
    with FakeTensorMode(allow_non_fake_inputs=True), norms:
        model = fake_model(config, dtype)
        if fused:
            cuda_decode.fuse_projections(model)
        slots = prompt_tokens + max_new_tokens
        shape = rollout.cache_shape(model, rows, slots)
        cache = rollout.KVCache(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype),
                                torch.zeros(rows, dtype=torch.int32))
        bucket = -(-distinct // rollout.PREFILL_BUCKETS)  # rollout.prefill's buckets
        ids = torch.zeros(bucket, prompt_tokens, dtype=torch.long)

        def prefill():
            view = rollout.KVCache(cache.k[:, :bucket], cache.v[:, :bucket],
                                   cache.seqlens[:bucket].clone())
            # the forward CUDA runs (cuda_decode.decoder's), else rollout's own
            forward = cuda_decode.forward if cuda else rollout.forward
            hidden = forward(model, ids, view, span=prompt_tokens)
            model.lm_head(hidden[:, -1]).float()

        state = rollout.new_decoding(torch.zeros(rows, max_new_tokens, dtype=torch.float64),
                                     torch.tensor([0]), 1.0, 1.0)
        step = cuda_decode.static_step if cuda else rollout.sample_step
        return traced(prefill), traced(lambda: step(model, cache, state, span=slots))


def traced_passes(config, prompts, max_new_tokens, dtype, recompute,
                  logprob_dtype=torch.float32, keep_head_gradient=False):
    """(no-grad pass peak, gradient pass peak without its parameter gradients), bytes, of one
    micro-batch of `prompts` with responses of max_new_tokens tokens, traced on fake tensors: the
    no-grad pass in `logprob_dtype` with the entropy, the gradient pass under autocast to
    `dtype` with --recompute `recompute` (full, selective, none: systems/recompute.py); with
    keep_head_gradient, the output layer's gradient is kept from when it comes to the pass's end
    (FSDP2 holds it unsharded until the backward ends). `logprob_dtype` "bf16x6"
    (systems/split_matmul.py): each linear layer's bf16 pieces and their GEMM's fp32 output, as on
    CUDA (a CPU's GEMM also makes fp32 copies of the pieces)."""
    responses = torch.zeros(len(prompts), max_new_tokens, dtype=torch.long)
    mask = torch.ones(len(prompts), max_new_tokens)
    pieces = contextlib.nullcontext()
    if logprob_dtype == "bf16x6":
        pieces, logprob_dtype = split_matmul.bf16_pieces(6), torch.float32
    with real_layout(), FakeTensorMode(allow_non_fake_inputs=True):
        model = fake_model(config, torch.float32)
        with torch.no_grad(), pieces, cuda_gemm():
            nograd = traced(lambda: logprobs.token_logprobs(model, prompts, responses, mask, 1.0,
                                                            logprob_dtype, entropy=True))
    return nograd, traced_gradient_pass(config, prompts, max_new_tokens, dtype, recompute,
                                        keep_head_gradient)


def traced_gradient_pass(config, prompts, max_new_tokens, dtype, recompute,
                         keep_head_gradient=False):
    """traced_passes' gradient pass alone (its peak without the parameter gradients, bytes)."""
    responses = torch.zeros(len(prompts), max_new_tokens, dtype=torch.long)
    mask = torch.ones(len(prompts), max_new_tokens)
    with real_layout(), FakeTensorMode(allow_non_fake_inputs=True):
        model = fake_model(config, torch.float32).requires_grad_(True)
        runtime.checkpoint_activations(model, recompute)  # as train.py applies --recompute
        head = model.get_output_embeddings().weight
        for param in model.parameters():  # the plan counts the gradients: drop each as it comes
            if not (keep_head_gradient and param is head):
                param.register_post_accumulate_grad_hook(lambda param: setattr(param, "grad", None))

        def gradient_pass():
            logp, _ = logprobs.token_logprobs(model, prompts, responses, mask, 1.0, dtype)
            logp.sum().backward()
        return traced(gradient_pass)


def plan(flags, nproc, gpu_bytes, prompt_tokens, device, every_recompute=False):
    """({phase: {component: bytes}}, facts) for train.py's parsed `flags` on `nproc` ranks; with
    every_recompute, facts["gradient_pass_by_recompute"] too: the gradient pass's peak under each
    --recompute choice, all else as the flags say."""
    config = config_of(flags.model, flags.trust_remote_code)
    with torch.device("meta"):
        meta = fake_model(config, torch.float32)
    params = sum(p.numel() for p in meta.parameters())
    layer = max(sum(p.numel() for p in block.parameters()) for block in meta.model.layers)
    root = params - sum(p.numel() for p in meta.model.layers.parameters())
    largest = max(p.numel() for p in meta.parameters())
    # auto: bf16 on a GPU that computes it natively (A100, H100 and later), this CPU's choice here
    dtype = (runtime.compute_dtype(flags.dtype, torch.device(device)) if device == "cpu" else
             torch.bfloat16 if flags.dtype == "auto" else getattr(torch, flags.dtype))
    size = torch.finfo(dtype).bits // 8
    fsdp, ddp = flags.fsdp, not flags.fsdp and nproc > 1
    sharded = fsdp and nproc > 1
    shard = 1 / nproc if fsdp else 1
    rows = flags.prompts_per_step // nproc * flags.group_size
    slots = prompt_tokens + flags.max_new_tokens

    resident = {"policy weights, fp32": 4 * params * shard,
                "AdamW moments, fp32": 8 * params * shard}
    if flags.place != "none" and flags.beta > 0:
        resident["reference, fp32"] = 4 * params * shard
    if ddp:
        resident["DDP's gradient buckets, fp32"] = 4 * params
    if device == "cuda":
        # cuBLAS's workspace for each (thread, stream) that has run a GEMM, in PyTorch's allocator
        # until the process ends: the main thread's stream, autograd's backward thread and the
        # sampler's capture stream (cuda_decode.capture_stream)
        resident["cuBLAS's workspaces, 3 streams"] = 3 * CUBLAS_WORKSPACE
    sampler = size * params if fsdp or size != 4 else 0
    kv_row = 2 * math.prod(rollout.cache_shape(meta, 1, slots)) * size  # runtime.kv_bytes, K and V
    call_rows = min(flags.generate_rows or rows, rows)
    if device == "cuda" and not flags.generate_rows:  # runtime.rows_that_fit, free memory then
        free = gpu_bytes - sum(resident.values()) - sampler
        call_rows = max(1, min(rows, int(runtime.KV_SHARE * free // kv_row)))
    # a call's rows are whole groups of --group-size, but for one split by the call's end
    distinct = min(-(-call_rows // flags.group_size) + 1, call_rows)
    fused = sampler > 0 and device in runtime.FUSED_PROJECTIONS_ON  # as make_sampler does
    prefill, decode = traced_sampling(config, dtype, call_rows, distinct, prompt_tokens,
                                      flags.max_new_tokens, fused, device == "cuda")
    prompts = [[g] * prompt_tokens for g in range(rows // flags.group_size + 1)
               for _ in range(flags.group_size)][:rows]
    sizes = logprobs.micro_batch_sizes(prompts, flags.micro_batch)
    micro = max(sizes)
    # the plan's card is an 80 GB A100 or H100 (sm80/sm90: auto picks bf16x6 on both)
    logprob_dtype = runtime.logprob_dtype(flags.logprob_dtype, torch.device(device),
                                          capability=(9, 0))
    # as train.py chooses: on a CPU by the closed form of systems/activations.py (this machine's)
    worst = activations.worst_shape(prompt_tokens, flags.group_size, flags.micro_batch, rows,
                                    flags.max_new_tokens)
    room = activations.budget(params, "reference, fp32" in resident, nproc, nproc if fsdp else 1)
    recompute = runtime.recompute_choice(flags.recompute, torch.device(device), config, worst, room)
    nograd, grad_pass = traced_passes(config, prompts[:micro], flags.max_new_tokens, dtype,
                                      recompute, logprob_dtype, keep_head_gradient=sharded)
    grads = {} if ddp else {"gradients, fp32": 4 * params * shard}
    # AdamW's denominator sqrt(v) + eps: CUDA's foreach kernel makes it for every tensor at once, a
    # CPU's loop one tensor at a time (a square root, then its quotient: two of the largest)
    adamw_temporary = 4 * params * shard if device == "cuda" else 2 * 4 * largest * shard
    nograd_pass = {"one micro-batch's pass (traced)": nograd}
    in_pass = {"one micro-batch's pass (traced)": grad_pass}
    moments = {"no-grad passes": {"in the pass": nograd_pass},
               "gradient pass": {"in the pass": in_pass}}
    if sharded:  # FSDP2: studies/memory-plan/fsdp_trace.py follows these moments
        # the root for the whole pass; two layers, the one computing and the next (in a no-grad
        # pass an overcount: it peaks over the vocabulary with every layer resharded)
        gathered = {"FSDP: the root and two decoder layers gathered, fp32": 4 * (root + 2 * layer)}
        # a group's all-gather lands in a flat buffer of the group's size, then is copied out
        buffer = {"FSDP: the root's all-gather buffer, fp32": 4 * root}
        # the pass traced with the output layer's gradient kept: FSDP2 frees it at the end
        in_pass = {"one micro-batch's pass, the output layer's gradient kept (traced)": grad_pass}
        # the backward's end: the root's gradients are copied into the reduce-scatter's input,
        # then freed; as it runs, the input, its output and the output layer's gradient (still
        # referenced) are alive, and on a CPU gloo's own copy of the input
        running = {"FSDP: the reduce-scatter's input and output, fp32": 4 * root * (1 + shard),
                   "FSDP: the output layer's gradient, still held, fp32":
                       4 * meta.get_output_embeddings().weight.numel()}
        if device == "cpu":
            running["gloo's copy of the reduce-scatter's input, fp32"] = 4 * root
        moments = {"no-grad passes": {"at the root's all-gather": {**gathered, **buffer},
                                      "in the pass": {**gathered, **nograd_pass}},
                   "gradient pass": {
                       "at the root's all-gather": {**gathered, **buffer},
                       "in the pass": {**gathered, **in_pass},
                       "at the root's gradient copy-in": {
                           "FSDP: the root's gradients and the reduce-scatter's input, fp32":
                               8 * root},
                       "as the root's reduce-scatter runs": running}}
    # a phase's peak is its largest moment
    peaks = {phase: max(options, key=lambda moment: sum(options[moment].values()))
             for phase, options in moments.items()}
    nograd_parts = moments["no-grad passes"][peaks["no-grad passes"]]
    grad_parts = moments["gradient pass"][peaks["gradient pass"]]
    table = {
        "sampling": {**resident, "sampler's copy, compute dtype": sampler,
                     "KV cache of a generate call": call_rows * kv_row,
                     # generate's outputs: int64 tokens, fp32 log-probs, float64 uniforms
                     "rollout's outputs and uniforms": rows * flags.max_new_tokens * (8 + 4 + 8),
                     "a prefill bucket or a decode step, the larger (traced)":
                         max(prefill, decode)},
        "no-grad passes": {**resident, **nograd_parts},
        "gradient pass": {**resident, **grads, **grad_parts},
        "AdamW step": {**resident, **grads, "AdamW's temporary, fp32": adamw_temporary},
    }
    if every_recompute:  # the gradient pass's moments, its own pass traced under each choice
        others = {choice: grad_pass if choice == recompute else traced_gradient_pass(
                      config, prompts[:micro], flags.max_new_tokens, dtype, choice, sharded)
                  for choice in RECOMPUTE}
        held = sum(resident.values()) + sum(grads.values())
        gradient_moments = {moment: sum(parts.values()) for moment, parts in
                            moments["gradient pass"].items()}
        by_recompute = {choice: held + max(
            {**gradient_moments,
             "in the pass": gradient_moments["in the pass"] - grad_pass + traced_bytes}.values())
            for choice, traced_bytes in others.items()}
    facts = dict(model=flags.model, params=params, ranks=nproc, fsdp=fsdp, dtype=str(dtype)[6:],
                 recompute=recompute, rows_per_rank=rows, generate_rows=call_rows,
                 micro_batch_rows=micro,
                 prompt_tokens=prompt_tokens, max_new_tokens=flags.max_new_tokens, slots=slots,
                 prefill_bytes=prefill, decode_step_bytes=decode,
                 peak_moments=peaks,  # and each moment's bytes above the parts held all
                 # step (weights, AdamW, the reference, the gradients)
                 moments={phase: {moment: sum(parts.values()) for moment, parts in options.items()}
                          for phase, options in moments.items()})
    if every_recompute:
        facts["gradient_pass_by_recompute"] = by_recompute
    return table, facts


def advice(table, gpu_bytes, flags):
    """A flag that lowers each phase over the GPU's memory."""
    more_gpus = "more GPUs" if flags.fsdp else "more GPUs with --fsdp"
    tips = {"sampling": "--generate-rows (fewer rows a generate call)",
            "no-grad passes": f"--micro-batch (fewer rows a pass), or {more_gpus}",
            "gradient pass": "--micro-batch" + (
                "" if runtime.recompute_choice(flags.recompute, torch.device("cuda")) == "full"
                else ", --recompute full") + f", or {more_gpus}",
            "AdamW step": more_gpus}
    return {phase: tips[phase] for phase, parts in table.items()
            if sum(parts.values()) > gpu_bytes}


def recipes(text):
    """(label, ranks, train.py argv) of each row of docs/gpu.md's memory table (in `text`): its
    first cell names a command of the doc's first code block ("the 8-GPU command") or gives flags
    in backticks that go after the 8-GPU command's."""
    import re
    import shlex

    block = text.split("```bash\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    commands = {}  # "8-GPU" -> (ranks, argv)
    for line in block.splitlines():
        if " train.py " in f" {line} " and not line.startswith("#"):
            ranks = re.search(r"--nproc_per_node=(\d+)", line)
            ranks = int(ranks.group(1)) if ranks else 1
            commands[f"{ranks}-GPU"] = ranks, shlex.split(line.split("train.py", 1)[1])
    table = text.split(MEMORY_TABLE, 1)[1].split("\n\n", 1)[0]
    found = []
    for line in table.splitlines()[2:]:
        label = line.split("|")[1].strip()
        if label.startswith("the "):
            ranks, argv = commands[label.split()[1]]
        else:
            ranks, argv = commands["8-GPU"]
            argv = argv + shlex.split(label.split("`")[1])
        found.append((label, ranks, argv))
    return found


def recipe_rows(text, gpu_bytes, only=None):
    """docs/gpu.md's memory table, each row planned (or the rows labelled in `only`): markdown
    lines."""
    lines = [MEMORY_TABLE, "|---|---|---|---|---|---|---|---|"]
    for label, ranks, argv in recipes(text):
        if only is not None and label not in only:
            continue
        flags = train.parser.parse_args(argv)
        prompt_tokens, _ = longest_prompt(flags, own_tokenizer=False)  # the same table anywhere
        table, facts = plan(flags, ranks, gpu_bytes, prompt_tokens, "cuda")
        tips = advice(table, gpu_bytes, flags)
        spare = gpu_bytes - max(sum(parts.values()) for parts in table.values())
        verdict = ("; ".join(f"over in {phase}: {tip}" for phase, tip in tips.items())
                   or f"fits, {spare / GB:.1f} spare")
        lines.append(f"| {label} | {ranks} | {prompt_tokens:,} + {flags.max_new_tokens:,}, "
                     f"{facts['generate_rows']} of {facts['rows_per_rank']} | "
                     + " | ".join(f"{sum(parts.values()) / GB:.1f}" for parts in table.values())
                     + f" | {verdict} |")
    return lines


# ---------------------------------------------------------------- the measurement on this CPU


def resident_bytes(key):
    """This process's VmRSS or VmHWM, bytes."""
    status = Path("/proc/self/status").read_text()
    return int(status.split(f"{key}:")[1].split()[0]) * 1024


class Phases:
    """Each phase's peak memory above `base`: a phase's start resets the peak and its end (or a
    phase nested in it) reads it; the outer phase goes on after a nested one ends. On a CPU the
    process's resident memory (VmHWM, reset through clear_refs), on CUDA the tensors' bytes
    (max_memory_allocated)."""

    def __init__(self, cuda):
        self.cuda, self.base, self.peaks, self.open = cuda, None, {}, []

    def now(self):
        return torch.cuda.memory_allocated() if self.cuda else resident_bytes("VmRSS")

    def flush(self):
        if self.open:
            name = self.open[-1]
            peak = torch.cuda.max_memory_allocated() if self.cuda else resident_bytes("VmHWM")
            self.peaks[name] = max(self.peaks.get(name, 0), peak - self.base)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS

    def wrap(self, name, function):
        def wrapped(*args, **kwargs):
            self.flush()
            self.open.append(name)
            try:
                return function(*args, **kwargs)
            finally:
                self.flush()
                self.open.pop()
        return wrapped


def measure_worker(out, argv):
    """train.main(argv) with no stop ids, each phase's peak resident memory written to
    OUT/rank{RANK}.json (what --measure launches in each process)."""
    phases = Phases(torch.cuda.is_available())
    load_model = train.load_model

    def first_load(*args, **kwargs):
        if phases.base is None:
            runtime.return_freed_memory()
            phases.base = phases.now()
        return load_model(*args, **kwargs)
    train.load_model = first_load
    train.stop_token_ids = lambda *args, **kwargs: []
    runtime.SHARED_PREFIX_ON = ()  # the plan's layout: a pack a group (its synthetic prompts')
    rollout.generate = phases.wrap("sampling", rollout.generate)
    logprobs.no_grad_logprobs = phases.wrap("no-grad passes", logprobs.no_grad_logprobs)
    train.update = phases.wrap("gradient pass", train.update)
    torch.optim.AdamW.step = phases.wrap("AdamW step", torch.optim.AdamW.step)
    train.main(argv)
    Path(out, f"rank{os.environ.get('RANK', 0)}.json").write_text(json.dumps(phases.peaks))


def measure(nproc, train_argv):
    """Each phase's largest measured peak over the ranks, bytes, of a 2-step train.py run here."""
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={nproc}", "-m", "lab.memory_plan", "--as-worker", out,
                   *train_argv, "--steps", "2", "--out", str(Path(out) / "run"),
                   "--no-one-policy-pass"]  # the plan's passes: the policy's no-grad pass too
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode:
            sys.exit(done.stderr[-3000:])
        ranks = [json.loads(path.read_text()) for path in Path(out).glob("rank*.json")]
    return {phase: max(rank.get(phase, 0) for rank in ranks) for phase in ranks[0]}


def main(argv=None):
    args, rest = parser.parse_known_args(argv)
    if args.recipes:
        print("\n".join(recipe_rows((ROOT / "docs" / "gpu.md").read_text(), args.gpu_gb * GB)))
        return
    train_argv = [a for a in rest if a != "--"]
    flags = train.parser.parse_args(train_argv)
    # train.py's own checks at --nproc ranks (but --fsdp's torchrun check: this is not a run)
    if message := train.check_flags(argparse.Namespace(**{**vars(flags), "fsdp": False}),
                                    args.nproc):
        runtime.fail(message, "memory_plan")
    if args.prompt_tokens is not None and args.prompt_tokens < 1:
        runtime.fail(f"--prompt-tokens must be >= 1, got {args.prompt_tokens}", "memory_plan")
    if args.measure:  # the plan of the machine that measures
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    prompt_tokens, counted = ((args.prompt_tokens, "--prompt-tokens") if args.prompt_tokens
                              is not None else longest_prompt(flags))
    table, facts = plan(flags, args.nproc, args.gpu_gb * GB, prompt_tokens, args.device,
                        every_recompute=True)
    measured = measure(args.nproc, train_argv) if args.measure else {}
    facts["host_gb_per_node"] = 4 * facts["params"] * -(-args.nproc // args.nodes) / GB
    print(f"{facts['model']}: {facts['params'] / 1e9:.2f}B parameters, {args.nproc} rank(s)"
          f"{', FSDP' if flags.fsdp else ''}, {facts['dtype']} compute, "
          f"{facts['rows_per_rank']} rows a rank, {facts['generate_rows']} a generate call, "
          f"micro-batches of up to {facts['micro_batch_rows']} rows, prompts of up to "
          f"{prompt_tokens} tokens ({counted}), responses of {flags.max_new_tokens}")
    for phase, parts in table.items():
        seen = f", measured {measured[phase] / GB:.2f} GB" if phase in measured else ""
        others = facts["moments"].get(phase, {})
        moment = (f", its peak {facts['peak_moments'][phase]} (each moment above the parts held "
                  "all step: " + ", ".join(f"{name} {nbytes / GB:.2f}"
                                           for name, nbytes in others.items())
                  + ")" if len(others) > 1 else "")
        print(f"\n{phase}: {sum(parts.values()) / GB:.2f} GB a rank{moment}{seen}")
        for name, nbytes in parts.items():
            print(f"  {nbytes / GB:8.2f}  {name}")
    print(f"\nhost memory of a node while its ranks build the model: "
          f"~{facts['host_gb_per_node']:.0f} GB (each rank's fp32 model)")
    by_recompute = facts["gradient_pass_by_recompute"]
    print(f"\nthe gradient pass by --recompute (train.py's: {facts['recompute']}): "
          + ", ".join(f"{choice} {nbytes / GB:.2f} GB" for choice, nbytes in by_recompute.items()))
    if args.device == "cuda":
        fit = [choice for choice, nbytes in by_recompute.items() if nbytes <= args.gpu_gb * GB]
        print(f"  fit {args.gpu_gb:g} GB: {', '.join(fit) or 'none of them'}")
    tips = advice(table, args.gpu_gb * GB, flags) if args.device == "cuda" else {}
    for phase, tip in tips.items():
        print(f"does not fit {args.gpu_gb:g} GB in {phase}: lower it with {tip}")
    if args.device == "cuda" and not tips:
        print(f"fits {args.gpu_gb:g} GB in every phase (before kernels' own workspaces and "
              "fragmentation)")
    if args.json:
        Path(args.json).write_text(json.dumps({"facts": facts, "table": table, "measured": measured,
                                               "does_not_fit": tips}, indent=1) + "\n")
    return table, facts, measured


if __name__ == "__main__":
    if sys.argv[1:2] == ["--as-worker"]:
        measure_worker(sys.argv[2], sys.argv[3:])
    else:
        main()
