"""E8: the experiment's runs are train.py's own output and the plot is plot.py's figure of them (the
written answer is graded by the instructor's rubric). A run's metrics.jsonl must obey the identities
train.py's accounting implies, row by row, which hand-written numbers do not (classroom/README.md):
step 1 has KL 0 (the policy is the reference) and is the same in both runs (same seed); rewards
and lengths are counts over the batch; return = reward - beta K1 in the reward run and = reward in
the loss run; kl_loss = beta K1 / response_len in the loss run and 0 in the reward run; loss =
pg_loss + kl_loss; tokens_per_s = tokens / (sample_s + train_s)."""
import json
import math
import pathlib

from classroom.harness import Wrong

OWN, OTHERS, PATCH = [], [], []
RUNS = {"k1-reward": "reward", "k1-loss": "loss"}
KEYS = ("step", "reward", "return", "kl_k1", "kl_k3", "loss", "pg_loss", "kl_loss",
        "response_len", "sample_s", "train_s", "tokens_per_s")


def read_run(root, name):
    """(config, metrics rows) of experiment/<name>, or Wrong."""
    run = root / "experiment" / name
    if not (run / "config.json").is_file() or not (run / "metrics.jsonl").is_file():
        raise Wrong(f"E8: no {run.relative_to(root)}/config.json and metrics.jsonl "
                    f"(run train.py --out experiment/{name})")
    try:
        config = json.loads((run / "config.json").read_text())
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
                if line.strip()]
    except (ValueError, UnicodeDecodeError) as error:
        raise Wrong(f"E8: experiment/{name}: not train.py's JSON ({str(error)[:80]})") from None
    if not isinstance(config, dict) or not all(isinstance(row, dict) for row in rows):
        raise Wrong(f"E8: experiment/{name}: not train.py's config.json and metrics.jsonl")
    return config, rows


def consistent(name, config, rows):
    """Wrong unless the run has the flags asked for and metrics that obey train.py's identities."""
    want = {"kl": "k1", "place": RUNS[name], "beta": 1.0}
    got = {key: config.get(key) for key in want}
    if got != want:
        raise Wrong(f"E8: experiment/{name} was run with {got}, expected {want}")
    if len(rows) < 20:
        raise Wrong(f"E8: experiment/{name} has {len(rows)} steps, expected 20")
    sequences = config.get("prompts_per_step", 0) * config.get("group_size", 0)
    beta = config["beta"]
    for index, row in enumerate(rows):
        where = f"E8: experiment/{name}/metrics.jsonl, line {index + 1}"
        if not all(isinstance(row.get(key), (int, float)) and math.isfinite(row[key])
                   for key in KEYS):
            raise Wrong(f"{where}: not a row of train.py's metrics (it logs {', '.join(KEYS)})")
        checks = [
            (row["step"] == index + 1, "steps are not 1, 2, 3, ..."),
            (index > 0 or abs(row["kl_k1"]) + abs(row["kl_k3"]) < 1e-4, "step 1 has a KL (the "
             "policy is the reference there)"),
            (is_count(row["reward"] * sequences), "the reward is not a mean over the batch"),
            (is_count(row["response_len"] * sequences), "response_len is not a mean length"),
            (row["kl_k3"] >= -1e-6, "K3 is negative"),
            (near(row["loss"], row["pg_loss"] + row["kl_loss"]), "loss != pg_loss + kl_loss"),
            (near(row["tokens_per_s"] * (row["sample_s"] + row["train_s"]),
                  row["response_len"] * sequences, 1e-6), "tokens_per_s does not add up"),
        ]
        if RUNS[name] == "reward":
            checks += [(near(row["return"], row["reward"] - beta * row["kl_k1"]),
                        "return != reward - beta kl_k1 (eq. 7)"),
                       (row["kl_loss"] == 0, "kl_loss is not 0 with the KL in the reward")]
        else:
            checks += [(near(row["return"], row["reward"]), "return != reward"),
                       (near(row["kl_loss"], beta * row["kl_k1"] / row["response_len"]),
                        "kl_loss != beta kl_k1 / response_len (eq. 9)")]
        for ok, what in checks:
            if not ok:
                raise Wrong(f"{where}: {what}")


def is_count(x):
    return abs(x - round(x)) < 1e-6 and x > 0


def near(a, b, relative=1e-5):
    """Equal up to train.py's float32 sums."""
    return abs(a - b) <= 1e-6 + relative * abs(b)


def run_check(name, root):
    def check(_, run):
        """experiment/<run>: train.py's config.json and metrics of its flags, consistent."""
        config, rows = read_run(root, name)
        consistent(name, config, rows)
        other, first = read_run(root, next(n for n in RUNS if n != name))[1][:1], rows[0]
        if other and {k: other[0].get(k) for k in ("reward", "response_len")} != \
                {k: first.get(k) for k in ("reward", "response_len")}:
            raise Wrong(f"E8: the two runs differ at step 1, where both sample from the same "
                        f"model with the same seed")
    return check


def plot_check(root):
    def check(_, run):
        """experiment/plot.png is plot.py's figure of the two runs (re-drawn here, compared)."""
        plot = root / "experiment" / "plot.png"
        if not plot.is_file():
            raise Wrong("E8: no experiment/plot.png")
        for name in RUNS:
            read_run(root, name)
        got = run("render_plot", runs=[f"experiment/{name}" for name in RUNS],
                  submitted="experiment/plot.png")
        if got["submitted"] is None:
            raise Wrong(f"E8: experiment/plot.png is not a PNG image ({got['why']})")
        # 100% on the same matplotlib; the figure of other runs agrees on ~90% of its pixels
        if got["submitted"] != got["rendered"] or not got["agree"] >= 0.97:
            raise Wrong(f"E8: experiment/plot.png is not plot.py's figure of the two runs "
                        f"(size {got['submitted'][:2]} vs {got['rendered'][:2]}, "
                        f"{got['agree']:.0%} of pixels agree)")
    return check


def answer_check(root):
    def check(_, run):
        """experiment/answer.md: 30 to 300 words (its content is graded by the rubric)."""
        answer = root / "experiment" / "answer.md"
        words = len(answer.read_text(errors="replace").split()) if answer.is_file() else 0
        if not 30 <= words <= 300:
            raise Wrong(f"E8: experiment/answer.md has {words} words, expected 30-300")
    return check


def tests(seed, hidden, root=pathlib.Path(".")):
    return [
        dict(name=f"run_{name.replace('-', '_')}", points=1.5, seconds=30,
             check=run_check(name, root), cases=[(name, None)],
             hint="Both runs need config.json and metrics.jsonl written by train.py itself with "
                  "the flags of the statement (--steps 20).")
        for name in RUNS
    ] + [
        dict(name="answer_is_written", points=0, seconds=5, check=answer_check(root),
             cases=[("answer", None)],
             hint="experiment/answer.md, at most 300 words; your instructor grades it by a "
                  "rubric."),
        dict(name="plot", points=1, seconds=120, check=plot_check(root), cases=[("plot", None)],
             hint="python plot.py experiment/k1-reward experiment/k1-loss --out "
                  "experiment/plot.png, after both runs."),
    ]
