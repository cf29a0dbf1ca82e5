"""systems/recompute.py through runtime.checkpoint_activations: --recompute full, selective and none
give the same gradients; full computes each linear layer's matmul again in the backward, selective
none of them (it keeps their outputs), and keeps less than none of the forward."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import logprobs
from systems import recompute, runtime

MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


class Ops(TorchDispatchMode):
    """How many times each op runs."""

    def __enter__(self):
        self.counts = {}
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] = self.counts.get(func, 0) + 1
        return func(*args, **(kwargs or {}))


def gradient_pass(tiny_llama, choice, dtype, by_segments=False):
    """A tiny Llama's gradient pass (two groups packed, forward under autocast to `dtype`, then
    backward) under --recompute `choice`: (its gradients, the matmuls its forward ran, those its
    backward ran)."""
    model = tiny_llama(vocab_size=60, num_hidden_layers=3)
    runtime.checkpoint_activations(model, choice)
    prompts = [[1, 2, 3]] * 2 + [[4, 5]] * 3
    responses = torch.randint(1, 60, (5, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(5, 7)
    mask[1, 5:] = 0
    with Ops() as forward:
        logp, _ = logprobs.token_logprobs(model, prompts, responses, mask, 1.0, dtype,
                                          by_segments=by_segments)
    with Ops() as backward:
        if by_segments:  # the replay attends as the forward did (train.micro_batches)
            from systems import segment_attention
            with segment_attention.attention(model):
                logp.sum().backward()
        else:
            logp.sum().backward()
    count = lambda ops: sum(n for op, n in ops.counts.items() if op in MATMULS)  # noqa: E731
    return {name: p.grad for name, p in model.named_parameters()}, count(forward), count(backward)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("by_segments", [False, True], ids=["block-mask", "by-sequences"])
def test_every_choice_gives_the_same_gradients(tiny_llama, one_thread, dtype, by_segments):
    """The gradients under full, selective and none are equal, bit for bit (selective replays the
    same elementwise ops on the same matmul outputs), in fp32 and under bf16 autocast, with the
    block mask and by sequences."""
    full, _, _ = gradient_pass(tiny_llama, "full", dtype, by_segments)
    for choice in ("selective", "none"):
        grads, _, _ = gradient_pass(tiny_llama, choice, dtype, by_segments)
        assert grads.keys() == full.keys()
        for name in full:
            torch.testing.assert_close(grads[name], full[name], atol=0, rtol=0,
                                       msg=f"{choice}: {name}")


def test_selective_runs_no_matmul_twice(tiny_llama, one_thread):
    """The backward's matmuls: none runs two a linear layer's forward one (the gradients of its
    input and of its weight); full runs its forward's again, 6 of a layer's 7 (the replay stops
    after the last tensor the backward needs: the down projection's input; the output layer is
    outside the layers); selective as many as none: the replay takes every matmul's output from
    the forward."""
    counts = {choice: gradient_pass(tiny_llama, choice, torch.bfloat16)[1:] for choice in
              recompute.CHOICES}
    forward, backward_none = counts["none"]
    assert forward == 3 * 7 + 1  # q, k, v, o, gate, up, down a layer; the output layer
    assert backward_none == 2 * forward
    assert counts["full"] == (forward, backward_none + 3 * 6)
    assert counts["selective"] == (forward, backward_none)
