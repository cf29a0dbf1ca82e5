"""lab/profile_step.py's FLOP count (`--flops`, the floor of issue 62): it counts the CPU's fused
attention kernels, which torch's own counter scores 0, and one decode step's FLOPs are those of the
model's arithmetic, counted by hand. Its replay (`--kernels`): the recorded kernels run again with
the run's layouts, shared tensors shared, and every counted FLOP replayed."""
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import rollout
from lab import profile_step
from lab.profile_step import TensorSpec


def counted(fn, mapping=profile_step.ATTENTION_FLOPS):
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        fn()
    return counter.get_total_flops()


def test_the_cpu_attention_kernels_are_counted():
    rows, heads, queries, keys, dim = 2, 3, 5, 7, 16
    q = torch.randn(rows, heads, queries, dim, requires_grad=True)
    k, v = (torch.randn(rows, heads, keys, dim, requires_grad=True) for _ in range(2))
    mask = torch.zeros(rows, 1, queries, keys)  # an additive mask, as rollout's bias
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    # forward: q k^T and p v, 2 FLOPs a multiply-add each; backward 2.5x (dv, dp, and dq, dk)
    forward = 2 * 2 * rows * heads * queries * keys * dim
    assert counted(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), {}) == 0
    assert counted(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)) == forward
    assert counted(lambda: out.sum().backward()) == 2.5 * forward


def test_one_decode_step_counts_the_models_arithmetic(tiny_llama):
    model = tiny_llama(vocab_size=50, num_hidden_layers=3).eval()
    config = model.config
    prompts = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
    cache, _, _ = rollout.cache_for_prompts(model, prompts, max_new_tokens=4)
    span, rows = 8, len(prompts)
    flops = counted(lambda: rollout.decode(model, torch.tensor([10, 11, 12]), cache, span))
    hidden, head_dim = config.hidden_size, config.hidden_size // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    # per layer: q and o (hidden^2 each), k and v (hidden x kv each), the MLP's three matrices
    layer_weights = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * config.intermediate_size
    weights = config.num_hidden_layers * layer_weights + hidden * config.vocab_size  # + lm_head
    attention = config.num_hidden_layers * 2 * 2 * rows * config.num_attention_heads * span \
        * head_dim
    assert flops == 2 * rows * weights + attention


def test_the_recorded_kernels_replay_with_the_runs_layouts(tiny_llama):
    model = tiny_llama(vocab_size=50, num_hidden_layers=3)
    calls = []
    with FlopCounterMode(display=False, custom_mapping=profile_step.ATTENTION_FLOPS) as counter, \
            profile_step.KernelRecorder(calls):
        model(torch.randint(0, 50, (2, 7))).logits.sum().backward()
    ops = {func.overloadpacket for func, *_ in calls}
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward in ops
    # every counted FLOP is in a recorded call: the replay counts the run's count
    assert counted(lambda: profile_step.replay_seconds(calls, repeats=1)) == \
        counter.get_total_flops() > 0
    specs = [spec for call in calls for spec in profile_step.tensor_specs(call)]
    replayed = [tensor for call in profile_step.replayable(calls)
                for tensor in profile_step.tensor_specs(
                    (None, *profile_step.tree_map_only(torch.Tensor, TensorSpec.of, call[1:])))]
    # each tensor with its recorded layout (a transposed weight stays transposed)...
    assert [(s.shape, s.stride, s.offset, s.dtype) for s in replayed] == \
        [(s.shape, s.stride, s.offset, s.dtype) for s in specs]
    assert any(s.stride != torch.empty(s.shape).stride() for s in specs)
    # ...and tensors the run shared (a weight read forward and backward) one buffer here
    same_in_run = [(a.storage, a.dtype) == (b.storage, b.dtype) for a in specs for b in specs]
    same_here = [(a.storage, a.dtype) == (b.storage, b.dtype) for a in replayed for b in replayed]
    assert same_here == same_in_run and sum(same_in_run) > len(specs)
