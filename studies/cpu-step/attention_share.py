"""One-off (machine A, 2026-12-03, at 6853a1d's code): where the log-prob passes' time goes on the
default batch (8 arith prompts x 4 SmolLM2 samples, the shared-prefix pack train.py uses on a CPU),
torch.profiler's self CPU time by op, the no-grad pass and the gradient pass's forward (each run
once before, to warm up). Its printed tables: attention_share.txt.
`python studies/cpu-step/attention_share.py`."""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from systems import runtime  # noqa: E402
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # what runtime.start did at that code
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
import data, logprobs, rollout  # noqa: E402,E401
from systems import model as models  # noqa: E402

tokenizer, model = models.load_tokenizer("smollm2-135m"), models.load_model("smollm2-135m").eval()
stop = models.stop_token_ids(model, tokenizer)
problems = data.prompt_batch(data.load_task("arith", seed=0), 0, 8, 0)
prompts = [ids for example in problems for ids in [data.prompt_ids(tokenizer, example)] * 4]
out = rollout.generate(model, prompts, 40, 1.0, 1.0, stop, torch.Generator().manual_seed(5))
tokens, mask = out.tokens, out.response_mask
print("response tokens", int(mask.sum()))


def no_grad():
    with torch.no_grad():
        return logprobs.token_logprobs(model, prompts, tokens, mask, 1.0, torch.float32,
                                       share_prefix=True)


def with_grad():
    return logprobs.token_logprobs(model, prompts, tokens, mask, 1.0, torch.float32,
                                   entropy=True, share_prefix=True)


for function in (no_grad, with_grad):
    function()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        function()
    print(function.__name__)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))
