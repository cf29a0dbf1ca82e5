"""Tests of reward.py: real MATH500 answers, MATH-style equivalences, hostile completions,
countdown, choices."""
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

import reward

from reward import choice_reward, countdown_reward, extract_boxed, math_reward

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def math500_answers():
    path = DATA / "math500.jsonl"
    if not path.is_file():
        pytest.skip(f"{path} not found (real data lives outside the repo)")
    return [json.loads(line)["answer"] for line in path.open()]


# ---- extract_boxed -------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    (r"so \boxed{5}.", "5"),
    (r"\boxed{1} then \boxed{2}", "2"),  # the last box
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # nested braces
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
    (r"\fbox{7}", "7"),
    (r"\boxed{3} and \fbox{4}", "4"),
    (r"$\boxed 5$", "5"),
    (r"\boxed {x + 1}", "x + 1"),
    (r"\boxed{}", ""),
    (r"\boxed{1 + {2}", None),  # never closes
    ("no box here", None),
    (r"\boxed", None),
    (None, None),
    (42, None),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


def reference_extract_boxed(text):
    """extract_boxed's rule with no cap, one character at a time: after the last \\boxed or
    \\fbox and any spaces, the content of a balanced {...}, or (after at least one space) the next
    token up to a space or a $. Returns (answer or None, the number of spaces skipped)."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None, 0
    i = j = start + (6 if text.startswith("\\boxed", start) else 5)
    while j < len(text) and text[j].isspace():
        j += 1
    if j < len(text) and text[j] == "{":
        depth = 0
        for k in range(j, len(text)):
            depth += {"{": 1, "}": -1}.get(text[k], 0)
            if depth == 0:
                return text[j + 1 : k], j - i
        return None, j - i
    k = j
    while k < len(text) and not text[k].isspace() and text[k] != "$":
        k += 1
    return (text[j:k] if j > i and k > j else None), j - i


def random_box(rng):
    """Text around a last box whose answer is near MAX_ANSWER_CHARS long: braces, spaces, $,
    letters; balanced or not."""
    cap = reward.MAX_ANSWER_CHARS
    pieces = ["{", "}", " ", "x", "$", "\\frac", "\n"]
    body = "".join(rng.choice(pieces) for _ in range(rng.choice([rng.randrange(20),
                                                                 rng.randrange(cap - 60, cap + 60),
                                                                 rng.randrange(2 * cap)])))
    spaces = " " * rng.choice([0, 0, 1, 3, rng.randrange(cap + 100 - 5, cap + 100 + 5)])
    if rng.random() < 0.6:
        body = "{" + body + "}" * rng.randrange(1, 40)
    else:  # a bare token
        body = "".join(rng.choice("x5,.") for _ in range(rng.randrange(cap - 5, cap + 5))) \
            + rng.choice(["", " ", "$", "x"])
    return rng.choice(["", "so ", r"\boxed{1} then "]) + rng.choice(["\\boxed", "\\fbox"]) \
        + spaces + body + rng.choice(["", " and so on.", "}}}}"])


def test_extract_boxed_within_its_cap_matches_the_uncapped_rule():
    """An answer of at most MAX_ANSWER_CHARS after fewer than MAX_ANSWER_CHARS + 100 spaces is
    found as with no cap at all; a longer one is None (too long to grade), never a part of it."""
    import random

    rng, cap = random.Random(0), reward.MAX_ANSWER_CHARS
    counts = {"within": 0, "beyond": 0}
    for _ in range(3000):
        text = random_box(rng)
        answer, spaces = reference_extract_boxed(text)
        within = answer is not None and len(answer) <= cap and spaces < cap + 100
        counts["within" if within else "beyond"] += 1
        assert extract_boxed(text) == (answer if within else None), text
    assert min(counts.values()) > 500, counts  # both sides of the cap are tried


def steps_and_characters_read(text):
    """The lines extract_boxed runs and the characters it slices out of `text`."""
    read = [0]

    class CountingText(str):
        def __getitem__(self, key):
            part = str.__getitem__(self, key)
            read[0] += len(part)
            return part

    steps = 0

    def trace(frame, event, arg):
        nonlocal steps
        if frame.f_code is not extract_boxed.__code__:
            return None
        steps += event == "line"
        return trace

    sys.settrace(trace)
    try:
        extract_boxed(CountingText(text))
    finally:
        sys.settrace(None)
    return steps, read[0]


@pytest.mark.parametrize("text", [
    pytest.param("\\boxed" + "{" * 200_000, id="open-braces"),  # opens and never closes
    pytest.param("\\boxed{" + "x{" * 100_000, id="x-open-braces"),
    pytest.param("\\fbox{" + "{}" * 100_000, id="brace-pairs"),
    pytest.param("\\boxed{" + "x" * 200_000 + "}", id="long-answer"),
    pytest.param("\\boxed " + "5" * 200_000, id="long-token"),
    pytest.param("\\boxed" + " " * 200_000 + "{5}", id="long-spaces"),
])
def test_extract_boxed_stops_at_its_cap(text):
    """Past the last box's name it reads at most MAX_ANSWER_CHARS + 100 characters of spaces and
    MAX_ANSWER_CHARS + 2 of answer, and steps through no more than that, however long the text."""
    steps, read = steps_and_characters_read(text)
    assert read <= 2 * reward.MAX_ANSWER_CHARS + 102, read
    assert steps <= 3 * reward.MAX_ANSWER_CHARS + 30, steps
    assert extract_boxed(text) is None


# ---- math_reward on real MATH500 answers ---------------------------------------------------------

def test_math500_gold_answers_are_correct_and_other_rows_are_not():
    answers = math500_answers()
    start = time.monotonic()
    wrong = [a for a in answers if math_reward(f"The final answer is $\\boxed{{{a}}}$.", a) != 1.0]
    assert wrong == []
    # Each row against the next row's gold answer. A few rows share an answer: the same string, or
    # ("5", "x=5"), which math-verify rightly calls equal. Those, and only those, may score 1.
    coincide = {("5", "x=5")}
    accepted = []
    for answer, other in zip(answers, answers[1:] + answers[:1]):
        if math_reward(f"\\boxed{{{other}}}", answer) == 1.0:
            accepted.append((answer, other))
    assert all(a == b or (a, b) in coincide for a, b in accepted), accepted
    assert sum(a != b for a, b in accepted) <= len(coincide)
    print(f"\n1,000 MATH500 checks in {time.monotonic() - start:.1f} s")


# ---- MATH-style equivalences (gold, prediction) --------------------------------------------------

EQUIVALENT = [
    (r"\frac{1}{2}", "0.5"), (r"\dfrac{1}{2}", r"\frac12"), (r"\frac{3}{4}", "3/4"),
    (r"\frac{7}{2}", "3.5"),
    ("0.25", r"\frac{1}{4}"), ("10^{-3}", "0.001"), ("5", "5.0"),
    (r"-\frac{1}{3}", r"\frac{-1}{3}"),
    ("3", "x = 3"), ("x=3", "3"), ("y = 2x + 3", "2x+3"), ("y=2x+3", "y = 3 + 2x"),
    (r"50\%", "50"), ("50", r"50\%"), (r"30^\circ", "30"), ("30", r"30^{\circ}"),
    (r"90^\circ", "90"),
    (r"10\text{ cm}", "10"), ("10", r"10 \text{ cm}"), (r"\$18.90", "18.90"), ("18.90", r"\$18.90"),
    ("1000", "1,000"), ("1,000", "1000"),
    ("(1, 2)", "(1,2)"), (r"\left( 3, \frac{\pi}{2} \right)", r"(3,\frac{\pi}{2})"),
    ("[-2, 3)", "[-2,3)"), (r"(-\infty, 3]", r"(-\infty,3]"),
    (r"\{1, 2, 3\}", r"\{3, 2, 1\}"), ("2, 3", "3, 2"),
    (r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"\begin{pmatrix}1\\2\end{pmatrix}"),
    (r"\begin{pmatrix} 1/2 \\ 2 \end{pmatrix}", r"\begin{pmatrix}\frac{1}{2}\\2\end{pmatrix}"),
    (r"\frac{\sqrt{2}}{2}", r"\sqrt{2}/2"), (r"2\sqrt{3}", r"\sqrt{12}"), (r"\sqrt{2}", "2^{1/2}"),
    (r"\frac{\pi}{2}", r"\pi/2"), ("(x+1)^2", "x^2+2x+1"), (r"1\frac{1}{2}", r"\frac{3}{2}"),
    (r"\text{Monday}", "Monday"), (r"\text{(C)}", "C"),
]
NOT_EQUIVALENT = [
    (r"\frac12", "0.51"), ("3", "4"), ("-5", "5"), ("1000", "100"), ("12", "1,2"),
    (r"\frac{1}{3}", "0.33"),
    (r"\sqrt{2}", "1.41"), (r"2\pi", "6.28"), (r"\pi", "3.14"), (r"\sqrt{3}", "3"),
    (r"3\sqrt{2}", r"2\sqrt{3}"),
    ("(1,2)", "(2,1)"), ("[1,2]", "(1,2)"), (r"(-\infty, 3]", r"(-\infty, 3)"),
    (r"\{1,2\}", r"\{1,2,3\}"),
    ("2, 3", "2"), ("2,3", "2, 3, 4"), ("x^2", "x^3"), ("x=3", "x=4"), ("y=2x+3", "y=3x+2"),
    (r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"\begin{pmatrix}2\\1\end{pmatrix}"),
    (r"\frac{\pi}{2}", r"\frac{\pi}{3}"), (r"\infty", r"-\infty"), ("0", r"\emptyset"),
    (r"\text{Monday}", r"\text{Tuesday}"), ("C", "D"), ("5", ""), ("5", "x"), ("5", r"\frac{1}{0}"),
]


def test_equivalence_pairs():
    assert len(EQUIVALENT) + len(NOT_EQUIVALENT) >= 40
    judged_wrong = [(gold, pred) for gold, pred in EQUIVALENT
                    if math_reward(f"\\boxed{{{pred}}}", gold) != 1.0]
    judged_wrong += [(gold, pred) for gold, pred in NOT_EQUIVALENT
                     if math_reward(f"\\boxed{{{pred}}}", gold) != 0.0]
    assert judged_wrong == []


def test_math_reward_needs_a_box():
    assert math_reward("The answer is 5.", "5") == 0.0
    assert math_reward(r"\boxed{4} no wait, \boxed{5}", "5") == 1.0
    assert math_reward(r"\boxed{5} no wait, \boxed{4}", "5") == 0.0


# ---- hostile completions: 0.0, quickly, nothing executed -----------------------------------------

HOSTILE = [
    None, 12345, "x" * 1_000_000, r"\boxed{" * 20_000, "{" * 20_000,
    r"\boxed{" + "{" * 20_000 + "5",
    r"\boxed{\frac{1}{0}}", r"\boxed{10^{10^{10}}}", r"\boxed{9^{9^{9^{9}}}}",
    r"\boxed{(10^{10})!}",
    r"\boxed{__import__('os').system('touch /tmp/pwned_reward')}", "\\boxed{" + "1" * 100_000 + "}",
    r"\boxed{" + "(" * 300 + "1" + ")" * 300 + "}", r"\boxed{" + "(" * 150 + "1" + ")" * 150 + "}",
    "\\boxed{\x00\udcff}", "<answer>" * 100_000, "<answer>1</answer>" * 50_000,
]
# generous: a hang check; the CPU budget is reward.TIMEOUT_S (1 s)
BOUND_S = reward.WALL_TIMEOUT_S + 5


def check_hostile(reward_fn):
    for text in HOSTILE:
        start = time.monotonic()
        assert reward_fn(text) == 0.0, repr(text)[:80]
        assert time.monotonic() - start < BOUND_S, (
            f"{repr(text)[:80]} took {time.monotonic() - start:.1f} s")


def test_hostile_math():
    check_hostile(lambda text: math_reward(text, "5"))
    assert not Path("/tmp/pwned_reward").exists()
    assert math_reward(r"\boxed{5}", "5") == 1.0  # and the reward still works afterwards


def test_hostile_math_off_the_main_thread():
    errors = []

    def worker():
        try:
            check_hostile(lambda text: math_reward(text, "5"))
            assert math_reward(r"\boxed{0.5}", r"\frac{1}{2}") == 1.0
        except BaseException as error:  # noqa: BLE001 - report it in the main thread
            errors.append(error)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert errors == []


def test_wall_timeout_scores_zero_and_replaces_the_helper(monkeypatch):
    """A helper that never answers (stopped by SIGSTOP: stuck where its CPU timer cannot reach it,
    so only the wall-clock backstop can): the reward is 0 after WALL_TIMEOUT_S, that helper is
    killed, and the next call gets a fresh helper and the right answer."""
    assert math_reward(r"\boxed{5}", "5") == 1.0  # this thread's helper, started and ready
    stuck = reward._local.proc
    os.kill(stuck.pid, signal.SIGSTOP)
    try:
        with monkeypatch.context() as patch:
            patch.setattr(reward, "WALL_TIMEOUT_S", 0.5)
            assert math_reward(r"\boxed{5}", "5") == 0.0  # a timeout is no reward, never 1
        assert stuck.poll() is not None, "the stuck helper was left running"
    finally:
        if stuck.poll() is None:
            stuck.kill()
    assert math_reward(r"\boxed{5}", "5") == 1.0
    assert reward._local.proc is not stuck


def test_hostile_choice_and_countdown():
    check_hostile(lambda text: choice_reward(text, "A"))
    check_hostile(lambda text: countdown_reward(text, [1, 2, 3], 6))
    assert math_reward(r"\boxed{5}", None) == 0.0


# ---- multiple choice -----------------------------------------------------------------------------

@pytest.mark.parametrize("completion, score", [
    (r"\boxed{B}", 1.0), (r"\boxed{(B)}", 1.0), (r"\boxed{\text{B}}", 1.0),
    (r"\boxed{\textbf{(B)}}", 1.0),
    (r"\boxed{B) 550 nm}", 1.0), (r"\boxed{ B. 550 nm }", 1.0),
    (r"\boxed{A} hmm, no: \boxed{B}", 1.0),
    (r"\boxed{A}", 0.0), (r"\boxed{BC}", 0.0), (r"\boxed{550 nm}", 0.0), ("The answer is B.", 0.0),
    (r"\boxed{b}", 0.0), (r"\boxed{B} hmm, no: \boxed{C}", 0.0),
])
def test_choice_reward(completion, score):
    assert choice_reward(completion, "B") == score
    assert choice_reward(completion, 1) == score  # an index is the same letter


# ---- countdown -----------------------------------------------------------------------------------

@pytest.mark.parametrize("completion, score", [
    ("<answer>(25 - 5) * 3 + 4</answer>", 1.0),
    (r"so \boxed{4 + 3 * (25 - 5)}", 1.0),
    (r"\boxed{(25 - 5) \times 3 + 4}", 1.0),
    ("<answer>3 * (25 - 5) + 4 = 64</answer>", 1.0),  # the stated value is ignored
    ("<answer>1 + 1</answer> ... <answer>(25 - 5) * 3 + 4</answer>", 1.0),  # the last answer tag
    ("<answer>(25 - 5) * 3 + 4</answer> \\boxed{1}", 1.0),  # the tag wins over a box
    ("<answer>(25 - 5) * 3 + 5</answer>", 0.0),  # 5 used twice, 4 not at all
    ("<answer>25 * 3 - 5 - 4</answer>", 0.0),  # 66
    ("<answer>(25 - 5) * 3</answer>", 0.0),  # 4 missing
    ("<answer>(25 - 5) * 3 + 4 + 4</answer>", 0.0),  # 4 reused
    ("<answer>(25 - 5) * 3 + 4 + 0</answer>", 0.0),  # an extra number
    ("<answer>(25 - 5) * 3 + 4.0</answer>", 0.0),  # integers only
    ("<answer>(25 - 5) ** 1 * 3 + 4</answer>", 0.0),  # no powers
    ("<answer>(25 // 5) * 3 + 4</answer>", 0.0),
    ("<answer>__import__('os')</answer>", 0.0),
    ("<answer>25 / (5 - 5) * 3 + 4</answer>", 0.0),
    ("<answer>(25 - 5) * 3 + 4", 0.0),  # unclosed tag, no box
    ("64", 0.0),
])
def test_countdown_reward(completion, score):
    assert countdown_reward(completion, [25, 5, 3, 4], 64) == score


def test_countdown_reward_exact_division():
    assert countdown_reward(r"\boxed{6 / 4 * 2}", [6, 4, 2], 3) == 1.0  # 1.5 * 2, exact
    assert countdown_reward(r"\boxed{(7 + 1) / 3}", [7, 1, 3], 3) == 0.0  # 8/3 is not 3
    assert countdown_reward(r"\boxed{-(2 - 7) * 20}", [2, 7, 20], 100) == 1.0
    assert countdown_reward(r"\boxed{9999999999 * 9999999999}", [1, 2], 3) == 0.0
