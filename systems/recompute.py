"""--recompute: what the gradient pass keeps of each decoder layer's forward for its backward, and
what it computes again there (activation checkpointing; machinery, not the paper's: the gradient is
the same, only memory and time change). runtime.checkpoint_activations applies the choice.

- full: a layer keeps its input only and the backward runs its forward again
  (torch.utils.checkpoint, a call a layer, through transformers' activation_checkpointing_enable):
  every matmul twice, 8N FLOPs a token where 6N would do (N parameters), for the least memory.
- selective: the same checkpoint under PyTorch's selective activation checkpointing
  (create_selective_checkpoint_contexts, `policy`): the outputs of the layer's matmuls and of its
  attention (SAVED) are kept from the forward and the replay takes them from there; only the cheap
  ops between them run again (norms, rotary embedding, SiLU, casts, segment_attention's gathers).
  6N FLOPs; its memory lies between full's and none's (the matmuls' outputs, not the norms' fp32
  temporaries or the elementwise products).
- none: autograd keeps whatever each op saves for its backward.
lab/memory_plan.py plans each one's memory; `python -m lab.bench_train --parts recompute` times
them.
"""
import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

CHOICES = ("full", "selective", "none")
aten = torch.ops.aten
# the ops whose outputs selective keeps: the linear layers' matmuls (with a bias: addmm), the
# attention kernels SDPA dispatches (each one's outputs: the attention and its log-sum-exp), and
# the math fallback's batched matmuls
SAVED = {getattr(aten, name).default for name in (
    "mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu") if hasattr(aten, name)}


def policy(context, op, *args, **kwargs):
    """Selective checkpointing's rule for each op of a layer's forward: keep SAVED's outputs,
    recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_kwargs(choice):
    """torch.utils.checkpoint's keywords for `choice` ("full" or "selective")."""
    kwargs = {"use_reentrant": False}
    if choice == "selective":
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, policy)
    return kwargs
