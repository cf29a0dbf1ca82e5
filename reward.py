"""Verifiable rewards (sec. 2): R(y, y*) = 1[Extract(y) = y*], Extract = the last \\boxed{} of y.

- `math_reward`: equivalence of the boxed answer with the gold answer is decided by Hugging Face's
  `math-verify` (both sides parsed as LaTeX, then `verify`), so 1/2 = 0.5 = \\dfrac{1}{2},
  x = 3 = 3, 10\\text{ cm} = 10, [1, 2) != (1, 2], {1, 2} = {2, 1}, (1, 2) != (2, 1).
- `choice_reward`: multiple choice (MMLU), the boxed letter, also written (B) or \\text{B}.
- `countdown_reward`: an arithmetic expression over the given numbers, parsed with `ast`
  (never eval'd).

No reward raises or hangs, whatever the policy writes. Sympy can spin for minutes on 10^{10^{10}},
and math-verify's own timeout is a SIGALRM that only works in the main thread, so the sympy work
runs in a small helper process (`python reward.py --serve`, one per calling thread). It gives each
comparison `TIMEOUT_S` seconds of CPU time, and is killed and replaced if an answer takes
`WALL_TIMEOUT_S`.
"""
import ast
import atexit
import json
import os
import re
import select
import subprocess
import sys
import threading
from fractions import Fraction
from importlib.util import find_spec

if find_spec("math_verify") is None:  # fail at import, not as a silent reward of 0 on every answer
    raise ImportError("reward.py needs math-verify: pip install math-verify")

# CPU seconds for one math-verify comparison (the slowest of 1,000 on MATH500: 0.14 s)
TIMEOUT_S = 1.0
# backstop: the helper is killed when an answer takes this long in wall-clock time
WALL_TIMEOUT_S = 10.0
MAX_ANSWER_CHARS = 400  # longest boxed answer we hand to sympy (MATH's longest gold answer: 159)
MAX_EXPRESSION_CHARS = 200  # longest countdown expression we parse


def extract_boxed(text):
    """Content of the last \\boxed{...} or \\fbox{...} (balanced braces), or of `\\boxed 5`;
    None if none, or if it is longer than MAX_ANSWER_CHARS (too long to grade). Past the box's name
    it reads at most MAX_ANSWER_CHARS + 100 characters of spaces and MAX_ANSWER_CHARS + 2 of answer,
    however long the text."""
    if not isinstance(text, str):
        return None
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (6 if text.startswith("\\boxed", start) else 5)
    after = text[i : i + MAX_ANSWER_CHARS + 100]
    spaces = len(after) - len(after.lstrip())
    if spaces == len(after):  # nothing but spaces (or nothing) follows within reach
        return None
    # the answer: a token or a {...} of up to MAX_ANSWER_CHARS, and the character after it
    answer = text[i + spaces : i + spaces + MAX_ANSWER_CHARS + 2]
    if not answer.startswith("{"):  # `\boxed 5`: the next token, up to a space or a $
        token = re.match(r"[^\s$]*", answer).group()
        return token if token and spaces and len(token) <= MAX_ANSWER_CHARS else None
    depth = 0
    for brace in re.finditer(r"[{}]", answer):
        depth += 1 if brace.group() == "{" else -1
        if depth == 0:
            return answer[1 : brace.start()]
    return None  # unbalanced, or longer than MAX_ANSWER_CHARS


# ---- math (math-verify) --------------------------------------------------------------------------

def math_reward(completion, answer):
    """1.0 when the last boxed answer of `completion` equals `answer` per math-verify, else 0.0
    (also when the comparison runs out of its TIMEOUT_S CPU seconds)."""
    prediction = extract_boxed(completion)
    if prediction is None or len(prediction) > MAX_ANSWER_CHARS or answer is None \
            or not str(answer).strip():
        return 0.0
    # raises only when math-verify cannot start at all: a broken install, not an answer
    proc = _helper()
    try:
        proc.stdin.write(json.dumps([str(answer), prediction]) + "\n")
        proc.stdin.flush()
        return 1.0 if _readline(proc, WALL_TIMEOUT_S) == "1" else 0.0
    except Exception:
        # a dead helper, a broken pipe: no reward, and the next call starts a fresh helper
        return 0.0


# ---- multiple choice -----------------------------------------------------------------------------

def choice_reward(completion, answer):
    """1.0 when the last box holds the letter `answer` ("B", or index 1): B, (B), \\text{B},
    "B) text"."""
    try:
        letter = ("ABCDEFGHIJKLMNOPQRSTUVWXYZ"[answer] if isinstance(answer, int)
                  else str(answer).strip())
        boxed = extract_boxed(completion)
        if boxed is None:
            return 0.0
        boxed = re.sub(r"\\(?:text|textbf|mathrm|mathbf)\s*\{([^{}]*)\}", r"\1",
                       boxed[:MAX_ANSWER_CHARS])
        match = re.match(r"\s*\(?([A-Z])\)?(?=$|[\s.:)])", boxed)
        return 1.0 if match is not None and match.group(1) == letter else 0.0
    except Exception:
        return 0.0


# ---- countdown -----------------------------------------------------------------------------------

_ALLOWED = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Add, ast.Sub, ast.Mult,
            ast.Div, ast.USub)


def _value(node):
    """Exact value of a whitelisted arithmetic tree (Fractions, so 6 / 4 * 2 == 3 exactly)."""
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp):
        return -_value(node.operand)
    left, right = _value(node.left), _value(node.right)
    if isinstance(node.op, ast.Add):
        return left + right
    if isinstance(node.op, ast.Sub):
        return left - right
    if isinstance(node.op, ast.Mult):
        return left * right
    return left / right  # ZeroDivisionError is caught by the caller


def countdown_reward(completion, numbers, target):
    """1.0 when the expression in the last <answer>...</answer> (else the last box) uses each of
    `numbers` exactly once, only integers and + - * / ( ), and equals `target`; else 0.0."""
    try:
        if not isinstance(completion, str):
            return 0.0
        close = completion.rfind("</answer>")
        start = completion.rfind("<answer>", 0, max(close, 0))
        expression = completion[start + 8 : close] if start >= 0 else extract_boxed(completion)
        if expression is None:
            return 0.0
        expression = expression.replace("\\times", "*").replace("\\cdot", "*").replace("\\div", "/")
        # "25 + 3 * 5 = 40" states its value; keep the left side
        expression = expression.split("=")[0]
        if len(expression) > MAX_EXPRESSION_CHARS \
                or not re.fullmatch(r"[\d\s+\-*/()]+", expression):
            return 0.0  # also rules out names, calls, attributes, strings before ast sees them
        tree = ast.parse(expression.strip(), mode="eval")
        nodes = list(ast.walk(tree))
        if not all(isinstance(node, _ALLOWED) for node in nodes):
            return 0.0  # e.g. ** or // (Pow, FloorDiv)
        used = sorted(node.value for node in nodes if isinstance(node, ast.Constant))
        if not all(type(v) is int for v in used) or used != sorted(int(n) for n in numbers):
            return 0.0  # every number exactly once; this also bounds the size of what we compute
        return 1.0 if _value(tree.body) == Fraction(target) else 0.0
    except Exception:  # SyntaxError, ZeroDivisionError, RecursionError, ...
        return 0.0


# ---- the math-verify helper process: math_reward's sympy work, bounded in time ----------------

WARM_UP = [("1", "1"), (r"\frac{1}{2}", "0.5"), ("x = 3", "3"), ("(x+1)^2", "x^2+2x+1"),
           (r"\left[ \frac{\pi^2}{8}, \frac{5 \pi^2}{4} \right]", r"[\pi^2/8, 5\pi^2/4]"),
           (r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}"),
           (r"\{1, 2\}", r"\{2, 1\}"), (r"10\text{ cm}", "10")]  # sympy's first use of each is slow


def _equivalent(answer, prediction):
    """math-verify's judgement: both sides wrapped in \\boxed{} and parsed as LaTeX
    (runs in the helper)."""
    from math_verify import LatexExtractionConfig, parse, verify

    config = [LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)]
    # math-verify's own SIGALRM timeouts off: the helper's CPU timer (see _serve) bounds the call
    # instead.
    gold = parse("\\boxed{" + answer + "}", extraction_config=config, parsing_timeout=None)
    pred = parse("\\boxed{" + prediction + "}", extraction_config=config, parsing_timeout=None)
    return bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=None)


def _serve():
    """Helper-process loop: read [answer, prediction] JSON lines on stdin, answer "1" or "0" per
    line. Each query gets TIMEOUT_S seconds of CPU time (a SIGPROF timer, so a busy machine does not
    cut short a slow but honest comparison); math-verify turns the TimeoutException into
    "not equal"."""
    import logging
    import signal

    from math_verify.errors import TimeoutException

    def out_of_time(signum, frame):
        raise TimeoutException("reward.py: out of CPU time")

    # math-verify logs every timeout and warns that its own are off
    logging.disable(logging.CRITICAL)
    signal.signal(signal.SIGPROF, out_of_time)
    for answer, prediction in WARM_UP:  # import and exercise sympy before saying we are ready
        _equivalent(answer, prediction)
    print("ready", flush=True)
    for line in sys.stdin:
        try:
            signal.setitimer(signal.ITIMER_PROF, TIMEOUT_S)
            ok = _equivalent(*json.loads(line))
        except BaseException:  # noqa: BLE001 - TimeoutException, RecursionError, MemoryError, ...
            ok = False
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0)
        print(int(ok), flush=True)


_local = threading.local()  # each calling thread talks to its own helper process
_helpers = []  # every helper we started, killed at exit


def _start_helper():
    """Start this thread's helper process; it says "ready" once sympy is imported
    (a second or two)."""
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--serve"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    _local.proc, _local.pid, _local.ready = proc, os.getpid(), False
    _helpers[:] = [p for p in _helpers if p.poll() is None] + [proc]


def _helper():
    """This thread's helper process, ready to answer (a forked child starts its own)."""
    if getattr(_local, "proc", None) is None or _local.proc.poll() is not None \
            or _local.pid != os.getpid():
        _start_helper()
    if not _local.ready:
        if _readline(_local.proc, timeout=120) != "ready":
            raise RuntimeError("reward.py: the math-verify helper did not start; "
                               "run `python reward.py --serve`")
        _local.ready = True
    return _local.proc


def _readline(proc, timeout):
    """One line from the helper, or None after `timeout` seconds (the hung helper is then
    replaced)."""
    if select.select([proc.stdout], [], [], timeout)[0]:
        return proc.stdout.readline().strip()
    proc.kill()
    proc.wait()
    _start_helper()  # its start-up overlaps with whatever the caller does next
    return None


@atexit.register
def _stop_helpers():
    for proc in _helpers:
        proc.kill()


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    _serve()
