"""Speed and memory of rollout.generate on SmolLM2-135M (CPU, or --device cuda), against
model.generate in-process.

Prints: useful tokens/s (response tokens up to and including EOS) for ours and for Hugging Face's
generate, alternating A/B, same dtype, bf16 and fp32; the fraction of this CPU's bf16 matmul peak
(measured in the same run) reached at batch 40; tokens/s at 1024 new tokens vs 64 (EOS off);
peak memory vs weights + one KV cache (each in a fresh subprocess; on CUDA the allocator's peak).
"""
import argparse
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
args = parser.parse_args()

import torch  # noqa: E402  (after argparse so --help is instant)

import data  # noqa: E402
from model import load_model, load_tokenizer  # noqa: E402
from rollout import flash_choice, generate  # noqa: E402

if args.threads:
    torch.set_num_threads(args.threads)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DEVICE = torch.device(args.device)
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


def read_bandwidth(megabytes=512, reps=7):
    """Bytes/s of summing a large fp32 tensor: how fast this CPU streams memory
    (weights, KV cache)."""
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
                   generator=torch.Generator(DEVICE).manual_seed(seed))
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


if args.memory_probe:
    memory_probe(args.memory_probe[0], int(args.memory_probe[1]))
    sys.exit()

tokenizer = load_tokenizer("smollm2-135m")
eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
prompts = math500_prompts(tokenizer, args.prompts)
batch = [p for p in prompts for _ in range(args.samples)]  # each prompt G times, consecutively
print(f"SmolLM2-135M-Instruct, {args.prompts} MATH500 prompts x {args.samples} samples "
      f"= batch {len(batch)}, prompt lengths {min(map(len, prompts))}-{max(map(len, prompts))}, "
      f"threads {torch.get_num_threads()}, device "
      f"{torch.cuda.get_device_name() if DEVICE.type == 'cuda' else 'cpu'}")
if DEVICE.type == "cuda":  # which attention ours decodes with (rollout.flash_choice)
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
