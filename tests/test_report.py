"""Tests of --report-to (systems/report.py): what TensorBoard and W&B hold, read back through their own
formats, equals OUT/metrics.jsonl step by step, through a --resume; and whatever cannot work stops
with one line before any model loads (a W&B server out of reach: before the first step).

TensorBoard's event files are read by its own EventAccumulator. The W&B run is offline
(WANDB_MODE=offline) and read from its .wandb files: wandb 0.31 ships no Python reader of them
(wandb.sdk.internal.datastore is gone), so `wandb_records` reads their framing (LevelDB's log
format, after W&B's 7-byte header) and parses each record with wandb's own protobuf, Record. Runs
are conftest's letter-choice model, in this process (test_train.train), a few seconds each. Each
test skips, saying why, where its package is not installed; CI installs both (.ci/run).
"""
import json
import struct
import sys
from argparse import Namespace

import numpy as np
import pytest

from systems import checkpoint
from test_train import flags, metrics, train

EVAL = ("--eval-every", "2")  # eval/<task>/* at steps 2 and 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, letter_model):
    return letter_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def wandb_offline(monkeypatch, tmp_path):
    """wandb, offline."""
    return use_wandb_offline(monkeypatch, tmp_path)


def use_wandb_offline(monkeypatch, tmp_path):
    """W&B offline, its settings, cache and credentials kept out of the home directory."""
    wandb = pytest.importorskip("wandb", reason="--report-to wandb needs wandb: pip install wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_PROJECT", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    return wandb


def needs_tensorboard():
    pytest.importorskip("tensorboard", reason="--report-to tensorboard needs tensorboard: "
                                              "pip install tensorboard")


# ---------------------------------------------------------------- reading the logs back
def expected_curves(out, float32=False):
    """{key: [(step, value), ...]} of OUT/metrics.jsonl: every numeric value but the step itself
    (TensorBoard stores float32)."""
    curves = {}
    for row in metrics(out):
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)):
                curves.setdefault(key, []).append(
                    (row["step"], float(np.float32(value)) if float32 else value))
    return curves


def tensorboard_events(out):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    return EventAccumulator(str(out), size_guidance={"scalars": 0, "tensors": 0}).Reload()


def tensorboard_curves(out):
    """{tag: [(step, value), ...]} of OUT's event files, as TensorBoard reads them (a resume's
    purge_step applied)."""
    events = tensorboard_events(out)
    return {tag: [(event.step, event.value) for event in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def wandb_records(path):
    """The records of a .wandb file, as wandb's protobuf Records: after the header (':W&B', magic
    0xBEE1, version), LevelDB log records (checksum, length, type: full, first, middle, last) in
    32 KiB blocks."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, block, position, pieces = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B", path
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header: zeros
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if kind == 0:  # zero padding: the end of what was written
            break
        pieces += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # full, last
            record = Record()
            record.ParseFromString(pieces)
            pieces = b""
            yield record


def wandb_run(out):
    """(each offline run's (id, name, config), {key: [(step, value), ...]}) of OUT/wandb, oldest
    first: the W&B run as `wandb sync` would upload it."""
    runs, curves = [], {}
    for path in sorted(out.glob("wandb/offline-run-*/run-*.wandb")):
        for record in wandb_records(path):
            if record.HasField("run"):
                run = record.run
                config = {item.key: json.loads(item.value_json) for item in run.config.update}
                runs.append((run.run_id, run.display_name, config))
            if record.HasField("history"):
                for item in record.history.item:
                    key = item.key or "/".join(item.nested_key)
                    if not key.startswith("_"):  # wandb's own _step, _runtime, _timestamp
                        curves.setdefault(key, []).append(
                            (record.history.step.num, json.loads(item.value_json)))
    return runs, curves


# ---------------------------------------------------------------- tests
def test_tensorboard_equals_metrics_through_a_kill_and_resume(tiny, tmp_path):
    """3 steps, then a kill after step 3 was logged but before its checkpoint (final/ removed:
    step_2 is the newest), then --resume to 4 steps: TensorBoard holds exactly metrics.jsonl, every
    key (eval ones included) at every step once; step 3's first values are purged."""
    needs_tensorboard()
    out, extra = tmp_path / "run", ("--save-every", "2", *EVAL, "--report-to", "tensorboard")
    train(flags(tiny, out, "--steps", "3", *extra))
    assert [row["step"] for row in metrics(out)] == [1, 2, 3]
    first_step3 = tensorboard_curves(out)["sample_s"][2]
    checkpoint.retire(out / "final")
    train(flags(tiny, out, "--steps", "4", *extra, "--resume"))

    expected, logged = expected_curves(out, float32=True), tensorboard_curves(out)
    assert [row["step"] for row in metrics(out)] == [1, 2, 3, 4]
    assert logged == expected
    assert [step for step, _ in logged["eval/choice/accuracy"]] == [2, 4]
    assert [step for step, _ in logged["kl_k1"]] == [1, 2, 3, 4]  # no step twice
    assert logged["sample_s"][2] != first_step3  # the resumed run's own step 3
    config = tensorboard_events(out).Tensors("config/text_summary")
    assert [event.step for event in config] == [0, 2]  # the flags, at each start
    assert b"| --report-to | tensorboard |" in config[-1].tensor_proto.string_val[0]


def test_wandb_offline_history_equals_metrics_through_a_resume(tiny, tmp_path, wandb_offline):
    """2 steps, then --resume to 4 steps, offline, with no reference (kl_k1 is None: not
    logged): the same W&B run (id kept in OUT/wandb_id, named after OUT), the flags as its config,
    and its history exactly metrics.jsonl, every key (eval ones included) at every step once."""
    out, extra = tmp_path / "run", ("--place", "none", "--save-every", "2", *EVAL,
                                    "--report-to", "wandb")
    train(flags(tiny, out, "--steps", "2", *extra))
    train(flags(tiny, out, "--steps", "4", *extra, "--resume"))

    runs, logged = wandb_run(out)
    run_id = (out / "wandb_id").read_text().strip()
    assert [(id, name) for id, name, _ in runs] == [(run_id, "run")] * 2
    assert [(config["steps"], config["place"], config["out"]) for _, _, config in runs] == [
        (2, "none", str(out)), (4, "none", str(out))]
    assert [row["step"] for row in metrics(out)] == [1, 2, 3, 4]
    assert logged == expected_curves(out)
    assert [step for step, _ in logged["eval/choice/accuracy"]] == [2, 4]
    assert [step for step, _ in logged["reward"]] == [1, 2, 3, 4]  # no step twice
    assert "kl_k1" not in logged and metrics(out)[0]["kl_k1"] is None


@pytest.mark.parametrize("report_to", ["tensorboard", "wandb"])
def test_none_and_non_numbers_are_skipped(tmp_path, monkeypatch, report_to):
    """report.write alone: numbers logged at the row's step, None and text skipped (no NaN)."""
    from systems import report

    if report_to == "tensorboard":
        needs_tensorboard()
    else:
        use_wandb_offline(monkeypatch, tmp_path)
    args = Namespace(out=tmp_path / "run", report_to=report_to, kl="k1")
    args.out.mkdir()
    write = report.open(args, 0, rank=0)
    write({"step": 1, "reward": 0.25, "kl_k1": None, "note": "text", "eval/arith/accuracy": 0.5})
    write({"step": 2, "reward": 0.75, "kl_k1": 0.125, "skipped": 1})
    report.close()
    logged = tensorboard_curves(args.out) if report_to == "tensorboard" else wandb_run(args.out)[1]
    assert logged == {"reward": [(1, 0.25), (2, 0.75)], "kl_k1": [(2, 0.125)],
                      "eval/arith/accuracy": [(1, 0.5)], "skipped": [(2, 1)]}
    assert report.open(Namespace(out=args.out, report_to="none"), 0, rank=0) is None


def refuse_to_load(*args, **kwargs):
    raise AssertionError("a model was loaded")


@pytest.mark.parametrize("report_to, missing, named", [
    ("tensorboard", "torch.utils.tensorboard", "pip install tensorboard"),
    ("wandb", "wandb", "pip install wandb"),
    ("wandb", None, "WANDB_MODE=offline"),  # online, no API key anywhere
])
def test_what_cannot_work_fails_with_one_line_before_any_model_loads(
        tiny, tmp_path, monkeypatch, report_to, missing, named):
    if missing:
        monkeypatch.setitem(sys.modules, missing, None)  # import fails as if not installed
    else:
        use_wandb_offline(monkeypatch, tmp_path)
        monkeypatch.delenv("WANDB_MODE")
    with pytest.raises(SystemExit) as error:
        train(flags(tiny, tmp_path / "run", "--report-to", report_to),
              train__load_model=refuse_to_load)
    message = str(error.value.code)
    assert named in message and "\n" not in message
    assert missing or "wandb login" in message
    assert not (tmp_path / "run").exists()


def test_a_wandb_server_out_of_reach_stops_before_the_first_step(tiny, tmp_path, monkeypatch,
                                                                wandb_offline):
    """wandb.init failing (here: made to, as it does without a network) is a one-line error that
    names the offline mode, and no step runs."""
    from wandb.errors import CommError

    def unreachable(*args, **kwargs):
        raise CommError("Network error (ConnectionError), entering retry loop.\nmore lines")

    monkeypatch.setattr(wandb_offline, "init", unreachable)
    with pytest.raises(SystemExit) as error:
        train(flags(tiny, tmp_path / "run", "--report-to", "wandb"))
    message = str(error.value.code)
    assert "wandb.init failed (Network error" in message and "WANDB_MODE=offline" in message
    assert "\n" not in message
    assert metrics(tmp_path / "run") == []
