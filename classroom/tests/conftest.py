"""The grader's side of pytest: each case's parameters come from the seed (CLASSROOM_SEED; more
cases when CLASSROOM_HIDDEN is set), and each test's outcome, points and seconds go to
CLASSROOM_RESULTS for `python -m classroom grade`. A test function is worth
@pytest.mark.points(n), shared equally by its cases, so totals do not change with the number of
cases."""
import json
import os
import pathlib
import random
import re

import pytest
import torch

SEED = int(os.environ.get("CLASSROOM_SEED") or 2512)
HIDDEN = bool(os.environ.get("CLASSROOM_HIDDEN"))
_results = []
_points = {}  # nodeid -> this case's share of its test function's points


def cases(name, draw, public=2, hidden=5):
    """The parameters of a test's cases: draw(rng) for each, rng seeded by (SEED, name, i)."""
    return [draw(random.Random(f"{SEED}:{name}:{i}")) for i in range(hidden if HIDDEN else public)]


def pytest_configure(config):
    config.addinivalue_line("markers", "points(n): the points a test is worth")
    torch.set_num_threads(1)  # small tensors: one thread is fastest on a shared CPU


def pytest_collection_modifyitems(items):
    groups = {}
    for item in items:
        groups.setdefault((item.module.__name__, item.originalname), []).append(item)
    for group in groups.values():
        marker = group[0].get_closest_marker("points")
        for item in group:
            _points[item.nodeid] = (marker.args[0] if marker else 1) / len(group)


def _exercise(nodeid):
    match = re.search(r"test_(e\d+)_", nodeid)
    return match.group(1).upper() if match else "?"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" or (report.when == "setup" and report.failed):
        from classroom.manifest import BY_ID

        exercise = _exercise(item.nodeid)
        message = ""
        if report.failed:
            crash = getattr(report.longrepr, "reprcrash", None)
            message = (crash.message if crash else str(report.longrepr)).strip().splitlines()[0]
        _results.append({
            "name": item.nodeid.split("::", 1)[1], "exercise": exercise,
            "points": round(_points[item.nodeid], 4), "passed": report.passed,
            "seconds": round(report.duration, 3), "message": message[:300],
            "hint": BY_ID[exercise].hint if exercise in BY_ID else ""})


def pytest_sessionfinish(session):
    path = os.environ.get("CLASSROOM_RESULTS")
    if path:
        pathlib.Path(path).write_text(json.dumps(_results, indent=1))
