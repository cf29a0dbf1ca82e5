"""The presets through the exact checker (issue 60, item 5): each against test_kl.py's independent
closed forms where one exists, its clamp seen where it acts, injected bugs changing the verdict;
studies/peer-kl/verdicts.json regenerating byte for byte, docs/peers.md's and the study README's
tables being that file's, SmolLM2 inherited by equal expectations only."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

import test_kl
from lab import check_kl, kl_presets
from lab.check_kl import SETTING_NAMES, SETTINGS, check, exact_gradients
from lab.kl_presets import PRESETS

ROOT = Path(__file__).resolve().parents[1]
STUDY = ROOT / "studies" / "peer-kl"
FAR = [i for i, name in enumerate(SETTING_NAMES) if "far" in name]


def load_verdicts():
    spec = importlib.util.spec_from_file_location("peer_verdicts", STUDY / "verdicts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


verdicts = load_verdicts()


def preset_gradients(preset_id, off_policy=False):
    p = PRESETS[preset_id]
    return exact_gradients(p["term"], p["place"], p["aggregate"], p["ratio"], off_policy)


# ---- closed forms, independent of the checker: test_kl.py's, and the token-level reverse KL ------

def token_reverse_kl(setting, off_policy):
    """sum_t E_{y<t ~ s}[grad KL(pi(.|y<t) || pi_ref(.|y<t))], fixed lengths: for Bernoulli
    tokens d/dz KL(Bern(p) || Bern(q)) = p (1 - p) (z - z~), prefixes weighted by s (mu or pi)."""
    T, eos, theta, mu, ref = setting
    m = test_kl.toy(T, theta, ref)
    z, z_ref, c = m["z"].detach(), m["z_ref"], m["c"]
    p = torch.sigmoid(z)
    per_token = p * (1 - p) * (z - z_ref)
    sample_logp = test_kl.behaviour(m, mu) if off_policy else m["logp"].detach()
    prob = sample_logp.sum(-1).exp()
    return (prob[:, None, None] * torch.stack([per_token, per_token * c], -1)).sum((0, 1))


def closed_form(name, setting, off_policy=False):
    """A known gradient written independently of check_kl (None where test_kl has none)."""
    T, eos, theta, mu, ref = setting
    if name == "token-level reverse KL":
        return None if eos else token_reverse_kl(setting, off_policy)
    if name == "K3-in-loss + mean K3 score":
        # TRL's sequence-level ratio on K3 (on-policy): d/dlogp_s sum_t c K3_t = (1 - r_s) +
        # mean_t K3_t, so E = eq. 41 + E_pi[(sum_t K3_t / T) grad log pi(y)] (READING.md)
        if eos or off_policy:
            return None
        m = test_kl.toy(T, theta, ref)
        refs = test_kl.references(m)
        p, q, y, c = torch.sigmoid(m["z"].detach()), torch.sigmoid(m["z_ref"]), m["y"], m["c"]
        r = torch.where(y == 1, q / p, (1 - q) / (1 - p))
        mean_k3 = (r - 1 - torch.log(r)).mean(1)
        score = torch.stack([y - p, (y - p) * c], -1).sum(1)
        pi = m["logp"].sum(-1).exp().detach()
        return refs["eq41"] + (pi[:, None] * mean_k3[:, None] * score).sum(0)
    if eos:
        if off_policy:
            return None
        refs = test_kl.eos_references(test_kl.toy_with_eos(T, theta, ref))
    else:
        m = test_kl.toy(T, theta, ref)
        refs = test_kl.references(m)
        if off_policy:
            hand = test_kl.off_policy_references(m, test_kl.behaviour(m, mu))
            return {"0": hand["k1_loss"], "K3-in-loss": hand["k3_loss"]}.get(name)
    return {"grad KL": refs["true"], "0": 0 * refs["true"], "K3-in-loss": refs["eq41"],
            "K3-in-reward": refs["true"] + refs["eq19"] - refs.get("length", 0)}[name]


# preset: (its known gradient on-policy, where: "all" settings, "fixed" lengths (seq-mean's 1/T_y),
# whether a clamp acts at the far settings, and its off-policy closed form, if any)
CLOSED = {
    "paper-k1-reward": ("grad KL", "all", False), "paper-k1-loss": ("0", "all", False),
    "paper-k3-reward": ("K3-in-reward", "all", False),
    "paper-k3-loss": ("K3-in-loss", "all", False),
    "trl-grpo-k3": ("K3-in-loss", "all", False),
    "trl-grpo-k3-corrected": ("token-level reverse KL", "all", False),
    "trl-grpo-k3-corrected-sequence": ("K3-in-loss + mean K3 score", "fixed", False),
    "trl-rloo-k1": ("grad KL", "all", False),
    "nemo-k3": ("token-level reverse KL", "all", True),
    "nemo-k3-onpolicy-approx": ("token-level reverse KL", "all", True),
    "nemo-k3-before-2506": ("K3-in-loss", "all", True),
    "slime-k1-loss": ("0", "fixed", False), "slime-low-var-kl": ("K3-in-loss", "fixed", True),
    "slime-unbiased-kl": ("token-level reverse KL", "fixed", True),
    "openrlhf-k1-reward": ("grad KL", "all", True), "openrlhf-k3-loss": ("K3-in-loss", "all", True),
    "openrlhf-unbiased-gradient": ("token-level reverse KL", "all", False),
    "verl-k1-reward": ("grad KL", "all", False),
    "verl-low-var-kl-loss": ("K3-in-loss", "all", True),
    "verl-k3plus-loss": ("token-level reverse KL", "all", False),
    "verl-k1plus-loss": ("token-level reverse KL", "all", False),
    "verl-k3plus-reward": ("K3-in-reward", "all", True), "areal-kdrl": ("0", "all", False),
    "skyrl-k3-loss": ("K3-in-loss", "fixed", True),
    "skyrl-k2-loss": ("token-level reverse KL", "fixed", False),
    "tba-prime-k3-loss": ("0", "all", False),
}
# off-policy closed forms: the ratio-corrected terms are the token-level reverse KL at mu's prefixes
# (where no clamp of the weight acts), K1 in the loss is E_mu[grad log pi(y)], K3 in the loss
# test_kl's
OFF = {"trl-grpo-k3-corrected": "token-level reverse KL", "paper-k1-loss": "0",
       "areal-kdrl": "0", "paper-k3-loss": "K3-in-loss", "trl-grpo-k3": "K3-in-loss",
       "openrlhf-unbiased-gradient": "token-level reverse KL",
       "nemo-k3-onpolicy-approx": "token-level reverse KL"}
OFF_CLAMPED = {"openrlhf-unbiased-gradient", "nemo-k3-onpolicy-approx"}  # a weight or K3 clamp


def test_every_preset_has_a_closed_form_row():
    assert set(CLOSED) == set(PRESETS)


@pytest.mark.parametrize("preset_id", list(CLOSED))
def test_each_preset_equals_its_closed_form_and_its_clamp_shows(preset_id):
    name, where, clamped = CLOSED[preset_id]
    rows = preset_gradients(preset_id)
    compared = 0
    for index, (setting, g, _) in enumerate(rows):
        if where == "fixed" and setting[1]:
            continue  # seq-mean: 1 / T_y, no constant at EOS-ended lengths
        expected = closed_form(name, setting)
        if expected is None:
            continue
        compared += 1
        if clamped and index in FAR:
            # the clamp acts here: the expectation moves off the unclamped closed form
            assert not test_kl.close(g, expected), (preset_id, SETTING_NAMES[index])
        else:
            assert test_kl.close(g, expected), (preset_id, SETTING_NAMES[index])
    assert compared >= 2
    if preset_id in OFF:
        compared = 0
        for index, (setting, g, _) in enumerate(preset_gradients(preset_id, off_policy=True)):
            expected = closed_form(OFF[preset_id], setting, off_policy=True)
            if expected is None:
                continue
            compared += 1
            if preset_id in OFF_CLAMPED and index in FAR:
                assert not test_kl.close(g, expected), (preset_id, SETTING_NAMES[index])
            else:
                assert test_kl.close(g, expected), (preset_id, SETTING_NAMES[index])
        assert compared >= 2


def test_tba_prime_has_no_gradient_and_rloo_weighs_the_sequence():
    for off_policy in (False, True):
        for _, g, _ in preset_gradients("tba-prime-k3-loss", off_policy):
            assert g.abs().max().item() == 0.0
    # TRL's RLOO off-policy: E_mu[(pi/mu)(y) K1_mu(y) grad log pi(y)] = E_pi[K1_mu grad log pi(y)]
    for (T, eos, theta, mu, ref), g, _ in preset_gradients("trl-rloo-k1", off_policy=True):
        m = check_kl.responses(T, eos, theta, ref)
        mu_logp = check_kl.responses(T, eos, mu, ref)["logp"].detach()
        k1_of_mu = (m["mask"] * (mu_logp - m["ref_logp"].detach())).sum(-1)
        by_hand = torch.stack(torch.autograd.grad((m["logp"].sum(-1).exp() * k1_of_mu).sum(),
                                                  m["params"]))
        assert test_kl.close(g, by_hand)


# ---- injected bugs in a preset change its verdict ------------------------------------------------

def verdict_of(preset_id, term=None):
    p = PRESETS[preset_id]
    return check(term or p["term"], p["place"], p["aggregate"], p["ratio"])


def test_a_dropped_detach_in_the_straight_through_is_caught(monkeypatch):
    before = verdict_of("verl-k3plus-loss")
    assert before["on_policy"]["equals"] == "token-level reverse KL"
    # the value not detached: its gradient adds K3's to K2's
    monkeypatch.setattr(kl_presets, "_straight_through",
                        lambda value, surrogate: value + surrogate - surrogate.detach())
    for preset_id in ("verl-k3plus-loss", "openrlhf-unbiased-gradient"):
        after = verdict_of(preset_id)
        assert after["on_policy"]["equals"] is None, preset_id
        assert after["on_policy"]["equals_by_setting"]["T=3"] != "token-level reverse KL"
    # k1+: grad K1 adds E_pi[grad log pi(y)] = 0 on-policy, so the bug shows off-policy only
    after = verdict_of("verl-k1plus-loss")
    monkeypatch.undo()
    before = verdict_of("verl-k1plus-loss")
    assert after["on_policy"]["equals"] == before["on_policy"]["equals"]
    assert after["off_policy"]["rel_bias"] > before["off_policy"]["rel_bias"] + 1e-3


def test_a_dropped_detach_of_nemos_weight_is_caught():
    def nemo_weight_not_stopped(logp, ref_logp, old_logp, mask):
        # exp(x - x) = 1 with no gradient: the score term of #2506 is gone
        return kl_presets._nemo_weighted_k3(logp, ref_logp, torch.exp(logp - logp))

    before, after = verdict_of("nemo-k3"), verdict_of("nemo-k3", nemo_weight_not_stopped)
    assert before["on_policy"]["equals_by_setting"]["T=3"] == "token-level reverse KL"
    assert after["on_policy"]["equals_by_setting"]["T=3"] == "K3-in-loss"


def test_a_detached_ratio_is_caught():
    def trl_ratio_detached(logp, ref_logp, old_logp, mask):
        return torch.exp(logp - old_logp).detach() * kl_presets._k3(logp, ref_logp)

    assert verdict_of("trl-grpo-k3-corrected")["on_policy"]["equals"] == "token-level reverse KL"
    after = verdict_of("trl-grpo-k3-corrected", trl_ratio_detached)
    assert after["on_policy"]["equals"] == "K3-in-loss"  # on-policy a detached ratio is 1


def test_a_clamp_on_the_wrong_side_is_caught():
    def openrlhf_weight_floored(logp, ref_logp, old_logp, mask):
        # min(w, 10) written as max(w, 10): every weight at least 10
        weight = torch.exp(logp - old_logp).clamp(min=10.0).detach()
        surrogate = weight * kl_presets._k2(logp, ref_logp)
        return kl_presets._straight_through(kl_presets._openrlhf_estimate(logp, ref_logp, "k3"),
                                            surrogate)

    def slime_clamp_before_the_ratio(logp, ref_logp, old_logp, mask):
        # clamp(K3) then the ratio, where slime clamps the product
        return torch.exp(logp - old_logp) * kl_presets._k3(logp, ref_logp).clamp(-10, 10)

    after = verdict_of("openrlhf-unbiased-gradient", openrlhf_weight_floored)
    assert after["on_policy"]["equals"] is None
    before = verdict_of("slime-unbiased-kl")
    after = verdict_of("slime-unbiased-kl", slime_clamp_before_the_ratio)
    assert after["off_policy"]["rel_bias"] != pytest.approx(before["off_policy"]["rel_bias"],
                                                            rel=1e-6)


# ---- verdicts.json and the documents generated from it -------------------------------------------

@pytest.fixture(scope="module")
def committed():
    return json.loads((STUDY / "verdicts.json").read_text())


def test_verdicts_json_regenerates_byte_for_byte(committed):
    text = (STUDY / "verdicts.json").read_text()
    assert verdicts.dumps(verdicts.build()) == text


def test_the_documents_tables_are_verdicts_json(committed):
    for path, renderers in verdicts.BLOCKS.items():
        text = path.read_text()
        assert verdicts.render(text, renderers, committed) == text, path
    peers = (ROOT / "docs" / "peers.md").read_text()
    assert peers.index("<!-- verdicts.py: table -->") < peers.index("\n## ")  # it opens the page
    for row in committed["rows"]:
        if row["library"] != "this project" or row["id"] == "project-weighted":
            assert f"| `{row['id']}` |" in peers


def test_smollm2_is_inherited_by_equal_expectations_only(committed):
    rows = {row["id"]: row for row in committed["rows"]}
    whole = json.loads((ROOT / "studies" / "kl-gradients-whole" / "results.json").read_text())
    (step20,) = [d for d in whole["distances"] if d["label"] == "step 20"]
    k2 = step20["views"]["model"]["rows"]["k2_loss"]
    for preset_id in ("verl-k3plus-loss", "trl-grpo-k3-corrected", "openrlhf-unbiased-gradient"):
        measured = rows[preset_id]["smollm2"]
        assert measured["row"] == "K2-in-loss" and measured["how"].startswith("inherited")
        assert measured["step 20"]["cos"] == pytest.approx(k2["cos"], rel=1e-9)
    # a clamp that acts on the toy's far settings: not K3-in-loss, not K1-in-reward, but a row
    # of its own in studies/peer-kl/smollm2/ (its figures are that run's), or none
    own = json.loads((STUDY / "smollm2" / "results.json").read_text()) if (
        STUDY / "smollm2" / "results.json").is_file() else None
    for preset_id in ("verl-low-var-kl-loss", "skyrl-k3-loss", "openrlhf-k1-reward", "nemo-k3"):
        measured = rows[preset_id]["smollm2"]
        if own is None:
            assert measured is None
            continue
        assert measured["row"] is None and measured["how"].startswith("measured: its own row")
        (distance,) = [d for d in own["distances"] if d["label"] == "step_20"]  # --policy step_20
        row = distance["views"]["layer"]["terms"][f"preset:{preset_id}"]
        assert measured["step 20"]["cos"] == pytest.approx(row["cos"], rel=1e-9)
        assert measured["step 20"]["exact_row"] == (preset_id != "skyrl-k3-loss")
    assert rows["verl-k3plus-reward"]["smollm2"]["row"] == "K3-in-reward, verl's clamp"
    assert rows["project-k3-loss"]["smollm2"]["how"] == "measured"
    # the rule itself: equal E[g] in every setting, or nothing
    same = verdicts.same_expectation
    assert same(preset_gradients("trl-grpo-k3"), preset_gradients("paper-k3-loss"))
    assert not same(preset_gradients("verl-low-var-kl-loss"), preset_gradients("paper-k3-loss"))


def test_every_registered_prediction_is_parsed():
    predicted = verdicts.predictions()
    assert set(predicted) == set(PRESETS)
    assert predicted["slime-k1-loss"] == (None, "0", None)
    assert predicted["trl-grpo-k3-corrected"] == ("token-level reverse KL", None, None)
    assert predicted["tba-prime-k3-loss"] == ("0", None, "0")
    assert predicted["paper-k3-reward"] == ("K3-in-reward", None, None)
