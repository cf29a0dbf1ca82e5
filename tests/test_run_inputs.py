"""Bad inputs to train.py and eval.py that must fail in one line before anything is lost (issue
56), and an FSDP run's sharded step_N read as a model. Cheap: each run stops before the first
step, or loads a tiny random Llama."""
import collections

import pytest
import torch

from systems import checkpoint
from test_train import flags, train


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, letter_model):
    return letter_model(tmp_path_factory.mktemp("tiny"))


def one_line(error):
    message = str(error.value.code)
    assert "\n" not in message
    return message


def test_out_naming_a_file_fails_before_any_model_loads(tiny, tmp_path, monkeypatch):
    import train as trainer

    (tmp_path / "out").write_text("notes")
    monkeypatch.setattr(trainer, "load", lambda *args: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as error:
        train(flags(tiny, tmp_path / "out"))
    assert "--out" in one_line(error) and "is a file" in one_line(error)
    assert (tmp_path / "out").read_text() == "notes"


@pytest.mark.parametrize("place", ["reward", "both"])
def test_k2_goes_in_the_loss_only(tiny, tmp_path, place):
    with pytest.raises(SystemExit) as error:
        train([*flags(tiny, tmp_path)[4:], "--kl", "k2", "--place", place])
    assert "--kl k2" in one_line(error) and "loss" in one_line(error)


def test_an_empty_model_folder_fails_in_one_line(tiny, tmp_path):
    (tmp_path / "empty").mkdir()
    argv = flags(tiny, tmp_path / "out")
    argv[argv.index("--model") + 1] = str(tmp_path / "empty")
    with pytest.raises(SystemExit) as error:
        train(argv)
    assert "without config.json" in one_line(error)


def test_a_sharded_step_checkpoint_loads_as_a_model(tmp_path, tiny_llama, smollm2_tokenizer,
                                                    one_thread):
    """An FSDP run's step_N holds its fp32 weights only as DCP shards: load_model (train.py and
    eval.py --model) reads them, and its tokenizer, as from any save_pretrained folder."""
    from systems.model import load_model, load_tokenizer

    policy = tiny_llama(len(smollm2_tokenizer))
    optimizer = torch.optim.AdamW(policy.parameters())
    trainer_state = {"step": 3, "data_position": 0, "world_size": 1, "sharded": True}
    checkpoint.save(tmp_path / "step_3", policy, smollm2_tokenizer, optimizer, torch.Generator(),
                    collections.deque(), trainer_state, 0)
    assert not checkpoint.has_weights(tmp_path / "step_3")
    loaded = load_model(str(tmp_path / "step_3"))
    assert loaded.state_dict().keys() == policy.state_dict().keys()
    for name, tensor in policy.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert load_model(str(tmp_path / "step_3"), torch.bfloat16).dtype == torch.bfloat16
    assert load_tokenizer(str(tmp_path / "step_3")).vocab == smollm2_tokenizer.vocab


@pytest.mark.parametrize("bad_row", [
    pytest.param(b"[" * 100_000 + b"]" * 100_000, id="deep-nesting"),  # json's RecursionError
    pytest.param('{"problem": "café?", "answer": "2"}'.encode("latin-1"), id="latin-1"),
    pytest.param(b'{"problem": "p", "answer": NaN}', id="nan-answer"),
])
def test_a_bad_task_file_fails_in_one_line_naming_its_line(tiny, tmp_path, capsys, bad_row):
    """train.py --task and eval.py --tasks read a .jsonl file alike (data.load_task): a bad row
    stops either in one line that names the file and the line."""
    import eval as evaluation

    task = tmp_path / "task.jsonl"
    task.write_bytes(b'{"problem": "1 + 1?", "answer": "2"}\n' + bad_row + b"\n")
    argv = flags(tiny, tmp_path / "out")
    argv[argv.index("--task") + 1] = str(task)
    with pytest.raises(SystemExit) as error:
        train(argv)
    assert f"{task}:2: " in one_line(error)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        evaluation.main(["--model", str(tiny["model"]), "--tasks", str(task),
                         "--out", str(tmp_path / "eval")])
    assert f": error: {task}:2: " in capsys.readouterr().err.splitlines()[-1]
