"""Every preset of lab/kl_presets.py and this project's own configurations through lab/check_kl.py
(issue 60, items 3-4): studies/peer-kl/verdicts.json, and README.md's prediction table.

    python studies/peer-kl/verdicts.py          # writes verdicts.json (deterministic)

A row per configuration: id, library, configuration (its flags), source, place, aggregate, ratio,
on_policy and off_policy as check_kl.check() gives them (floats to 10 significant digits, so
the file is the same on any x86-64 CPU), and smollm2: the whole-model measurement of
studies/kl-gradients-whole/ (model view, step 20 at 768 groups and step 5 at 1,536), or null.

This project's rows are measured there (lab/kl_gradients.py's CONFIGS). A preset inherits a row's
measurement when its exact on-policy E[g] equals that row's in every setting of the toy
(check_kl.exact_gradients, to check_kl.TOL, the far settings included: a clamp that acts is not
hidden); never by name. The figures are read from the committed results.json files with
studies/kl-gradients-whole/verdicts.py's own formats.

The predictions registered in READING.md are parsed from its text and compared with the verdicts
(predictions() and hits()); README.md's table is their output (`--predictions`).
"""
import importlib.util
import json
import math
import re
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

import kl  # noqa: E402
from lab import check_kl  # noqa: E402
from lab.kl_presets import PRESETS  # noqa: E402

WHOLE = ROOT / "studies" / "kl-gradients-whole"
# the measurement of each distance: the registered run (step 20) and the width rule's extension
MEASURED = {"step 20": WHOLE / "results.json", "step 5": WHOLE / "step5-1536" / "results.json"}
OUTPUT = HERE / "verdicts.json"
DIGITS = 10


def _whole_verdicts():
    """studies/kl-gradients-whole/verdicts.py as a module (its row names and cell formats)."""
    spec = importlib.util.spec_from_file_location("whole_verdicts", WHOLE / "verdicts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


WHOLE_VERDICTS = _whole_verdicts()


# ---- this project's configurations, from kl.py's functions ------------------------------------

def estimator(kind, clamp="none"):
    """kl.estimate as a checker term: the per-token K1, K2 or K3 (Table 1), differentiable."""
    def term(logp, ref_logp, old_logp, mask):
        return kl.estimate(logp, ref_logp, kind, clamp)
    term.__name__ = f"kl_estimate_{kind}_{clamp}"
    return term


def weighted(logp, ref_logp, old_logp, mask):
    """kl.off_policy_kl_loss per token: w sg[K1] of the sequence spread over its T_y tokens
    (aggregate "sum"), w = prod_t pi/mu (kl.log_importance_weights), capped at e^MAX_LOG_W."""
    log_w = kl.log_importance_weights(logp, old_logp, mask)[:, None]
    k1 = (mask * kl.estimate(logp, ref_logp, "k1")).sum(-1, keepdim=True).detach()
    w = log_w.detach().clamp(max=kl.MAX_LOG_W).exp()
    # sg[w] exp(log w - sg[log w]): the value w, the gradient w grad log pi(y)
    sequence = w * k1 * torch.exp(log_w - log_w.detach())
    return (sequence / mask.sum(-1, keepdim=True)).expand_as(logp)


def _project(configuration, place, term, measured, aggregate="token-mean"):
    return dict(library="this project", configuration=configuration,
                source="kl.py; lab/kl_gradients.py CONFIGS" if measured else "kl.py",
                place=place, aggregate=aggregate, ratio="token", term=term, measured=measured)


# id: the row; `measured` names lab/kl_gradients.py's CONFIGS entry measured on SmolLM2
PROJECT = {
    "project-k1-reward": _project("--kl k1 --place reward", "reward", estimator("k1"), "k1_reward"),
    "project-k1-loss": _project("--kl k1 --place loss", "loss", estimator("k1"), "k1_loss"),
    "project-k3-reward": _project("--kl k3 --place reward", "reward", estimator("k3"), "k3_reward"),
    "project-k3-loss": _project("--kl k3 --place loss", "loss", estimator("k3"), "k3_loss"),
    "project-k1-both": _project("--kl k1 --place both", "both", estimator("k1"), "k1_both"),
    "project-k3-both": _project("--kl k3 --place both", "both", estimator("k3"), "k3_both"),
    "project-k2-loss": _project("--kl k2 --place loss", "loss", estimator("k2"), "k2_loss"),
    "project-k3-reward-verl": _project("--kl k3 --place reward --kl-clamp verl", "reward",
                                       estimator("k3", "verl"), "k3_reward_verl"),
    "project-k1-to-go": _project("kl.kl_to_go with K1 (no train.py flag)", "reward-to-go",
                                 estimator("k1"), "k1_to_go"),
    "project-weighted": _project("--kl k1 --place weighted", "loss", weighted, None, "sum"),
}


# ---- the rows ---------------------------------------------------------------------------------

def rounded(value):
    """Floats to DIGITS significant digits (NaN and inf to null), recursively."""
    if isinstance(value, float):
        return float(f"{value:.{DIGITS}g}") if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: rounded(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded(item) for item in value]
    return value


def cell(parts):
    """A cell as studies/kl-gradients-whole/verdicts.py prints it: "x [lo, hi]", or one text."""
    return parts[0] if len(parts) == 1 else f"{parts[0]} [{parts[1]}, {parts[2]}]"


def measurement(name):
    """The model view's figures of kl_gradients' row `name` at each measured distance."""
    figures = {}
    for label, path in MEASURED.items():
        run = json.loads(path.read_text())
        (distance,) = [d for d in run["distances"] if d["label"] == label]
        row = distance["views"]["model"]["rows"][name]
        cells = {"check": row["check"]}
        if "cos" in row:  # the unbiased rows carry the check only: E = grad KL by construction
            cells.update(cos=row["cos"], rel_bias=row["rel_bias"])
        text = {key: cell(WHOLE_VERDICTS.dec(v, 0.95) if key == "cos" else
                          WHOLE_VERDICTS.table_sci(v) if key == "check" else
                          WHOLE_VERDICTS.dec(v)) for key, v in cells.items()}
        figures[label] = {**cells, "text": text, "groups": distance["groups"],
                          "file": str(path.relative_to(ROOT))}
    return figures


def same_expectation(a, b):
    """Two exact_gradients lists equal, setting by setting, to check_kl.TOL."""
    return all((ga - gb).abs().max().item() < check_kl.TOL for (_, ga, _), (_, gb, _) in zip(a, b))


def build():
    """verdicts.json's object: {"settings", "rows"}."""
    torch.set_num_threads(1)
    entries = {**PRESETS, **PROJECT}
    exact, rows = {}, []
    for row_id, entry in entries.items():
        args = (entry["term"], entry["place"], entry["aggregate"] or "token-mean",
                entry["ratio"] or "token")
        on, off = (check_kl.exact_gradients(*args, off_policy=o) for o in (False, True))
        exact[row_id] = on
        rows.append(dict(id=row_id, library=entry["library"], configuration=entry["configuration"],
                         source=entry["source"], place=args[1], aggregate=args[2], ratio=args[3],
                         on_policy=check_kl.regime_verdict(on),
                         off_policy=check_kl.regime_verdict(off)))
    # the measured rows, in studies/kl-gradients-whole/verdicts.py's order
    measured = {entry["measured"]: row_id for row_id, entry in PROJECT.items() if entry["measured"]}
    order = [measured[name] for name in WHOLE_VERDICTS.NAMES if name in measured]
    for row in rows:
        own = PROJECT.get(row["id"], {}).get("measured")
        equal = [row_id for row_id in order if same_expectation(exact[row["id"]], exact[row_id])]
        if own:
            row["smollm2"] = {"row": WHOLE_VERDICTS.NAMES[own], "how": "measured",
                              **measurement(own)}
        elif equal:
            name = PROJECT[equal[0]]["measured"]
            row["smollm2"] = {"row": WHOLE_VERDICTS.NAMES[name],
                              "how": f"inherited from {WHOLE_VERDICTS.NAMES[name]}: the same "
                                     "expectation, proven on the toy",
                              **measurement(name)}
        else:
            row["smollm2"] = None
        row["same_expectation_on_policy"] = [r for r in equal if r != row["id"]]
    settings = [dict(name=name, T=T, eos=eos, pi=theta, mu=mu, pi_ref=ref)
                for name, (T, eos, theta, mu, ref) in zip(check_kl.SETTING_NAMES,
                                                          check_kl.SETTINGS)]
    return rounded({"settings": settings, "rows": rows})


def dumps(result):
    return json.dumps(result, indent=1, sort_keys=False) + "\n"


# ---- the registered predictions (READING.md) ----------------------------------------------------

def predictions(text=None):
    """{preset id: (on-policy, at fixed length or None, off-policy)} parsed from READING.md's
    "Predicted" sentences, where a verdict is a backticked known gradient or `null`; "X at fixed
    T, `null` with EOS" gives X at a fixed length and null over all settings."""
    text = text if text is not None else (HERE / "READING.md").read_text()
    text = " ".join(text.split("## Notes added after")[0].split())
    found = {}
    for preset_id in sorted(PRESETS, key=len, reverse=True):  # trl-grpo-k3-corrected first
        sections = [preset_id]
        if preset_id.startswith("paper-"):  # the paper section writes "k1-reward" etc.
            sections.append(preset_id[len("paper-"):])
        for name in sections:
            pattern = (rf"(?<![\w-]){re.escape(name)} `([^`]*)`"
                       rf"(?: at fixed T, `([^`]*)`[^/`]*)? / `([^`]*)`")
            match = re.search(pattern, text)
            if match and preset_id not in found:
                first, eos, off = match.groups()
                value = lambda v: None if v == "null" else v  # noqa: E731
                if eos is None:
                    found[preset_id] = (value(first), None, value(off))
                else:
                    found[preset_id] = (value(eos), value(first), value(off))
    return found


def hits(result, predicted):
    """[(id, predicted, got, hit)] per preset: hit if every predicted verdict is the checker's."""
    table = []
    for row in result["rows"]:
        if row["id"] not in predicted:
            continue
        on, fixed, off = predicted[row["id"]]
        got = (row["on_policy"]["equals"], row["on_policy"]["equals_at_fixed_length"],
               row["off_policy"]["equals"])
        hit = on == got[0] and off == got[2] and (fixed is None or fixed == got[1])
        table.append((row["id"], (on, fixed, off), got, hit))
    return table


def prediction_table(result):
    """README.md's table: predicted, got, hit/miss."""
    show = lambda v: "null" if v is None else v  # noqa: E731
    lines = ["| preset | predicted on / off | got on / off | |", "|---|---|---|---|"]
    table = hits(result, predictions())
    for preset_id, (on, fixed, off), (g_on, g_fixed, g_off), hit in table:
        cell = f"{show(on)} / {show(off)}"
        if fixed is not None:
            cell = f"{show(on)} ({show(fixed)} at fixed T) / {show(off)}"
        got = f"{show(g_on)} / {show(g_off)}"
        if fixed is not None or (g_fixed != g_on):
            got = f"{show(g_on)} ({show(g_fixed)} at fixed T) / {show(g_off)}"
        lines.append(f"| `{preset_id}` | {cell} | {got} | {'hit' if hit else '**miss**'} |")
    count = sum(hit for *_, hit in table)
    lines.append(f"\n{count} hits, {len(table) - count} misses of {len(table)} registered "
                 "predictions.")
    return "\n".join(lines)


def main(argv=()):
    result = build()
    OUTPUT.write_text(dumps(result))
    print(f"wrote {OUTPUT.relative_to(ROOT)}: {len(result['rows'])} rows")
    if "--predictions" in argv:
        print(prediction_table(result))


if __name__ == "__main__":
    main(sys.argv[1:])
