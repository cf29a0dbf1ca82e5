"""A pure-PyTorch stand-in for flash-attn 2.8.4's `flash_attn_with_kvcache`, so that rollout.py's
flash branch runs on a CPU (test_cuda_paths.py puts this directory's parent on sys.path, and
rollout.flash_attn_status's real import probe finds it). Never on the project's import path.

What it follows, from flash-attn's own source:
- flash_attn_interface.py, the docstring of flash_attn_with_kvcache: k, v are written *in place*
  into k_cache, v_cache (batch, seqlen_cache, nheads_k, headdim) at slots cache_seqlens[b],
  cache_seqlens[b] + 1, ...; cache_seqlens is read, never incremented; row b then attends over
  its first cache_seqlens[b] + seqlen_new slots; query head h reads key head h // (nheads /
  nheads_k); causal=True aligns the mask to the bottom right (query i of seqlen_q sees slots
  j <= i + seqlen_k - seqlen_q, seqlen_k = cache_seqlens[b] + seqlen_new); a query row with
  nothing to see returns zeros; softmax_scale defaults to headdim ** -0.5. The wrapper makes q, k,
  v contiguous when their last stride is not 1, asserts that k_cache's and v_cache's is.
- tests/test_flash_attn.py, attention_ref and test_flash_attn_kvcache: the reference it is
  computed as (inputs upcast to fp32, key padding mask, causal mask, softmax, output cast back).
- csrc/flash_attn/flash_api.cpp, mha_fwd_kvcache's TORCH_CHECKs, asserted here: fp16 or bf16
  (fp32 too only where a test sets ALLOW_FP32), every tensor the same dtype and device, last
  stride 1, head_dim <= 256, nheads divisible by nheads_k, the shapes, seqlen_q <= seqlen_cache
  when k is passed, cache_seqlens int32, contiguous, of shape (batch,). And one the kernel does not
  check: no write past the end of the cache (there it would write out of bounds).
Features rollout.py does not use (rotary, paged or indexed caches, left padding, ALiBi, windows,
softcap, the log-sum-exp) are refused, not implemented.

What it cannot prove: that the kernel itself computes this (its tiling, split-KV and in-place
write in CUDA), its numerics (fp32 accumulation per tile, the online softmax; bf16 outputs differ
from this one in the last bits), its speed, or that the real package builds and imports on a given
machine. Those need a GPU: test_gpu.py and gpu_check.py.
"""
import torch

__version__ = "2.8.4+standin"
ALLOW_FP32 = False  # a test sets it to compare with the SDPA path in fp32, to 1e-5
calls = 0  # how many times flash_attn_with_kvcache ran: a test checks the branch was taken


def _check(condition, message):
    if not condition:
        raise RuntimeError(message)  # what TORCH_CHECK raises


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                            block_table=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    global calls
    calls += 1
    for name, value in dict(rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                            cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                            block_table=block_table, alibi_slopes=alibi_slopes).items():
        _check(value is None, f"the stand-in does not implement {name}")
    _check(tuple(window_size) == (-1, -1) and softcap == 0.0 and not return_softmax_lse,
           "the stand-in does not implement window_size, softcap or return_softmax_lse")

    # the Python wrapper (flash_attn_interface.py)
    _check(k_cache.stride(-1) == 1, "k_cache must have contiguous last dimension")
    _check(v_cache.stride(-1) == 1, "v_cache must have contiguous last dimension")
    q, k, v = [x if x is None or x.stride(-1) == 1 else x.contiguous() for x in (q, k, v)]
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32,
                                   device=k_cache.device)

    # mha_fwd_kvcache (flash_api.cpp)
    allowed = (torch.float16, torch.bfloat16) + ((torch.float32,) if ALLOW_FP32 else ())
    _check(q.dtype in allowed, "FlashAttention only support fp16 and bf16 data type")
    _check(k_cache.dtype == q.dtype and v_cache.dtype == q.dtype,
           "query and key must have the same dtype")
    tensors = [x for x in (q, k_cache, v_cache, k, v, cache_seqlens) if x is not None]
    _check(all(x.device == q.device for x in tensors), "Tensor must be on the same device")
    _check(q.dim() == 4 and k_cache.dim() == 4, "q and k_cache must be 4-dimensional")
    batch, seqlen_q, heads, head_dim = q.shape
    batch_cache, seqlen_k, heads_k = k_cache.shape[:3]
    _check(batch > 0, "batch size must be positive")
    _check(head_dim <= 256, "FlashAttention forward only supports head dimension at most 256")
    _check(heads % heads_k == 0,
           "Number of heads in key/value must divide number of heads in query")
    _check(k_cache.shape == (batch_cache, seqlen_k, heads_k, head_dim) == v_cache.shape,
           f"k_cache, v_cache must have shape {(batch_cache, seqlen_k, heads_k, head_dim)}")
    # without cache_batch_idx, row b of q is row b of the cache
    _check(batch_cache >= batch, "the cache has fewer rows than q")
    seqlen_new = 0
    if k is not None:
        _check(v is not None and cache_seqlens is not None,
               "If key is supplied, value and seqlens_k must also be passed in")
        _check(seqlen_q <= seqlen_k,
               "If key is supplied, it must have seqlen <= the seqlen of the KV cache")
        _check(k.dtype == q.dtype and v.dtype == q.dtype, "Key must have the same dtype as query")
        seqlen_new = k.shape[1]
        _check(k.shape == (batch, seqlen_new, heads_k, head_dim) == v.shape,
               f"k, v must have shape {(batch, seqlen_new, heads_k, head_dim)}")
    if cache_seqlens is not None:
        _check(cache_seqlens.dtype == torch.int32, "seqlens_k must have dtype int32")
        _check(cache_seqlens.is_contiguous(), "seqlens_k must be contiguous")
        _check(cache_seqlens.shape == (batch,), f"seqlens_k must have shape {(batch,)}")
        lengths = cache_seqlens.long() + seqlen_new  # each row's keys, the new ones included
    else:
        lengths = torch.full((batch,), seqlen_k, device=q.device)
    _check(bool((lengths <= seqlen_k).all()), "a write past the end of the KV cache")

    # the in-place write: row b's new keys and values at slots cache_seqlens[b] ...
    if k is not None:
        rows = torch.arange(batch, device=q.device)[:, None]
        slots = cache_seqlens.long()[:, None] + torch.arange(seqlen_new, device=q.device)
        k_cache[rows, slots] = k
        v_cache[rows, slots] = v

    # attention_ref: fp32, query head h reading key head h // groups
    groups = heads // heads_k
    keys = k_cache[:batch].float().repeat_interleave(groups, dim=2)  # (b, s, heads, d)
    values = v_cache[:batch].float().repeat_interleave(groups, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q.float() * softmax_scale, keys)
    slot = torch.arange(seqlen_k, device=q.device)
    query = torch.arange(seqlen_q, device=q.device)[:, None]
    lengths = lengths[:, None, None, None]  # (b, 1, 1, 1) against scores (b, h, t, s)
    masked = slot >= lengths  # past the row's keys
    if causal:  # aligned to the bottom right: the last query sees every key of its row
        masked = masked | (slot > query + lengths - seqlen_q)
    attention = torch.softmax(scores.masked_fill(masked, -float("inf")), dim=-1)
    attention = attention.masked_fill(masked.all(-1, keepdim=True), 0.0)  # nothing to see: 0
    return torch.einsum("bhts,bshd->bthd", attention, values).to(q.dtype)
