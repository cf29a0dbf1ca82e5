"""Tests of data.py: every task loads offline (hub tasks through a mocked hub call with rows in the
hub's format) and renders a prompt; local .jsonl files; procedural splits; score() dispatch."""
import json
from pathlib import Path

import pytest

import data
from systems import hub

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
FIXTURES = Path(__file__).parent / "fixtures"

# A few rows in each hub dataset's own format (columns as `datasets.load_dataset` returns them).
HUB_ROWS = {
    ("EleutherAI/hendrycks_math", "algebra"): [
        {"problem": "Solve $2x + 3 = 7$.", "level": "Level 1", "type": "Algebra",
         "solution": "Subtract 3: $2x = 4$, so $x = \\boxed{2}$."},
        {"problem": "No boxed answer here.", "level": "Level 2", "type": "Algebra",
         "solution": "It is 5."},
    ],
    ("EleutherAI/hendrycks_math", "geometry"): [
        {"problem": "Area of a unit square?", "level": "Level 1", "type": "Geometry",
         "solution": "First $\\boxed{2}$ is wrong; the area is $\\boxed{\\frac{2}{2}}$."},
    ],
    ("HuggingFaceH4/MATH-500", None): [
        {"problem": "Convert $(0,3)$ to polar coordinates.", "solution": "...",
         "answer": "\\left( 3, \\frac{\\pi}{2} \\right)", "subject": "Precalculus", "level": 2,
         "unique_id": "test/precalculus/807.json"},
    ],
    ("veds12/math-squared", None): [{"question": "What is $1 + 1$?", "answer": "2"}],
    ("cais/mmlu", "college_physics"): [
        {"question": "Which is a vector?", "subject": "college_physics",
         "choices": ["mass", "speed", "velocity", "energy"], "answer": 2},
    ],
}


@pytest.fixture
def mock_hub(monkeypatch):
    calls = []

    def hub_rows(path, config, split, alternative):
        calls.append((path, config, split))
        if path == "cais/mmlu":  # every subject: the physics row, relabelled
            return [dict(row, subject=config) for row in HUB_ROWS[(path, "college_physics")]]
        return [dict(row) for row in HUB_ROWS.get((path, config), [])]

    monkeypatch.setattr(data, "hub_rows", hub_rows)
    return calls


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer


def check_example(example):
    assert example["reward"] in ("math", "choice", "countdown")
    assert (example["messages"][-1]["role"] == "user"
            and data.INSTRUCTION in example["messages"][-1]["content"])
    assert example["problem"] in example["messages"][-1]["content"]
    assert isinstance(example["answer"], str) and example["answer"]


@pytest.mark.parametrize("name", data.TASKS)
def test_every_task_loads_and_renders_offline(name, mock_hub, tokenizer):
    examples = data.load_task(name, split="test", limit=5)
    assert 1 <= len(examples) <= 5
    for example in examples:
        check_example(example)
        ids = data.prompt_ids(tokenizer, example)
        text = tokenizer.decode(ids)
        assert example["problem"] in text and text.endswith("<|im_start|>assistant\n")
        plain = tokenizer.decode(data.prompt_ids(tokenizer, example, chat_template=False))
        assert (example["problem"] in plain and "<|im_start|>" not in plain
                and plain.endswith("Answer:"))


def test_hub_rows_become_examples(mock_hub):
    math = data.load_task("math", split="train")
    # the last box; the unboxed row is dropped
    assert [e["answer"] for e in math] == ["2", "\\frac{2}{2}"]
    assert (math[0]["subject"] == "Algebra" and math[0]["level"] == "Level 1"
            and math[0]["reward"] == "math")
    assert ({call[1] for call in mock_hub} == set(data.MATH_SUBJECTS)
            and {call[2] for call in mock_hub} == {"train"})
    (m500,) = data.load_task("math500")
    assert m500["answer"] == "\\left( 3, \\frac{\\pi}{2} \\right)" and m500["level"] == 2
    (m2,) = data.load_task("math2")
    assert m2["answer"] == "2" and m2["problem"] == "What is $1 + 1$?"
    (mmlu,) = data.load_task("mmlu-college-physics")
    assert mmlu["answer"] == "C" and mmlu["reward"] == "choice"
    assert "A. mass\nB. speed\nC. velocity\nD. energy" in mmlu["messages"][-1]["content"]
    assert ("cais/mmlu", "college_physics", "test") in mock_hub
    assert (data.score(mmlu, "velocity, so \\boxed{C}") == 1.0
            and data.score(m500, "\\boxed{(3, \\pi/2)}") == 1.0)


@pytest.mark.parametrize("name, local", [("math", "math_train.jsonl"), ("math500", "math500.jsonl"),
                                         ("math2", ".jsonl"),
                                         ("mmlu-college-biology", "mmlu_college_biology.jsonl")])
def test_hub_tasks_offline_fail_at_once_naming_the_local_file(name, local, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(hub.HubUnreachable, match=local.replace(".", r"\.")):
        data.load_task(name)


def test_math2_row_without_known_columns_says_what_it_found():
    with pytest.raises(ValueError, match="Frage"):
        data.math2_row({"Frage": "?", "Antwort": "2"})
    assert (data.math2_row({"problem": "p", "solution": "so \\boxed{7}"})
            == {"problem": "p", "answer": "7"})


# ---- local .jsonl files --------------------------------------------------------------------------

def test_local_jsonl_fixtures():
    math = data.load_task(str(FIXTURES / "math.jsonl"))
    assert [e["answer"] for e in math] == ["\\frac{1}{2}", "7", "0.25"]  # a number becomes a string
    assert all(e["reward"] == "math" for e in math)
    assert (data.score(math[0], "so \\boxed{0.5}") == 1.0
            and data.score(math[1], "\\boxed{8}") == 0.0)
    choice = data.load_task(str(FIXTURES / "choice.jsonl"))
    assert [e["answer"] for e in choice] == ["B", "D"]  # an index and a letter
    assert (data.score(choice[0], "\\boxed{(B)}") == 1.0
            and data.score(choice[1], "\\boxed{B}") == 0.0)


@pytest.mark.parametrize("line, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"question": "q"}', "expected keys"),
    ('{"problem": "p"}', "expected keys"),
    ('{"problem": "", "answer": "1"}', "'problem'"),
    ('{"problem": "p", "answer": "  "}', "'answer'"),
    ('{"problem": "p", "answer": null}', "'answer'"),
    ('{"question": "q", "choices": ["a", "b", "c", "d"], "answer": 4}', "'answer'"),
    ('{"question": "q", "choices": ["a", "b", "c", "d"], "answer": "E"}', "'answer'"),
    ('{"question": "q", "choices": "abcd", "answer": 0}', "'choices'"),
    pytest.param("[" * 100_000 + "]" * 100_000, "nested too deeply", id="deep-nesting"),
    pytest.param('{"problem": "p", "answer": ' + "7" * 5_000 + "}", "4300 digits",
                 id="5000-digit-answer"),  # more digits than int() takes
    pytest.param('{"problem": "p", "answer": 1, "level": ' + "7" * 5_000 + "}", "4300 digits",
                 id="5000-digit-level"),
    # a \u escape of half a surrogate pair is no text: the tokenizer would raise mid-run
    (r'{"problem": "caf\udcff?", "answer": "2"}', r"not text \(a lone surrogate \\udcff"),
    (r'{"question": "q", "choices": ["a", "\ud800"], "answer": 0}', "lone surrogate"),
    # a non-finite gold answer: str() makes it "nan" or "inf", and \boxed{nan} would score 1
    ('{"problem": "p", "answer": NaN}', "finite"),
    ('{"problem": "p", "answer": Infinity}', "finite"),
    ('{"problem": "p", "answer": -Infinity}', "finite"),
    ('{"problem": "p", "answer": 1e999}', "finite"),
    ('{"problem": "p", "answer": -1e999}', "finite"),
])
def test_malformed_jsonl_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"problem": "1 + 1?", "answer": "2"}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"bad\.jsonl:3: .*{message}") as error:
        data.load_task(str(path))
    assert "\n" not in str(error.value)  # one line, as train.py and eval.py print it


def test_a_finite_number_is_still_a_gold_answer(tmp_path):
    path = tmp_path / "math.jsonl"
    path.write_text('{"problem": "p", "answer": 1e300}\n{"problem": "q", "answer": -0.5}\n'
                    '{"problem": "r", "answer": ' + "7" * 4_300 + "}\n")
    assert [e["answer"] for e in data.load_task(str(path))] == ["1e+300", "-0.5", "7" * 4_300]


def test_a_surrogate_pair_in_escapes_is_one_character(tmp_path):
    path = tmp_path / "math.jsonl"
    path.write_text(r'{"problem": "smile \ud83d\ude00?", "answer": "\u00e9"}' + "\n")
    (example,) = data.load_task(str(path))
    assert example["problem"] == "smile \U0001F600?" and example["answer"] == "\u00e9"


@pytest.mark.parametrize("encoding, lineno, message", [
    ("latin-1", 3, r"not UTF-8 \(byte 0xe9 at column 17\)"),  # the é of "café"
    ("cp1252", 3, r"not UTF-8 \(byte 0xe9 at column 17\)"),
    ("utf-16", 1, "UTF-16"),  # with its byte-order mark
    ("utf-16-le", 1, "UTF-16"),  # without one: a NUL after every ASCII character
    ("utf-16-be", 1, "UTF-16"),
    ("utf-32", 1, "UTF-16 or UTF-32"),
])
def test_a_file_not_in_utf8_names_file_and_line(tmp_path, encoding, lineno, message):
    """A .jsonl file is UTF-8 (as JSON text exchanged between systems must be, RFC 8259); any
    other encoding is refused in one line naming the file, the line and what is wrong."""
    path = tmp_path / "bad.jsonl"
    path.write_bytes(('{"problem": "1 + 1?", "answer": "2"}\n\n'
                      '{"problem": "caf\u00e9?", "answer": "2"}\n').encode(encoding))
    with pytest.raises(ValueError, match=rf"bad\.jsonl:{lineno}: .*{message}") as error:
        data.load_task(str(path))
    assert "\n" not in str(error.value) and "UTF-8" in str(error.value)


def test_utf8_with_a_byte_order_mark_and_crlf_loads(tmp_path):
    path = tmp_path / "math.jsonl"
    path.write_bytes('{"problem": "caf\u00e9?", "answer": "2"}\r\n{"problem": "q", "answer": 3}\r\n'
                     .encode("utf-8-sig"))
    assert [(e["problem"], e["answer"]) for e in data.load_task(str(path))] == [
        ("caf\u00e9?", "2"), ("q", "3")]


def test_a_problem_with_an_empty_answer_is_skipped_and_named(tmp_path, capsys):
    """Nothing grades it: skipped, its line named on stderr (the offline MATH-train file has two,
    and refusing them refused docs/gpu.md's offline recipe); a file of nothing else is an error."""
    path = tmp_path / "math.jsonl"
    path.write_text('{"problem": "1 + 1?", "answer": "2"}\n{"problem": "p", "answer": ""}\n')
    assert [e["answer"] for e in data.load_task(str(path))] == ["2"]
    assert "skipped 1 row(s) with an empty answer, line(s) 2" in capsys.readouterr().err
    path.write_text('{"problem": "p", "answer": ""}\n')
    with pytest.raises(ValueError, match="no gradable rows"):
        data.load_task(str(path))


def test_real_local_files(capsys):
    if not DATA.is_dir():
        pytest.skip(f"{DATA} not found (real data lives outside the repo)")
    assert len(data.load_task(str(DATA / "math500.jsonl"))) == 500
    assert len(data.load_task(str(DATA / "math_train.jsonl"))) == 11_998  # 12,000 rows, 2 no answer
    assert "line(s) 1166, 8126" in capsys.readouterr().err
    biology = data.load_task(str(DATA / "mmlu_college_biology.jsonl"))
    assert len(biology) == 144 and all(e["answer"] in "ABCD" for e in biology)
    assert all(e["subject"] == "college_biology" for e in biology)


def test_limit_is_a_seeded_subset_in_file_order():
    full = data.load_task(str(FIXTURES / "math.jsonl"))
    subset = data.load_task(str(FIXTURES / "math.jsonl"), limit=2, seed=3)
    assert subset == data.load_task(str(FIXTURES / "math.jsonl"), limit=2, seed=3)
    assert (len(subset) == 2
            and [full.index(e) for e in subset] == sorted(full.index(e) for e in subset))


def test_bad_names():
    with pytest.raises(ValueError, match="unknown task 'gsm8k'.*arith"):
        data.load_task("gsm8k")
    with pytest.raises(ValueError, match="split"):
        data.load_task("arith", split="validation")
    with pytest.raises(ValueError, match="reward 'exact'"):
        data.score({"reward": "exact", "answer": "1"}, "1")


# ---- procedural tasks ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["arith", "countdown"])
def test_procedural_splits_are_seeded_and_disjoint(name):
    train = data.load_task(name, "train", limit=2000, seed=0)
    test = data.load_task(name, "test", limit=200, seed=0)
    assert data.load_task(name, "test", limit=200, seed=0) == test
    assert data.load_task(name, "test", limit=200, seed=1) != test
    assert {e["problem"] for e in train}.isdisjoint(e["problem"] for e in test)
    # other seeds too: the split is a fixed partition of the problems
    assert {e["problem"] for e in data.load_task(name, "train", limit=2000, seed=1)}.isdisjoint(
        e["problem"] for e in test)
    assert len(data.load_task(name, "train")) == data.PROCEDURAL_SIZE["train"]


def test_arith_answers():
    test = data.load_task("arith", "test")
    assert len({e["problem"] for e in test}) == len(test) > 150  # every test problem once
    for example in test:
        a, b = (int(tok) for tok in
                example["problem"].removeprefix("What is ").rstrip("?").split(" + "))
        assert 1 <= a <= 30 and 1 <= b <= 30 and example["answer"] == str(a + b)
        assert data.score(
            example, f"{a} + {b} = {a + b}. The final answer is \\boxed{{{a + b}}}.") == 1.0
        assert data.score(example, f"\\boxed{{{a + b + 1}}}") == 0.0
    train = data.load_task("arith")
    assert (len(train) == data.PROCEDURAL_SIZE["train"]
            and train[0]["messages"][1]["role"] == "assistant")


def test_countdown_answers_are_valid():
    examples = data.load_task("countdown", "test", limit=300)
    for example in examples:
        assert 3 <= len(example["numbers"]) <= 4 and all(1 <= n <= 100 for n in example["numbers"])
        assert 100 <= example["target"] <= 999
        assert data.score(example, f"<answer>{example['answer']}</answer>") == 1.0
        assert data.score(example, f"\\boxed{{{example['answer']} + 1}}") == 0.0
    assert json.dumps(examples)  # plain data: loggable
