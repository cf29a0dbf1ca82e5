"""E8: the experiment's runs and plot are there (the written answer is graded by a rubric)."""
import json
import pathlib

import pytest

RUNS = {"k1-reward": "reward", "k1-loss": "loss"}
EXPERIMENT = pathlib.Path("experiment")


@pytest.mark.points(2)
@pytest.mark.parametrize("name", list(RUNS))
def test_run(name):
    """experiment/<run>: train.py's config.json (K1, its place, beta 1) and 20 steps of metrics."""
    run = EXPERIMENT / name
    assert (run / "config.json").exists(), f"E8: no {run}/config.json (run train.py --out {run})"
    config = json.loads((run / "config.json").read_text())
    want = {"kl": "k1", "place": RUNS[name], "beta": 1.0}
    got = {key: config.get(key) for key in want}
    assert got == want, f"E8: {run} was run with {got}, expected {want}"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line]
    assert len(rows) >= 20 and "kl_k1" in rows[-1], f"E8: {run} has {len(rows)} steps, expected 20"


@pytest.mark.points(1)
def test_plot():
    """experiment/plot.png, a PNG image."""
    plot = EXPERIMENT / "plot.png"
    assert plot.exists() and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"E8: no PNG {plot}"


@pytest.mark.points(1)
def test_answer_is_written():
    """experiment/answer.md: 30 to 300 words (its content is graded by the rubric)."""
    answer = EXPERIMENT / "answer.md"
    words = len(answer.read_text().split()) if answer.exists() else 0
    assert 30 <= words <= 300, f"E8: experiment/answer.md has {words} words, expected 30-300"
