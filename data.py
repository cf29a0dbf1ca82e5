"""Tasks: prompts x with their verifiable answers y* (sec. 4 of the paper: MATH for training;
MATH500, MATH^2 and MMLU college physics / chemistry / biology for evaluation; Countdown for the
asynchronous runs).

`load_task(name)` returns a list of examples, each a dict with
  messages  chat messages, the last one the user's question (with the instruction below)
  answer    the gold answer y* (a LaTeX string, a letter A-D, or a countdown expression)
  reward    which reward.py function scores it: "math", "choice" or "countdown"
  problem   the question text (for logs), plus task fields: level, subject, choices, numbers,
            target.

Hub tasks load with the `datasets` library; offline they fail at once and name the local-file route:
any .jsonl path is a task too ({problem, answer} rows: math reward; {question, choices, answer}:
choice). `arith` and `countdown` are generated from a seed, offline; `train` and `test` never share
a problem.
"""
import json
import math
import random
import re
import sys
import zlib

import numpy as np

from systems.hub import require_hub
from reward import choice_reward, countdown_reward, extract_boxed, math_reward

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
TASKS = ("math", "math500", "math2", "mmlu-college-physics", "mmlu-college-chemistry",
         "mmlu-college-biology", "countdown", "arith")
MATH_SUBJECTS = ("algebra", "counting_and_probability", "geometry", "intermediate_algebra",
                 "number_theory", "prealgebra", "precalculus")
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
# problems generated when no limit is given (arith test: 185)
PROCEDURAL_SIZE = {"train": 10_000, "test": 500}


def load_task(name, split="train", limit=None, seed=0):
    """Examples of task `name` (one of TASKS, or a path to a .jsonl file); `limit` keeps a
    seeded subset."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got '{split}'")
    if name == "arith":
        return arith(split, limit or PROCEDURAL_SIZE[split], seed)
    if name == "countdown":
        return countdown(split, limit or PROCEDURAL_SIZE[split], seed)
    if name.endswith(".jsonl"):
        examples = read_jsonl(name)
    elif name == "math":
        # Hendrycks MATH: 7,500 train / 5,000 test problems, gold = last box of the solution
        alternative = ("pass a local .jsonl of {problem, answer} rows instead "
                       "(e.g. ../shared/data/math_train.jsonl)")
        rows = [row for subject in MATH_SUBJECTS
                for row in hub_rows("EleutherAI/hendrycks_math", subject, split, alternative)]
        examples = [to_example({"problem": row["problem"], "answer": extract_boxed(row["solution"]),
                                "level": row["level"], "subject": row["type"]},
                               "EleutherAI/hendrycks_math")
                    for row in rows if extract_boxed(row["solution"])]
    elif name == "math500":  # one split only (test), whatever `split` says
        alternative = ("pass a local .jsonl of {problem, answer} rows instead "
                       "(e.g. ../shared/data/math500.jsonl)")
        rows = hub_rows("HuggingFaceH4/MATH-500", None, "test", alternative)
        examples = [to_example(row, "HuggingFaceH4/MATH-500") for row in rows]
    elif name == "math2":  # MATH^2 (Shah et al. 2024), 210 problems, one csv
        alternative = "pass a local .jsonl of {problem, answer} rows instead"
        examples = [to_example(math2_row(row), "veds12/math-squared")
                    for row in hub_rows("veds12/math-squared", None, "train", alternative)]
    elif name.startswith("mmlu-") and name in TASKS:  # MMLU test split, choices rendered A-D
        subject = name.removeprefix("mmlu-").replace("-", "_")
        alternative = (f"pass a local .jsonl of {{question, choices, answer}} rows instead "
                       f"(e.g. ../shared/data/mmlu_{subject}.jsonl)")
        rows = hub_rows("cais/mmlu", subject, "test", alternative)
        examples = [to_example(row, f"cais/mmlu {subject}") for row in rows]
    else:
        raise ValueError(f"unknown task '{name}': choose from {', '.join(TASKS)}, "
                         "or a path to a .jsonl file")
    if limit is not None and limit < len(examples):  # a seeded subset, kept in the original order
        examples = [examples[i]
                    for i in sorted(random.Random(seed).sample(range(len(examples)), limit))]
    return examples


def prompt_batch(examples, start, count, seed):
    """Examples start, ..., start + count - 1 of an endless stream: the task reshuffled (seeded)
    every epoch."""
    n, positions = len(examples), range(start, start + count)
    orders = {epoch: np.random.default_rng([seed, epoch]).permutation(n)
              for epoch in {p // n for p in positions}}
    return [examples[orders[p // n][p % n]] for p in positions]


def prompt_ids(tokenizer, example, chat_template=True):
    """Prompt token ids: the chat template with its generation prompt, or a plain
    "Question/Answer" text."""
    if chat_template:
        text = tokenizer.apply_chat_template(example["messages"], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    turns = [f"Question: {m['content']}\nAnswer:" if m["role"] == "user" else f" {m['content']}\n\n"
             for m in example["messages"] if m["role"] in ("user", "assistant")]
    return tokenizer("".join(turns))["input_ids"]


def score(example, completion):
    """The reward of `completion` for `example`, 0.0 or 1.0
    (eq. in sec. 2: R = 1[Extract(y) = y*])."""
    if example["reward"] == "math":
        return math_reward(completion, example["answer"])
    if example["reward"] == "choice":
        return choice_reward(completion, example["answer"])
    if example["reward"] == "countdown":
        return countdown_reward(completion, example["numbers"], example["target"])
    raise ValueError(f"example has reward '{example['reward']}'; "
                     "expected one of math, choice, countdown")


# ---- rows -> examples ----------------------------------------------------------------------------

def hub_rows(path, config, split, alternative):
    """Rows (dicts) of a hub dataset; offline: HubUnreachable at once, naming `alternative`."""
    require_hub(path, alternative)
    from datasets import load_dataset  # only here: offline use needs no `datasets`

    return list(load_dataset(path, config, split=split))


def math2_row(row):
    """MATH^2's csv columns are not documented; take the usual names and say which ones exist
    if none fit."""
    problem = next((row[k] for k in ("problem", "question", "Problem", "Question")
                    if row.get(k)), None)
    answer = next((row[k] for k in ("answer", "Answer", "final_answer")
                   if row.get(k) not in (None, "")), None)
    if answer is None and row.get("solution"):
        answer = extract_boxed(row["solution"])
    if problem is None or answer is None:
        raise ValueError(f"veds12/math-squared: no problem/answer columns among {sorted(row)}")
    return {"problem": problem, "answer": answer}


def read_jsonl(path):
    """Examples from a local .jsonl file, UTF-8 (a byte-order mark may start it); a malformed row
    raises ValueError naming the file and line. A problem whose answer is an empty string has
    nothing to grade it by: it is skipped, and a line on stderr names it (as the hub's MATH skips
    solutions without a box; the offline MATH-train file has two such rows)."""
    examples, ungraded = [], []
    # bytes that are not UTF-8 are kept as lone surrogates, so that the line holding them is named
    with open(path, encoding="utf-8-sig", errors="surrogateescape") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = parse_line(line, f"{path}:{lineno}")
            if isinstance(row, dict) and "problem" in row and row.get("answer") == "":
                ungraded.append(lineno)
                continue
            examples.append(to_example(row, f"{path}:{lineno}"))
    if ungraded:
        print(f"{path}: skipped {len(ungraded)} row(s) with an empty answer, line(s) "
              f"{', '.join(map(str, ungraded[:10]))}{' ...' if len(ungraded) > 10 else ''}",
              file=sys.stderr)
    if not examples:
        raise ValueError(f"{path}: no gradable rows")
    return examples


def parse_line(line, where):
    """One line of a .jsonl file (read with errors="surrogateescape") as JSON, or a ValueError
    naming `where` and what is wrong."""
    if "\x00" in line:  # never in JSON text, but after every ASCII character in UTF-16 or UTF-32
        raise ValueError(f"{where}: not UTF-8 (NUL bytes: UTF-16 or UTF-32 text?); "
                         "save the file as UTF-8")
    try:
        line.encode("utf-8")
    except UnicodeEncodeError as error:  # a byte kept as a lone surrogate: e.g. Latin-1's é
        byte = ord(line[error.start]) - 0xDC00
        raise ValueError(f"{where}: not UTF-8 (byte 0x{byte:02x} at column {error.start + 1}); "
                         "save the file as UTF-8") from None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not valid JSON ({error.msg})") from None
    except RecursionError:
        raise ValueError(f"{where}: nested too deeply for Python's json to read") from None
    except ValueError as error:  # an integer of more digits than Python converts (4300)
        raise ValueError(f"{where}: a number too long to read "
                         f"({str(error).split(';')[0]})") from None
    # a \u escape of half a UTF-16 surrogate pair decodes to no text (a tokenizer refuses it)
    if re.search(r"\\u[dD][89a-fA-F]", line):  # a surrogate's escape: is it one of a pair?
        try:
            json.dumps(row, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as error:
            surrogate = ord(error.object[error.start])
            raise ValueError(f"{where}: not text (a lone surrogate \\u{surrogate:04x}, half of a "
                             "UTF-16 pair, from a \\u escape)") from None
    return row


def to_example(row, where):
    """A {problem, answer} row (math reward) or a {question, choices, answer} row
    (choice reward)."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    extra = {k: row[k] for k in ("level", "subject") if k in row}
    if "problem" in row and "answer" in row:
        problem, answer = row["problem"], row["answer"]
        if not isinstance(problem, str) or not problem.strip():
            raise ValueError(f"{where}: 'problem' must be a non-empty string")
        # NaN or infinity as the gold answer would be the string "nan" or "inf": \boxed{nan} matches
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) \
                or isinstance(answer, float) and not math.isfinite(answer) \
                or not str(answer).strip():
            raise ValueError(f"{where}: 'answer' must be a non-empty string or a finite number, "
                             f"got {answer!r}")
        return math_example(problem, str(answer), **extra)
    if {"question", "choices", "answer"} <= row.keys():
        question, choices, answer = row["question"], row["choices"], row["answer"]
        if not isinstance(question, str) or not isinstance(choices, list) \
                or not 2 <= len(choices) <= 26 or not all(isinstance(c, str) for c in choices):
            raise ValueError(f"{where}: 'question' must be a string and 'choices' a list of "
                             "2-26 strings")
        letters = LETTERS[: len(choices)]
        if isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer < len(choices):
            answer = letters[answer]
        if not (isinstance(answer, str) and len(answer) == 1 and answer in letters):
            raise ValueError(f"{where}: 'answer' must be an index 0-{len(choices) - 1} or a letter "
                             f"{letters}, got {row['answer']!r}")
        return choice_example(question, choices, answer, **extra)
    raise ValueError(f"{where}: expected keys {{problem, answer}} or "
                     f"{{question, choices, answer}}, got {sorted(row)}")


def math_example(problem, answer, **fields):
    messages = [{"role": "user", "content": f"{problem}\n\n{INSTRUCTION}"}]
    return {"messages": messages, "answer": answer, "reward": "math", "problem": problem, **fields}


def choice_example(question, choices, answer, **fields):
    options = "\n".join(f"{letter}. {choice}" for letter, choice in zip(LETTERS, choices))
    content = (f"{question}\n\n{options}\n\n{INSTRUCTION} "
               f"The final answer is the letter ({', '.join(LETTERS[:len(choices)])}) "
               "of the correct choice.")
    messages = [{"role": "user", "content": content}]
    return {"messages": messages, "answer": answer, "reward": "choice", "problem": question,
            "choices": choices, **fields}


# ---- procedural tasks ----------------------------------------------------------------------------

def in_split(key, split):
    """A fixed partition of the problem space (1 problem in 5 is a test problem), the same for
    every seed."""
    return (zlib.crc32(key.encode()) % 5 == 0) == (split == "test")


def arith(split, count, seed):
    """Additions a + b with a, b in 1..30: the embedded default task, on which SmolLM2-135M-Instruct
    starts near 45% both greedy and at temperature 1.0 (docs/tasks.md). Two worked examples in the
    chat show where the box goes and keep the answer short.
    The 898 problems split 713 train / 185 test; train repeats them in a seeded order, test gives
    each once."""
    shots = []
    for a, b in ((13, 5), (7, 26)):
        shots += [{"role": "user", "content": f"What is {a} + {b}? {INSTRUCTION}"},
                  {"role": "assistant",
                   "content": f"{a} + {b} = {a + b}. The final answer is \\boxed{{{a + b}}}."}]
    pairs = [(a, b) for a in range(1, 31) for b in range(1, 31)
             if (a, b) not in ((13, 5), (7, 26)) and in_split(f"What is {a} + {b}?", split)]
    random.Random(f"arith-{seed}").shuffle(pairs)
    if split == "test":
        count = min(count, len(pairs))
    examples = []
    for a, b in (pairs[i % len(pairs)] for i in range(count)):
        problem = f"What is {a} + {b}?"
        messages = shots + [{"role": "user", "content": f"{problem} {INSTRUCTION}"}]
        examples.append({"messages": messages, "answer": str(a + b), "reward": "math",
                         "problem": problem})
    return examples


def countdown(split, count, seed):
    """`count` Countdown problems in reasoning-gym's style (its defaults: 4-6 numbers; here 3-4):
    numbers in 1..100 and a target in 100..999 reached by combining all of them with + - * / (every
    intermediate a non-negative integer); `answer` is that expression, one solution among possibly
    many."""
    rng = random.Random(f"countdown-{split}-{seed}")
    examples = []
    while len(examples) < count:
        numbers = [rng.randint(1, 100) for _ in range(rng.choice((3, 4)))]
        # (value, expression) pairs, combined until one is left
        terms = [(n, str(n)) for n in numbers]
        while len(terms) > 1:
            (x, ex), (y, ey) = (terms.pop(rng.randrange(len(terms))),
                                terms.pop(rng.randrange(len(terms))))
            op = rng.choice("+-*/")
            if op == "-" and x < y or op == "/" and (y == 0 or x % y):
                op = "+"
            value = x + y if op == "+" else x - y if op == "-" else x * y if op == "*" else x // y
            terms.append((value, f"({ex} {op} {ey})"))
        target, expression = terms[0][0], terms[0][1][1:-1]
        problem = (f"Using the numbers {numbers}, create an expression that equals {target}. "
                   f"Use each number exactly once, with only + - * / and parentheses.")
        if not 100 <= target <= 999 or not in_split(problem, split):
            continue
        content = (f"{problem} {INSTRUCTION} Put the expression itself in the box, "
                   "e.g. \\boxed{(1 + 2) * 3}.")
        examples.append({"messages": [{"role": "user", "content": content}], "answer": expression,
                         "reward": "countdown", "problem": problem, "numbers": numbers,
                         "target": target})
    return examples
