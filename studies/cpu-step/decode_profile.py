"""One-off (machine B as AVX2, 2026-12-03, fourth session): where a decode step's time goes at
bench_llamacpp's shape (SmolLM2-135M-Instruct fp32, 32 rows of one 173-token prompt, EOS off, the
sampler train.py uses on a CPU, glibc's heap kept as runtime.start keeps it), torch.profiler's
self CPU time by op over one generate call of 40 new tokens (one call before, to warm up), and
a decode step's time (the best of 3 calls of 40 tokens, less the best of 3 of 1). Its printed
tables: decode_profile.txt. No prediction: it describes, decides nothing.
`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python
studies/cpu-step/decode_profile.py`."""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import rollout  # noqa: E402
from lab.bench_llamacpp import NEW_TOKENS, ROWS, default_prompt_length  # noqa: E402
from systems import runtime  # noqa: E402
from systems.model import load_model  # noqa: E402

runtime.keep_freed_memory()  # as train.py's runtime.start on a CPU
model = load_model("smollm2-135m", torch.float32).eval()
prompt_len = default_prompt_length()
prompt = torch.randint(10, model.config.vocab_size - 10, (prompt_len,),
                       generator=torch.Generator().manual_seed(0)).tolist()


def generate(new_tokens):
    return rollout.generate(model, [prompt] * ROWS, new_tokens, temperature=1.0,
                            eos_token_id=None, generator=torch.Generator().manual_seed(0))


def seconds(new_tokens):
    start = time.perf_counter()
    generate(new_tokens)
    return time.perf_counter() - start


with torch.inference_mode():
    generate(NEW_TOKENS)
    first, whole = min(seconds(1) for _ in range(3)), min(seconds(NEW_TOKENS) for _ in range(3))
    print(f"{ROWS} rows, a {prompt_len}-token prompt, {NEW_TOKENS} new tokens, "
          f"{torch.get_num_threads()} threads: prefill + token 0 {first:.3f} s, a decode step "
          f"{(whole - first) / (NEW_TOKENS - 1) * 1e3:.1f} ms (the best of 3 calls each)")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        generate(NEW_TOKENS)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
