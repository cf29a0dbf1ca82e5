"""The two parts the change touches, timed alone on a CPU (one thread, SmolLM2's shapes, fp32):
Hugging Face's apply_rotary_pos_emb on q and k against cuda_decode.rope on each, an RMSNorm module
against cuda_decode.rms_norm, at a decode step's 32 rows and a prefill's 8 x 178 tokens, twice each:
`OMP_NUM_THREADS=1 python studies/norms-rope-cpu/parts.py > studies/norms-rope-cpu/parts.txt`."""
import sys
import time
from pathlib import Path

import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from systems import cuda_decode  # noqa: E402  (the fewer-kernel forms, moved there in issue 54)


def microseconds(run, calls):
    """CPU time of one run(), averaged over `calls` after 50 to warm."""
    for _ in range(50):
        run()
    start = time.process_time()
    for _ in range(calls):
        run()
    return (time.process_time() - start) / calls * 1e6


torch.set_num_threads(1)
torch.manual_seed(0)
for rows, length, calls in ((32, 1, 2000), (8, 178, 200)):
    q, k = torch.randn(rows, length, 9, 64), torch.randn(rows, length, 3, 64)
    cos, sin = torch.randn(rows, length, 64), torch.randn(rows, length, 64)
    ours_cos, ours_sin = cos[:, :, None], cuda_decode.signed_sin(sin)[:, :, None]
    norm, x = LlamaRMSNorm(576), torch.randn(rows * length, 576)
    for _ in range(2):
        theirs = microseconds(lambda: apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2), calls)
        ours = microseconds(lambda: (cuda_decode.rope(q, ours_cos, ours_sin),
                                     cuda_decode.rope(k, ours_cos, ours_sin)), calls)
        print(f"rope, {rows} x {length}: Hugging Face {theirs:.0f} us, ours {ours:.0f} us")
    for _ in range(2):
        theirs = microseconds(lambda: norm(x), calls)
        ours = microseconds(lambda: cuda_decode.rms_norm(norm, x), calls)
        print(f"RMSNorm, {rows * length} x 576: Hugging Face {theirs:.0f} us, ours {ours:.0f} us")
