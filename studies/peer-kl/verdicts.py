"""Every preset of lab/kl_presets.py and this project's own configurations through lab/check_kl.py
(issue 60, items 3-4): studies/peer-kl/verdicts.json, and README.md's prediction table.

    python studies/peer-kl/verdicts.py          # verdicts.json (deterministic) and the docs' tables

A row per configuration: id, library, configuration (its flags), source, place, aggregate, ratio,
on_policy and off_policy as check_kl.check() gives them (floats to 10 significant digits, so
the file is the same on any x86-64 CPU), and smollm2: the whole-model measurement of
studies/kl-gradients-whole/ (model view, step 20 at 768 groups and step 5 at 1,536), or null.

This project's rows are measured there (lab/kl_gradients.py's CONFIGS). A preset inherits a row's
measurement when its exact on-policy E[g] equals that row's in every setting of the toy
(check_kl.exact_gradients, to check_kl.TOL, the far settings included: a clamp that acts is not
hidden); never by name. The figures are read from the committed results.json files with
studies/kl-gradients-whole/verdicts.py's own formats.

It also regenerates the marked blocks of docs/peers.md (the table, the claims) and of
studies/peer-kl/README.md (the registered predictions of READING.md, parsed from its text by
predictions(), against the verdicts: hits()).
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
# the presets that equal no measured row, measured as rows of their own (PREREGISTRATION.md there)
PRESETS_RUN = HERE / "smollm2" / "results.json"
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


def preset_measurement(preset_id):
    """The last layer's figures of a preset's own row in studies/peer-kl/smollm2/results.json at
    each distance measured there, or None (not in the run, or no run)."""
    if not PRESETS_RUN.is_file():
        return None
    run = json.loads(PRESETS_RUN.read_text())
    figures = {}
    for distance in run["distances"]:
        row = distance["views"]["layer"].get("terms", {}).get(f"preset:{preset_id}")
        if row is None:
            continue
        cells = {"cos": row["cos"], "rel_bias": row["rel_bias"]}
        if "vs_parent_rel" in row:
            cells.update(vs_toy_verdict=row["vs_parent"], vs_toy_verdict_rel=row["vs_parent_rel"])
        if "check" in row:
            cells["check"] = row["check"]
        text = {key: cell(WHOLE_VERDICTS.dec(v, 0.95) if key == "cos" else
                          WHOLE_VERDICTS.table_sci(v) if key in ("check", "vs_toy_verdict") else
                          WHOLE_VERDICTS.dec(v)) for key, v in cells.items()}
        label = distance["label"].replace("_", " ")  # step_20: the --policy folder's name
        figures[label] = {**cells, "text": text, "groups": distance["groups"], "view": "layer",
                          "exact_row": row["exact"], "file": str(PRESETS_RUN.relative_to(ROOT))}
    return figures or None


def same_expectation(a, b):
    """Two exact_gradients lists equal, setting by setting, to check_kl.TOL."""
    return all((ga - gb).abs().max().item() < check_kl.TOL for (_, ga, _), (_, gb, _) in zip(a, b))


# a relative bias below this is float64 rounding of the exact enumeration, which differs by CPU
# (5.9e-16 on an AMD EPYC, 4.9e-16 on an Intel Xeon with AMX): written as 0, so the file regenerates
ROUNDING = 1e-12


def regime(gradients):
    """check_kl.regime_verdict, its rounding-level relative bias written as 0."""
    verdict = check_kl.regime_verdict(gradients)
    if verdict["rel_bias"] < ROUNDING:
        verdict["rel_bias"] = 0.0
    return verdict


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
                         on_policy=regime(on), off_policy=regime(off)))
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
        elif preset_measurement(row["id"]):
            figures = preset_measurement(row["id"])
            exact_row = next(iter(figures.values()))["exact_row"]
            row["smollm2"] = {"row": None, "how": "measured: its own row, the last layer"
                              + (", its exact per-prefix row" if exact_row else
                                 ", sampled only") + " (studies/peer-kl/smollm2/)", **figures}
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


NEAR = [name for name in check_kl.SETTING_NAMES if "far" not in name]


def near(regime, fixed_only=False):
    """The verdict over the four settings the predictions were written for (no clamp acts)."""
    values = {regime["equals_by_setting"][name] for name in NEAR
              if not (fixed_only and name.startswith("EOS"))}
    return values.pop() if len(values) == 1 else None


def prediction_table(result):
    """README.md's table: predicted, got (over all six settings, and over the four near ones),
    hit/miss."""
    show = lambda v: "null" if v is None else v  # noqa: E731
    rows = {row["id"]: row for row in result["rows"]}
    lines = ["| preset | predicted on / off | got on / off (all six settings) | "
             "got at the four near settings | |", "|---|---|---|---|---|"]
    table = hits(result, predictions())
    for preset_id, (on, fixed, off), (g_on, g_fixed, g_off), hit in table:
        cell = f"{show(on)} / {show(off)}"
        if fixed is not None:
            cell = f"{show(on)} ({show(fixed)} at fixed T) / {show(off)}"
        got = f"{show(g_on)} / {show(g_off)}"
        if fixed is not None or (g_fixed != g_on):
            got = f"{show(g_on)} ({show(g_fixed)} at fixed T) / {show(g_off)}"
        row = rows[preset_id]
        at_near = f"{show(near(row['on_policy']))} / {show(near(row['off_policy']))}"
        if fixed is not None:
            at_near = (f"{show(near(row['on_policy']))} ({show(near(row['on_policy'], True))} "
                       f"at fixed T) / {show(near(row['off_policy']))}")
        lines.append(f"| `{preset_id}` | {cell} | {got} | {at_near} | "
                     f"{'hit' if hit else '**miss**'} |")
    count = sum(hit for *_, hit in table)
    lines.append(f"\n{count} hits, {len(table) - count} misses of {len(table)} registered "
                 "predictions.")
    return "\n".join(lines)


# ---- docs/peers.md's opening table and the claims, README.md's prediction table ------------------

SHORT = {"grad KL": "grad KL", "0": "0 (eq. 13)", "K3-in-loss": "K3-in-loss (eq. 41)",
         "K3-in-reward": "K3-in-reward (eq. 15)",
         "token-level reverse KL": "token-level reverse KL",
         None: "none of these"}
FAR = [name for name in check_kl.SETTING_NAMES if "far" in name]
EOS = [name for name in check_kl.SETTING_NAMES if name.startswith("EOS")]


def failing(regime):
    """(the one known gradient held at some settings only, the settings where it fails) or None."""
    by_setting = regime["equals_by_setting"]
    held = {name for name in by_setting.values() if name}
    if regime["equals"] is not None or len(held) != 1:
        return None
    name = held.pop()
    return name, [s for s, at in by_setting.items() if at != name]


def regime_cell(regime):
    """One regime's exact verdict and its worst numbers."""
    numbers = f"cos {regime['cos']:.3f}, bias {regime['rel_bias']:.2f}"
    if regime["equals"] == "grad KL":
        return "**grad KL**"
    text = SHORT[regime["equals"]] if regime["equals"] else "null"
    fails = failing(regime)
    if fails:
        text += f" ({SHORT[fails[0]]} but at {', '.join(fails[1])})"
    return f"{text}; {numbers}"


def plain_verdict(row):
    """The plain verdict: unbiased or not, and why, in a few words."""
    on, off = row["on_policy"], row["off_policy"]
    if on["equals"] == "grad KL" and off["equals"] == "grad KL":
        return "unbiased, on- and off-policy"
    if on["equals"] == "grad KL":
        return "unbiased on-policy only"
    fails = failing(on)
    if fails and set(fails[1]) <= set(FAR + EOS):
        # a failing setting: a near EOS-ended one is 1/T_y's; the fixed-length far one a clamp's
        causes = []
        if set(fails[1]) & (set(EOS) - set(FAR)):
            causes.append("1/T_y at EOS-ended lengths")
        if set(fails[1]) & (set(FAR) - set(EOS)):
            causes.append("its clamp")
        why = f"{SHORT[fails[0]]} but for {' and '.join(causes or ['the far EOS-ended setting'])}"
    elif on["equals"] == "0":
        why = "no KL gradient at all"
    else:
        why = SHORT[on["equals"]] if on["equals"] else "none of the known gradients"
    return f"biased: {why}"


def smollm2_figures(row):
    step = row["smollm2"]["step 20"]["text"]
    return (f"{step['cos']}; {step['rel_bias']}" if "cos" in step
            else f"= grad KL (check {step['check']})")


def smollm2_cell(row):
    measured = row["smollm2"]
    if not measured:
        return "not measured"
    figures = smollm2_figures(row)
    if measured["row"] is None:  # its own row (studies/peer-kl/smollm2/), the last layer
        step = measured["step 20"]
        kind = "exact row" if step["exact_row"] else "sampled"
        return f"{figures} (own row, last layer, {kind}, {step['groups']} groups)"
    return figures if measured["how"] == "measured" else f"{figures} (as {measured['row']})"


def peers_table(result):
    """docs/peers.md's opening table: every preset, and this project's weighted."""
    lines = ["| library | preset | flags | on-policy (exact, worst of 6) | off-policy (exact) | "
             "plain verdict | SmolLM2 step 20: cos; rel. bias |", "|---|---|---|---|---|---|---|"]
    rows = [r for r in result["rows"] if r["library"] != "this project"]
    rows += [r for r in result["rows"] if r["id"] == "project-weighted"]
    for row in rows:
        flags = row["configuration"].replace("|", "\\|")
        lines.append(f"| {row['library']} | `{row['id']}` | `{flags}` | "
                     f"{regime_cell(row['on_policy'])} | {regime_cell(row['off_policy'])} | "
                     f"{plain_verdict(row)} | {smollm2_cell(row)} |")
    return "\n".join(lines)


# (preset id, who, what its text claims): READING.md's quotes
CLAIMS = [
    ("trl-grpo-k3-corrected", "TRL PR #6503 (the 1.10 default)",
     "multiplying the KL term by the importance-sampling ratio recovers the correct unbiased "
     "reverse-KL gradient ... The correction is a no-op on-policy (ratio=1)"),
    ("slime-unbiased-kl", "slime PR #1004 (`--use-unbiased-kl`)",
     "this adjustment makes the gradient of the KL estimator unbiased"),
    ("openrlhf-unbiased-gradient", "OpenRLHF PR #1309 (`--algo.kl.unbiased_gradient`)",
     "backprop the true reverse-KL gradient"),
    ("verl-k3plus-loss", "verl PR #6058 (`k3+`)", "unbiased k3 value with unbiased k2 gradient"),
    ("areal-kdrl", "AReaL's docs (docs/en/algorithms/distillation.md, KDRL)",
     "an unbiased estimate of grad J_GRPO + beta grad J_RKL"),
    ("nemo-k3", "NeMo-RL PR #2506",
     "Fix GRPO reference-policy KL gradients so KL regularization includes the sampled-policy "
     "score term"),
    ("nemo-k3-onpolicy-approx", "NeMo-RL's docs (use_on_policy_kl_approximation)",
     "both unbiased and guaranteed to be positive"),
]


# a claim's preset against the same library's configuration without the flag
VERSUS = {"trl-grpo-k3-corrected": "trl-grpo-k3"}  # its "no-op on-policy"


def claims(result):
    """docs/peers.md's claims, each against its preset's exact verdict and SmolLM2's."""
    rows = {row["id"]: row for row in result["rows"]}
    lines = []
    for preset_id, who, claim in CLAIMS:
        row = rows[preset_id]
        on, off = row["on_policy"], row["off_policy"]
        text = (f"- **{who}**: \"{claim}\". `{preset_id}`'s exact expected gradient, on-policy: "
                f"{regime_cell(on)}; off-policy: {regime_cell(off)}")
        if row["smollm2"] and row["smollm2"]["row"]:
            text += (f"; on SmolLM2 (step 20, the same expectation as {row['smollm2']['row']}) "
                     f"cos {smollm2_figures(row).replace('; ', ', relative bias ')}")
        elif row["smollm2"]:
            text += (f"; on SmolLM2 (step 20, its own row, last layer) "
                     f"cos {smollm2_figures(row).replace('; ', ', relative bias ')}")
        text += ". Not grad KL"
        if preset_id in VERSUS:  # what the flag changed
            other = rows[VERSUS[preset_id]]["on_policy"]
            text += (f"; without the correction (`{VERSUS[preset_id]}`) on-policy: "
                     f"{regime_cell(other)}: on-policy it is no no-op")
        lines.append(text + ".")
    return "\n".join(lines)


def smollm2_list(result):
    """README.md's list: each preset's SmolLM2 measurement, inherited or not measured."""
    lines = []
    for how in ("inherited", "own row", "not measured"):
        ids = [row["id"] for row in result["rows"] if row["library"] != "this project"
               and (how == "not measured") == (row["smollm2"] is None)
               and (how != "own row" or row["smollm2"]["row"] is None)
               and (how != "inherited" or row["smollm2"]["row"] is not None)]
        if how == "own row":
            if ids:
                lines.append(f"- measured as rows of their own (last layer, step 20; "
                             f"[smollm2/](smollm2/)): {', '.join(f'`{i}`' for i in ids)}")
            continue
        if how == "inherited":
            by_row = {}
            for row in result["rows"]:
                if row["id"] in ids:
                    by_row.setdefault(row["smollm2"]["row"], []).append(f"`{row['id']}`")
            lines += [f"- inherited from {name}: {', '.join(found)}"
                      for name, found in by_row.items()]
        elif ids:
            lines.append(f"- not measured ({len(ids)}): {', '.join(f'`{i}`' for i in ids)}")
    return "\n".join(lines)


BLOCKS = {  # file: {marker: renderer}
    ROOT / "docs" / "peers.md": {"table": peers_table, "claims": claims},
    HERE / "README.md": {"predictions": prediction_table, "smollm2": smollm2_list},
}


def block(name, body):
    return f"<!-- verdicts.py: {name} -->\n{body}\n<!-- /verdicts.py: {name} -->"


def render(text, renderers, result):
    """text with each marked block regenerated."""
    for name, renderer in renderers.items():
        pattern = re.compile(rf"<!-- verdicts.py: {name} -->.*?<!-- /verdicts.py: {name} -->",
                             re.S)
        if not pattern.search(text):
            raise ValueError(f"no block {name!r} to regenerate")
        text = pattern.sub(lambda _: block(name, renderer(result)), text)
    return text


def main(argv=()):
    result = build()
    OUTPUT.write_text(dumps(result))
    print(f"wrote {OUTPUT.relative_to(ROOT)}: {len(result['rows'])} rows")
    for path, renderers in BLOCKS.items():
        if path.exists():
            path.write_text(render(path.read_text(), renderers, result))
            print(f"regenerated {', '.join(renderers)} in {path.relative_to(ROOT)}")
    if "--predictions" in argv:
        print(prediction_table(result))


if __name__ == "__main__":
    main(sys.argv[1:])
