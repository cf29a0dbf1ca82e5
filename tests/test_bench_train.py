"""lab/bench_train.py on the CPU at a tiny shape: every part runs and reports, and its FLOP count
(the MFU's numerator) matches PyTorch's own FlopCounterMode on the trainer's packed pass."""
import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import logprobs
from lab import bench_train

TINY = ["--allow-cpu", "--shapes", "tiny", "--prompts", "2", "--group-size", "2",
        "--prompt-tokens", "6", "--response-tokens", "8", "--sample-tokens", "4",
        "--micro-batch", "2"]


def test_every_part_reports_on_a_cpu(tmp_path, one_thread):
    out = tmp_path / "bench.json"
    report = bench_train.main([*TINY, "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))  # what it returned
    train_part, precision = report["parts"]["train/tiny"], report["parts"]["precision/tiny"]
    assert "error" not in train_part and "error" not in precision
    for phase in ("sampling", "policy_nograd", "reference_nograd", "update_checkpointing_True",
                  "update_checkpointing_False"):
        assert train_part[phase]["s"] > 0, phase
    for on in (True, False):
        update = train_part[f"update_checkpointing_{on}"]
        assert update["gradient_pass_s"] + update["optimizer_s"] == pytest.approx(update["s"])
    assert 0 < train_part["nograd_share_of_training"] < 1
    assert train_part["logprob_dtype"] == "float32"  # train.py's auto on a CPU (bf16x6 on CUDA)
    # which SDPA kernel ran under train.py's block mask: a fused one (not the math fallback)
    for passes in ("attention_ops_nograd", "attention_ops_gradient"):
        assert any("scaled_dot_product" in op for op in train_part[passes]), train_part[passes]
    attention = report["parts"]["attention/tiny"]  # block mask against segments: the same log-probs
    assert "error" not in attention and attention["max_abs_logp_difference"] < 1e-5
    assert all(attention[way]["nograd_s"] > 0 for way in ("block_mask", "segments"))
    for way in ("block_mask", "segments"):  # which SDPA kernel each way ran, in both passes
        for passes in ("attention_ops_nograd", "attention_ops_gradient"):
            assert any("scaled_dot_product" in op for op in attention[way][passes]), attention[way]
    assert attention["segments"]["nograd_bf16x6_s"] > 0
    assert {"float32", "tf32", "bf16x6", "bfloat16"} <= {k for k, v in precision.items()
                                               if isinstance(v, dict) and v.get("s")}


def test_the_attention_part_passes_as_it_labels_them(tmp_path, one_thread, monkeypatch):
    """--parts attention: the block mask's no-grad passes with the mask, the segments' (fp32 and
    bf16x6 alike) by segments."""
    passes, no_grad_logprobs = [], logprobs.no_grad_logprobs

    def recorded(*args, **kwargs):
        passes.append((args[5], kwargs.get("by_segments", False)))
        return no_grad_logprobs(*args, **kwargs)
    monkeypatch.setattr(logprobs, "no_grad_logprobs", recorded)
    bench_train.main([*TINY, "--parts", "attention", "--out", str(tmp_path / "b.json")])
    assert sorted(set(passes), key=str) == [("bf16x6", True), (torch.float32, False),
                                            (torch.float32, True)], passes


def test_the_profile_part_says_where_a_groups_passes_spend_their_time(tmp_path, one_thread):
    """--parts profile: one group's gradient pass and no-grad pass under torch.profiler (a CPU's
    ops here), its matmuls among the largest, the kernels' time at most the wall time."""
    report = bench_train.main([*TINY, "--parts", "profile", "--out", str(tmp_path / "b.json")])
    (name, result), = report["parts"].items()
    assert name == "profile/tiny" and "error" not in result, result
    for phase in ("gradient_pass", "nograd_pass"):
        ops = [row["kernel"] for row in result[phase]["kernels"]]
        assert any(op in ("aten::mm", "aten::addmm", "aten::bmm") for op in ops[:10]), ops
        assert 0 < result[phase]["kernels_s"] <= result[phase]["wall_s"] * 1.05, result[phase]
    assert result["logprob_dtype"] == "float32"


@pytest.mark.parametrize("backward", [False, True])
def test_flops_match_pytorchs_count(backward, one_thread):
    """pass_flops against FlopCounterMode on token_logprobs' packed forward (and backward): the
    same matmuls and attention (eager, so the counter sees it), to the 2% that the formula's
    biases and norms (counted as weights) leave."""
    args = bench_train.parser.parse_args(TINY)
    model = bench_train.build("tiny", torch.device("cpu"))
    model.set_attn_implementation("eager")  # attention as matmuls, which the counter counts
    prompts, responses, mask = bench_train.batch_of(args, model.config.vocab_size, "cpu")
    with FlopCounterMode(display=False) as counter:
        logp, _ = logprobs.token_logprobs(model, prompts, responses, mask, 1.0, torch.float32)
        if backward:
            logp.sum().backward()
    counted = counter.get_total_flops()
    assert bench_train.pass_flops(model, args, len(prompts), backward) == pytest.approx(counted,
                                                                                        rel=0.02)

