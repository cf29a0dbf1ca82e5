"""assets/kl_gradients_verdicts.png from studies/peer-kl/verdicts.json: each configuration's cosine
with grad KL and relative bias, exact on the toy (worst over check_kl's settings, on- and
off-policy), and SmolLM2's whole-model value with its 95% interval (step 20) where measured or
inherited; coloured by the exact verdict.

    python studies/peer-kl/plot.py
"""
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
OUTPUT = ROOT / "assets" / "kl_gradients_verdicts.png"
# the exact verdict's colour
COLOURS = {"grad KL": ("#1a9850", "unbiased (grad KL)"),
           "token-level reverse KL": ("#4575b4", "token-level reverse KL"),
           "K3-in-loss": ("#f46d43", "K3-in-loss (eq. 41)"),
           "K3-in-reward": ("#d73027", "K3-in-reward (eq. 15)"),
           "0": ("#7f7f7f", "zero (eq. 13)"),
           None: ("#762a83", "biased, none of these")}
STEP = "step 20"


def label(row):
    name = row["id"].replace("project-", "") if row["library"] == "this project" else row["id"]
    return f"{name}  (this project)" if row["library"] == "this project" else name


def smollm2_text(row):
    """The SmolLM2 column: measured, inherited (from which row), or not measured."""
    if not row["smollm2"]:
        return "not measured"
    if row["smollm2"]["how"] == "measured":
        return "measured"
    if row["smollm2"]["row"] is None:  # its own row: studies/peer-kl/smollm2/, the last layer
        return "own row (last layer)"
    return f"= {row['smollm2']['row']}"


def main():
    rows = json.loads((HERE / "verdicts.json").read_text())["rows"]
    # this project's rows first, then the presets in lab/kl_presets.py's order
    rows = ([r for r in rows if r["library"] == "this project"]
            + [r for r in rows if r["library"] != "this project"])
    n = len(rows)
    fig, axes = plt.subplots(1, 2, figsize=(12.5, 0.27 * n + 1.9), sharey=True,
                             gridspec_kw=dict(wspace=0.06))
    for y, row in enumerate(rows):
        for ax in axes:
            if y % 2 == 0:
                ax.axhspan(y - 0.5, y + 0.5, color="#f2f2f2", zorder=0, lw=0)
        for ax, key in zip(axes, ("cos", "rel_bias")):
            on, off = row["on_policy"], row["off_policy"]
            ax.plot(on[key], y - 0.12, "o", ms=7, color=COLOURS[on["equals"]][0], zorder=3)
            ax.plot(off[key], y + 0.12, "s", ms=6, mfc="white", mew=1.6,
                    color=COLOURS[off["equals"]][0], zorder=3)
            measured = (row.get("smollm2") or {}).get(STEP)
            if measured and measured.get(key) and measured[key][0] is not None:
                point, low, high = measured[key]
                ax.errorbar(point, y, xerr=[[point - low], [high - point]], fmt="D", ms=5,
                            color="black", ecolor="black", elinewidth=1.2, capsize=2, zorder=4)
            elif measured and "cos" not in measured:  # E = grad KL: its sampled mean checked
                ax.plot(1.0 if key == "cos" else 0.0, y, "D", ms=5, mfc="white", mew=1.2,
                        color="black", zorder=4)
        axes[1].text(1.03, y, smollm2_text(row), transform=axes[1].get_yaxis_transform(),
                     va="center", fontsize=8, color="black" if row["smollm2"] else "#999999")
    axes[0].set_yticks(range(n), [label(r) for r in rows], fontsize=9)
    for tick, row in zip(axes[0].get_yticklabels(), rows):
        tick.set_color(COLOURS[row["on_policy"]["equals"]][0])
        if row["library"] == "this project":
            tick.set_fontweight("bold")
    axes[0].set_ylim(n - 0.5, -0.5)
    axes[0].set_xlim(-1.05, 1.05)
    axes[0].axvline(1, color="#1a9850", lw=1, ls=":")
    axes[0].set_xlabel("cos(E[g], grad KL)  (1 = the right direction)")
    axes[1].set_xlim(-0.1, 5.0)
    axes[1].text(1.03, -0.9, "SmolLM2", transform=axes[1].get_yaxis_transform(), fontsize=9,
                 fontweight="bold", va="bottom")
    axes[1].axvline(0, color="#1a9850", lw=1, ls=":")
    axes[1].set_xlabel("relative bias ||E[g] - grad KL|| / ||grad KL||  (0 = unbiased)")
    for ax in axes:
        ax.grid(axis="x", color="#dddddd", lw=0.6)
        ax.tick_params(axis="x", labelsize=9)
    marks = [Line2D([], [], ls="", marker="o", color="#555555", ms=7,
                    label="toy, exact, on-policy (worst of 6 settings)"),
             Line2D([], [], ls="", marker="s", mfc="white", mew=1.6, color="#555555", ms=6,
                    label="toy, exact, off-policy (worst of 6)"),
             Line2D([], [], ls="-", marker="D", color="black", ms=5,
                    label="SmolLM2-135M, step 20, 95% interval (whole model; own rows: last layer)"),
             Line2D([], [], ls="", marker="D", mfc="white", mew=1.2, color="black", ms=5,
                    label="SmolLM2: E[g] = grad KL, its sample mean checked")]
    verdicts = [Line2D([], [], ls="", marker="o", color=colour, ms=7, label=text)
                for colour, text in COLOURS.values()]
    fig.legend(handles=marks + verdicts, loc="lower center", ncol=3, fontsize=8.5,
               frameon=False, bbox_to_anchor=(0.53, 0.0))
    fig.suptitle("Is my KL term right? Each library's KL gradient against grad KL(pi || pi_ref) "
                 "(colour: the exact verdict)", fontsize=11, x=0.53, y=0.995)
    fig.subplots_adjust(left=0.22, right=0.84, top=1 - 0.45 / fig.get_figheight(),
                        bottom=1.5 / fig.get_figheight())
    fig.savefig(OUTPUT, dpi=110)
    print(f"wrote {OUTPUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
