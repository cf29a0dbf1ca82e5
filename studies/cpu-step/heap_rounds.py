"""One-off (machine A, 2026-12-03, code as at 71a97a7): four rounds of the default step's
passes in one process, SmolLM2's default batch (8 arith prompts x 4, 40 new tokens): generate, the
no-grad pass, the gradient pass's forward and its backward, each timed; between rounds `trim` calls
malloc_trim(0) (what train.py did once a step), `notrim` does not, `keep` also raises glibc's mmap
and trim thresholds. Its printed lines (peak: ru_maxrss's KiB / 1e6), from the same code run from
/tmp before it moved here: heap_rounds.txt.
`python studies/cpu-step/heap_rounds.py trim|notrim|keep`."""
import ctypes
import resource
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
variant = sys.argv[1]
libc = ctypes.CDLL("libc.so.6")
if variant == "keep":
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 30), libc.mallopt(M_TRIM_THRESHOLD, 1 << 40)
from systems import runtime  # noqa: E402
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # what runtime.start did at that code
import torch  # noqa: E402
import data, logprobs, rollout  # noqa: E402,E401
from systems import model as models  # noqa: E402

tokenizer, model = models.load_tokenizer("smollm2-135m"), models.load_model("smollm2-135m").eval()
stop = models.stop_token_ids(model, tokenizer)
problems = data.prompt_batch(data.load_task("arith", seed=0), 0, 8, 0)
prompts = [ids for example in problems for ids in [data.prompt_ids(tokenizer, example)] * 4]
for it in range(4):
    t0 = time.perf_counter()
    generator = torch.Generator().manual_seed(5 + it)
    out = rollout.generate(model, prompts, 40, 1.0, 1.0, stop, generator)
    t1 = time.perf_counter()
    tokens, mask = out.tokens, out.response_mask
    with torch.no_grad():
        logprobs.token_logprobs(model, prompts, tokens, mask, 1.0, torch.float32, share_prefix=True)
    t2 = time.perf_counter()
    logp, entropy = logprobs.token_logprobs(model, prompts, tokens, mask, 1.0, torch.float32,
                                            entropy=True, share_prefix=True)
    t3 = time.perf_counter()
    (logp.sum() / mask.sum()).backward()
    t4 = time.perf_counter()
    model.zero_grad(set_to_none=True)
    del logp, entropy, out
    if variant == "trim":
        libc.malloc_trim(0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    print(f"{variant} it{it}: generate {t1 - t0:.2f} ref {t2 - t1:.2f} gradfwd {t3 - t2:.2f} "
          f"backward {t4 - t3:.2f} peak {peak:.2f} GB", flush=True)
