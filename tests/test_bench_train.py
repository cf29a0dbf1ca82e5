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
    """pass_flops(pairs="computed") against FlopCounterMode on token_logprobs' packed forward (and
    backward): the same matmuls and attention over every pair of the pack (eager, so the counter
    sees it), to the 2% that the formula's biases and norms (counted as weights) leave. The MFU's
    count, over the pairs the mask allows, is below it by exactly the pairs the mask refuses."""
    args = bench_train.parser.parse_args(TINY)
    model = bench_train.build("tiny", torch.device("cpu"))
    model.set_attn_implementation("eager")  # attention as matmuls, which the counter counts
    prompts, responses, mask = bench_train.batch_of(args, model.config.vocab_size, "cpu")
    with FlopCounterMode(display=False) as counter:
        logp, _ = logprobs.token_logprobs(model, prompts, responses, mask, 1.0, torch.float32)
        if backward:
            logp.sum().backward()
    counted = counter.get_total_flops()
    computed = bench_train.pass_flops(model, args, len(prompts), backward, pairs="computed")
    assert computed == pytest.approx(counted, rel=0.02)
    allowed, every = bench_train.attention_pairs(args)
    refused = (every - allowed) * 4 * model.config.hidden_size * model.config.num_hidden_layers
    packs = len(prompts) // args.group_size
    assert computed - bench_train.pass_flops(model, args, len(prompts), backward) == \
        packs * refused * (3 if backward else 1)


def test_the_mfu_counts_the_pairs_the_mask_allows(one_thread, monkeypatch):
    """attention_pairs' allowed pairs are the True entries of the block mask token_logprobs hands the
    model (one pack a group, no padding at these shapes), its computed pairs the pack's L x L; the
    MFU over the allowed pairs is the smaller, reported beside the one over every pair."""
    args = bench_train.parser.parse_args([*TINY, "--prompt-tokens", "5", "--response-tokens", "7",
                                          "--group-size", "3"])
    model = bench_train.build("tiny", torch.device("cpu"))
    prompts, responses, mask = bench_train.batch_of(args, model.config.vocab_size, "cpu")
    masks, forward = [], model.forward

    def recorded(*a, **kwargs):
        masks.append(kwargs["attention_mask"])
        return forward(*a, **kwargs)
    monkeypatch.setattr(model, "forward", recorded)
    logprobs.token_logprobs(model, prompts, responses, mask, 1.0, torch.float32)
    (allowed,) = masks
    packs = len(prompts) // args.group_size
    assert allowed.shape[0] == packs
    assert bench_train.attention_pairs(args) == (allowed[0].sum().item(), allowed[0].numel())
    assert (allowed.sum(dim=(1, 2, 3)) == allowed[0].sum()).all()
    both = bench_train.mfus(model, args, len(prompts), True, seconds=2.0, peak=1e12)
    assert 0 < both["mfu"] < both["mfu_all_pairs"]


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H200", 989e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A10", 125e12), ("NVIDIA L4", 121e12),
    ("NVIDIA L40S", 362e12), ("NVIDIA GeForce RTX 4090", 165e12), ("NVIDIA B200", 2250e12),
    ("Tesla T4", None)])
def test_each_card_gets_its_own_peak(monkeypatch, name, peak):
    """The MFU's denominator by torch.cuda's device name: the PCIe H100 not taken for the SXM one,
    an A100 not for an A10, an L40S not for an L4; a card not in the table gets no MFU."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert bench_train.machine(torch.device("cuda"))["bf16_peak_flops"] == peak

def test_the_recompute_part_times_each_choice_and_saves_after_each(tmp_path, one_thread,
                                                                   monkeypatch):
    """--parts recompute: the gradient pass under --recompute full, selective and none (applied as
    train.py applies them), each timed beside memory_plan's trace of its pass (full's the
    smallest, none's the largest), then by sequences under the fastest of them; the JSON is
    rewritten after each measurement, so a timeout keeps what finished."""
    from systems import runtime

    applied, checkpoint_activations = [], runtime.checkpoint_activations
    seen, write_text = [], type(tmp_path).write_text

    def recorded(model, choice="full"):
        applied.append(choice)
        return checkpoint_activations(model, choice)

    def snapshot(path, text):  # the recompute part's measurements in each write of the JSON
        seen.append(sorted(json.loads(text)["parts"].get("recompute/tiny", {})))
        return write_text(path, text)
    monkeypatch.setattr(runtime, "checkpoint_activations", recorded)
    monkeypatch.setattr(type(tmp_path), "write_text", snapshot)
    report = bench_train.main([*TINY, "--parts", "recompute", "--out", str(tmp_path / "b.json")])
    result = report["parts"]["recompute/tiny"]
    choices = ("full", "selective", "none")
    assert all(result[choice]["s"] > 0 for choice in (*choices, "by_sequences")), result
    planned = [result[choice]["planned_pass_bytes"] for choice in choices]
    assert planned == sorted(planned) and planned[0] < planned[2], planned
    fastest = min(choices, key=lambda choice: result[choice]["s"])
    assert result["by_sequences"]["recompute"] == fastest
    # each choice on the model, then on memory_plan's fake one; by sequences on the model
    assert applied == [choice for choice in choices for _ in range(2)] + [fastest]
    measured = [[key for key in keys if key in (*choices, "by_sequences")] for keys in seen]
    assert measured[:5] == [[], ["full"], ["full", "selective"], ["full", "none", "selective"],
                            ["by_sequences", "full", "none", "selective"]], seen
