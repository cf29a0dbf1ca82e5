"""lab/check_kl.py through its public interface: Table 1 (test_kl.py's exact lines) on- and
off-policy, its numbers against test_kl.py's hand-derived references, injected bugs in a term
changing the verdict, and every bad input's one line."""
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import test_kl
from lab import check_kl
from lab.check_kl import SETTINGS, TermError, check, exact_gradients

ROOT = Path(__file__).resolve().parents[1]


# ---- terms, written here as a user writes them: FUNCTION(logp, ref_logp, old_logp, mask) ---------

def k1(logp, ref_logp, old_logp, mask):
    return logp - ref_logp  # eq. 11


def k2(logp, ref_logp, old_logp, mask):
    return 0.5 * (logp - ref_logp) ** 2


def k3(logp, ref_logp, old_logp, mask):
    log_r = ref_logp - logp  # eq. 14: r - 1 - log r
    return torch.expm1(log_r) - log_r


def no_kl(logp, ref_logp, old_logp, mask):
    return 0 * logp


def weighted(logp, ref_logp, old_logp, mask):
    """kl.off_policy_kl_loss per token: w sg[K1] of the sequence, spread over its tokens."""
    log_w = (mask * (logp - old_logp)).sum(-1, keepdim=True)
    k1_sequence = (mask * (logp - ref_logp)).sum(-1, keepdim=True).detach()
    return (torch.exp(log_w) * k1_sequence / mask.sum(-1, keepdim=True)).expand_as(logp)


def k3_ratio_corrected(logp, ref_logp, old_logp, mask):
    """DeepSeek-V3.2's correction (TRL's use_bias_correction_kl): pi/mu (differentiable) x K3."""
    return torch.exp(logp - old_logp) * k3(logp, ref_logp, old_logp, mask)


def k3_straight_through(logp, ref_logp, old_logp, mask):
    """K3 x exp(x - sg[x]), x = logp: value K3, gradient grad K3 + K3 grad log pi."""
    return k3(logp, ref_logp, old_logp, mask) * torch.exp(logp - logp.detach())


# ---- Table 1 through check() ---------------------------------------------------------------------

# (term, place, on-policy verdict): test_kl.py's test_expected_gradients_table1 and
# test_variable_lengths_table1 (and the KL to go, and --place weighted)
TABLE1 = [(k1, "reward", "grad KL"), (k1, "loss", "0"), (k3, "reward", "K3-in-reward"),
          (k3, "loss", "K3-in-loss"), (k1, "both", "grad KL"), (k3, "both", "grad KL"),
          (k2, "loss", "token-level reverse KL"), (no_kl, "loss", "0"),
          (k1, "reward-to-go", "grad KL"), (weighted, "loss", "grad KL")]


@pytest.mark.parametrize("term, place, equals", TABLE1,
                         ids=[f"{t.__name__}-{p}" for t, p, _ in TABLE1])
def test_table1_on_policy_and_off_policy(term, place, equals):
    result = check(term, place)
    assert result["on_policy"]["equals"] == equals
    assert result["on_policy"]["equals_at_fixed_length"] == equals
    assert set(result) == {"on_policy", "off_policy"}
    if equals == "grad KL":
        assert result["on_policy"]["cos"] == pytest.approx(1, abs=1e-9)
        assert result["on_policy"]["rel_bias"] < 1e-9
    else:
        assert result["on_policy"]["rel_bias"] > 1e-3
    # off-policy every configuration of Table 1 is biased (sec. 3.2; test_off_policy_table1), and
    # the sequence-level weight is not
    off = result["off_policy"]
    if term is weighted:
        assert off["equals"] == "grad KL" and off["rel_bias"] < 1e-9
    elif term is not no_kl:
        assert off["equals"] is None and off["rel_bias"] > 1e-3 and off["cos"] < 1 - 1e-6
    # token-mean and sum differ by the constant E[T] only
    assert check(term, place, "sum") == result


LOSS_ROWS = [row for row in TABLE1 if row[1] == "loss" and row[0] is not no_kl]


@pytest.mark.parametrize("term, place, equals", LOSS_ROWS,
                         ids=[t.__name__ for t, _, _ in LOSS_ROWS])
def test_seq_mean_has_a_constant_at_a_fixed_length_only(term, place, equals):
    """At a fixed T the per-sequence mean is the sum / T; with EOS lengths 1 / T_y weights each
    sequence, and no constant undoes it (even K1-in-loss's 0 is lost)."""
    result = check(term, place, "seq-mean")["on_policy"]
    assert result["equals_at_fixed_length"] == equals and result["equals"] is None


def test_ratio_options_on_policy_are_all_the_score_term():
    for ratio in check_kl.RATIOS:
        assert check(k1, "reward", ratio=ratio)["on_policy"]["equals"] == "grad KL"
    # off-policy with no ratio at all: E_mu[K1 grad log pi(y)], biased
    assert check(k1, "reward", ratio="none")["off_policy"]["equals"] is None


def test_sequence_product_ratio_is_the_sequence_importance_weight():
    """TRL's RLOO: -A pi(y)/mu(y) once a sequence. On-policy the score term (grad KL for K1);
    off-policy, with the KL taken at the rollout (log mu/pi_ref), E_mu[(pi/mu) K grad log pi(y)] =
    grad_theta sum_y pi(y) sg[sum_t log mu_t/pi_ref_t]: written here from the sequences."""
    assert check(k1, "reward", "sum", "sequence-product")["on_policy"]["equals"] == "grad KL"
    rows = exact_gradients(k1, "reward", "sum", "sequence-product", off_policy=True)
    gspo = exact_gradients(k1, "reward", "sum", "sequence", off_policy=True)
    for index, (T, eos, theta, mu, ref) in enumerate(SETTINGS):
        m = check_kl.responses(T, eos, theta, ref)
        mu_logp = check_kl.responses(T, eos, mu, ref)["logp"].detach()
        k1_of_mu = (m["mask"] * (mu_logp - m["ref_logp"].detach())).sum(-1)
        by_hand = torch.stack(torch.autograd.grad((m["logp"].sum(-1).exp() * k1_of_mu).sum(),
                                                  m["params"]))
        assert test_kl.close(rows[index][1], by_hand), SETTINGS[index]
        assert not test_kl.close(gspo[index][1], by_hand)  # GSPO's mean ratio is another weight


def test_the_far_settings_make_the_clamps_act():
    """Two settings where pi, pi_ref (and mu) are far apart: some of pi's tokens have K1 > 10 and
    K3 > 10, some of mu's have pi/mu > 10; a clamp there changes the verdict, at those settings
    only."""
    far = [s for s, name in zip(SETTINGS, check_kl.SETTING_NAMES) if "far" in name]
    assert {eos for _, eos, *_ in far} == {False, True}
    for T, eos, theta, mu, ref in far:
        m, s = check_kl.responses(T, eos, theta, ref), check_kl.responses(T, eos, mu, ref)
        logp, ref_logp, mask = m["logp"].detach(), m["ref_logp"].detach(), m["mask"]
        k3_value = k3(logp, ref_logp, None, mask) * mask
        pi_prob, mu_prob = logp.sum(-1).exp(), s["logp"].detach().sum(-1).exp()
        ratio = (logp - s["logp"].detach()).exp() * mask
        assert (pi_prob * ((k3_value > 10).any(-1) & (k3_value < 10).any(-1))).sum() > 0.1
        assert (pi_prob * ((logp - ref_logp) * mask > 10).any(-1)).sum() > 0.1
        assert (mu_prob * (ratio > 10).any(-1)).sum() > 0.05
    near = ["T=3", "T=5", "EOS<=3", "EOS<=5"]
    clamped_k3 = check(lambda *a: k3(*a).clamp(-10, 10), "loss")["on_policy"]
    assert clamped_k3["equals"] is None
    assert clamped_k3["equals_by_setting"] == {**dict.fromkeys(near, "K3-in-loss"),
                                               "T=3 far": None, "EOS<=3 far": None}
    clamped_k1 = check(lambda *a: k1(*a).clamp(-10, 10), "reward")["on_policy"]
    assert clamped_k1["equals"] is None and clamped_k1["rel_bias"] > 1e-3
    assert [clamped_k1["equals_by_setting"][name] for name in near] == ["grad KL"] * 4
    # an importance weight clamped at 10 (OpenRLHF's KL_IS_WEIGHT_CLIP) acts off-policy only

    def clipped_weight(logp, ref_logp, old_logp, mask):
        weight = torch.exp(logp - old_logp).clamp(max=10.0)
        return weight * k3(logp, ref_logp, old_logp, mask)

    result = check(clipped_weight, "loss")
    assert result["on_policy"]["equals"] == "token-level reverse KL"
    assert result["off_policy"]["equals"] is None
    assert result["off_policy"]["equals_by_setting"]["T=3"] == "token-level reverse KL"
    assert "except at T=3 far, EOS<=3 far" in check_kl.describe(clamped_k3)


# ---- the numbers behind the verdicts, against test_kl.py's hand-derived references ---------------

def closed_forms(setting, off_policy):
    """test_kl.py's closed forms at one of the checker's settings: (dict of (params,) tensors)."""
    T, eos, theta, mu, ref = setting
    if eos:
        m = test_kl.toy_with_eos(T, theta, ref)
        return test_kl.eos_references(m), None
    m = test_kl.toy(T, theta, ref)
    refs = test_kl.references(m)
    hand = test_kl.off_policy_references(m, test_kl.behaviour(m, mu)) if off_policy else None
    return refs, hand


def test_exact_gradients_are_test_kl_closed_forms():
    rows = {(term.__name__, place): exact_gradients(term, place)
            for term, place in [(k1, "reward"), (k1, "loss"), (k3, "loss"), (k3, "reward"),
                                (k2, "loss")]}
    for index, setting in enumerate(SETTINGS):
        refs, _ = closed_forms(setting, False)
        expected = {("k1", "reward"): refs["true"], ("k1", "loss"): 0 * refs["true"],
                    ("k3", "loss"): refs["eq41"],
                    ("k3", "reward"): refs["true"] + refs["eq19"] - refs.get("length", 0)}
        if not setting[1]:
            expected[("k2", "loss")] = refs["k2_path"]
        for key, value in expected.items():
            assert test_kl.close(rows[key][index][1], value), (setting, key)
        # the checker's own known gradients (module docstring) are test_kl.py's too
        known = rows["k1", "reward"][index][2]
        assert test_kl.close(known["grad KL"], refs["true"])
        assert test_kl.close(known["K3-in-loss"], refs["eq41"])
        assert test_kl.close(known["K3-in-reward"], expected["k3", "reward"])
        if not setting[1]:
            assert test_kl.close(known["token-level reverse KL"], refs["k2_path"])


def test_off_policy_gradients_are_test_kl_closed_forms():
    """test_off_policy_table1's hand-written lines: K1-in-reward, K1-in-loss, K3-in-loss under
    mu."""
    rows = {(term.__name__, place): exact_gradients(term, place, off_policy=True)
            for term, place in [(k1, "reward"), (k1, "loss"), (k3, "loss"), (k1, "both"),
                                (weighted, "loss")]}
    for index, setting in enumerate(SETTINGS):
        if setting[1]:
            continue  # test_kl.py writes the off-policy lines for fixed lengths
        refs, hand = closed_forms(setting, True)
        assert test_kl.close(rows["k1", "reward"][index][1], hand["k1_reward"])
        assert test_kl.close(rows["k1", "loss"][index][1], hand["k1_loss"])
        assert test_kl.close(rows["k3", "loss"][index][1], hand["k3_loss"])
        assert test_kl.close(rows["k1", "both"][index][1], hand["k1_reward"] + hand["k1_loss"])
        assert test_kl.close(rows["weighted", "loss"][index][1], refs["true"])


def test_the_ratio_corrected_k3_is_the_token_level_reverse_kl_by_hand():
    """For Bernoulli tokens d/dz KL(Bern(p) || Bern(q)) = p (1 - p) (z - z~) (test_kl's k2_path),
    summed over the prefixes of mu off-policy: what pi/mu x K3 in the loss gives."""
    for index, (T, eos, theta, mu, ref) in enumerate(SETTINGS):
        if eos:
            continue
        m = test_kl.toy(T, theta, ref)
        z, z_ref, c = m["z"].detach(), m["z_ref"], m["c"]
        p = torch.sigmoid(z)
        per_token = p * (1 - p) * (z - z_ref)
        mu_prob = test_kl.behaviour(m, mu).sum(-1).exp()
        by_hand = (mu_prob[:, None, None] * torch.stack([per_token, per_token * c], -1)).sum((0, 1))
        got = exact_gradients(k3_ratio_corrected, "loss", off_policy=True)[index][1]
        assert test_kl.close(got, by_hand)


# ---- injected bugs in a term change the verdict --------------------------------------------------

def test_injected_bugs_in_a_term_change_the_verdict():
    # the straight-through trick: K3 x exp(logp - sg[logp]) is the token-level reverse KL;
    # a dropped detach leaves exp(0) = 1, plain K3-in-loss
    assert check(k3_straight_through, "loss")["on_policy"]["equals"] == "token-level reverse KL"
    dropped = lambda logp, ref, old, mask: k3(logp, ref, old, mask) * torch.exp(logp - logp)  # noqa
    assert check(dropped, "loss")["on_policy"]["equals"] == "K3-in-loss"
    # the ratio-corrected K3: the token-level reverse KL on- and off-policy (prefixes of mu);
    # with the ratio detached it is K3-in-loss (eq. 41) in both
    corrected = check(k3_ratio_corrected, "loss")
    assert {r["equals"] for r in corrected.values()} == {"token-level reverse KL"}
    detached = lambda logp, ref, old, mask: (  # noqa: E731
        torch.exp(logp - old).detach() * k3(logp, ref, old, mask))
    assert {r["equals"] for r in check(detached, "loss").values()} == {"K3-in-loss"}
    # a clamp on the wrong side: K3 >= 0 guarded by clamp(min=0) is K3; clamp(max=0) kills it
    assert check(lambda *a: k3(*a).clamp(min=0), "loss")["on_policy"]["equals"] == "K3-in-loss"
    assert check(lambda *a: k3(*a).clamp(max=0), "loss")["on_policy"]["equals"] == "0"
    # verl's k3+: K3's value with K2's gradient, K3.detach() + K2 - K2.detach(): the token-level
    # reverse KL (as K2-in-loss); a dropped detach on K3 adds K3-in-loss's gradient
    k3_plus = lambda logp, ref, old, mask: (  # noqa: E731
        k3(logp, ref, old, mask).detach() + k2(logp, ref, old, mask)
        - k2(logp, ref, old, mask).detach())
    assert check(k3_plus, "loss")["on_policy"]["equals"] == "token-level reverse KL"
    k3_plus_dropped = lambda logp, ref, old, mask: (  # noqa: E731
        k3(logp, ref, old, mask) + k2(logp, ref, old, mask) - k2(logp, ref, old, mask).detach())
    result = check(k3_plus_dropped, "loss")
    assert result["on_policy"]["equals"] is None and result["on_policy"]["rel_bias"] > 0.5
    # not every missing detach is a bug: w K1 with K1 not detached is the full gradient of
    # E_mu[w K1] = KL, so grad KL on- and off-policy (its extra E_pi[grad log pi(y)] is 0)
    undetached = lambda logp, ref, old, mask: (  # noqa: E731
        torch.exp((mask * (logp - old)).sum(-1, keepdim=True))
        * (mask * (logp - ref)).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)
    ).expand_as(logp)
    assert {r["equals"] for r in check(undetached, "loss").values()} == {"grad KL"}


# ---- the command line ----------------------------------------------------------------------------

def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "lab.check_kl", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_cli_plain_and_json(tmp_path):
    here = f"{Path(__file__).resolve()}"
    plain = run_cli(f"{here}:k3", "--place", "loss")
    assert plain.returncode == 0, plain.stderr
    lines = plain.stdout.splitlines()
    assert lines[1] == ("on-policy:  equals K3-in-loss (eq. 41); "
                        "biased: cos 0.9779, relative bias 0.81")
    assert lines[2].startswith("off-policy: biased: cos ")
    out = run_cli(f"{here}:k1", "--place", "reward", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)  # exactly one JSON object
    assert out.stdout.count("\n") == 1 and result == check(k1, "reward")
    assert result["on_policy"]["equals"] == "grad KL" and result["off_policy"]["equals"] is None
    assert set(result["on_policy"]) >= {"equals", "cos", "rel_bias"}
    unbiased = run_cli(f"{here}:k1", "--place", "reward")
    assert unbiased.stdout.splitlines()[1] == "on-policy:  unbiased"
    # what a user's file prints (at import, in the term) goes to stderr: stdout stays one object
    (tmp_path / "noisy.py").write_text("print('importing')\n"
                                       "def f(logp, ref_logp, old_logp, mask):\n"
                                       "    print('called')\n    return logp - ref_logp\n")
    noisy = run_cli(f"{tmp_path / 'noisy.py'}:f", "--place", "reward", "--json")
    assert json.loads(noisy.stdout) == result and "importing" in noisy.stderr


def one_error_line(capsys, argv):
    assert check_kl.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert "Traceback" not in captured.err
    return captured.err


BAD_TERMS = {
    "raises": ("def f(logp, ref_logp, old_logp, mask):\n    raise RuntimeError('boom')\n",
               "the term raised RuntimeError: boom"),
    "shape": ("def f(logp, ref_logp, old_logp, mask):\n    return (logp - ref_logp).sum(-1)\n",
              "the term returned shape"),
    "not_tensor": ("def f(logp, ref_logp, old_logp, mask):\n    return 0.0\n",
                   "the term returned a float, not a (B, T) tensor"),
    "no_grad": ("def f(logp, ref_logp, old_logp, mask):\n    return (logp - ref_logp).detach()\n",
                "the term has no gradient in logp"),
    "nan": ("def f(logp, ref_logp, old_logp, mask):\n    return logp * float('nan')\n",
            "the term returned NaN or inf"),
    "float32": ("def f(logp, ref_logp, old_logp, mask):\n    return (logp - ref_logp).float()\n",
                "the term returned float32: keep float64"),
    "batch_statistic": ("def f(logp, ref_logp, old_logp, mask):\n"
                        "    return (logp - ref_logp) - (logp - ref_logp).detach().mean()\n",
                        "depends on the other sequences of the batch"),
    "signature": ("def f(logp, ref_logp):\n    return logp - ref_logp\n",
                  "the term raised TypeError: f() takes 2 positional arguments but 4 were given"),
    "nan_grad": ("import torch\ndef f(logp, ref_logp, old_logp, mask):\n"
                 "    return torch.sqrt(logp - logp.detach())\n", "gradient is NaN or inf"),
}


@pytest.mark.parametrize("name", BAD_TERMS)
def test_a_bad_term_gives_one_line(tmp_path, capsys, name):
    source, message = BAD_TERMS[name]
    (tmp_path / "term.py").write_text("import torch\n" + source)
    err = one_error_line(capsys, [f"{tmp_path / 'term.py'}:f", "--place", "loss"])
    assert err.startswith(f"check_kl: {tmp_path / 'term.py'}:f: ") and message in err, err
    with pytest.raises(TermError, match=message.split(":")[0][:20]):
        namespace = {}
        exec("import torch\n" + source, namespace)
        check(namespace["f"], "loss")


def test_bad_files_give_one_line(tmp_path, capsys):
    assert "no such file" in one_error_line(capsys, [f"{tmp_path}/absent.py:f", "--place", "loss"])
    (tmp_path / "broken.py").write_text("def f(:\n")
    assert "broken.py does not import: SyntaxError" in one_error_line(
        capsys, [f"{tmp_path}/broken.py:f", "--place", "loss"])
    (tmp_path / "missing_import.py").write_text("import no_such_module_here\n")
    assert "does not import: ModuleNotFoundError" in one_error_line(
        capsys, [f"{tmp_path}/missing_import.py:f", "--place", "loss"])
    (tmp_path / "exits.py").write_text("raise SystemExit(3)\n")
    assert "exits.py does not import: SystemExit" in one_error_line(
        capsys, [f"{tmp_path}/exits.py:f", "--place", "loss"])
    (tmp_path / "fine.py").write_text("x = 1\n")
    assert "has no function 'f'" in one_error_line(capsys, [f"{tmp_path}/fine.py:f", "--place",
                                                            "loss"])
    assert "is not a function" in one_error_line(capsys, [f"{tmp_path}/fine.py:x", "--place",
                                                          "loss"])
    assert "expected FILE.py:FUNCTION" in one_error_line(capsys, [f"{tmp_path}/fine.py",
                                                                  "--place", "loss"])
    assert "--place is required" in one_error_line(capsys, [f"{tmp_path}/fine.py:x"])
    # --model's own refusal comes after the exact verdict, before any model is loaded
    (tmp_path / "term.py").write_text("def k1(logp, ref_logp, old_logp, mask):\n"
                                      "    return logp - ref_logp\n")
    assert "--groups 2: at least 4" in one_error_line(capsys, [f"{tmp_path}/term.py:k1", "--place",
                                                               "loss", "--model", "--groups", "2"])


def test_cli_error_in_a_real_process_is_one_line(tmp_path):
    (tmp_path / "term.py").write_text("def f(logp, ref_logp, old_logp, mask):\n"
                                      "    raise KeyError('logits')\n")
    out = run_cli(f"{tmp_path / 'term.py'}:f", "--place", "reward")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == f"check_kl: {tmp_path / 'term.py'}:f: the term raised KeyError: 'logits'\n"


def test_presets(monkeypatch, capsys):
    """--preset ID through a stand-in lab.kl_presets (the real one is another branch's)."""
    presets = types.ModuleType("lab.kl_presets")
    presets.PRESETS = {"fake-k3-loss": dict(place="loss", aggregate="token-mean", term=k3),
                       "fake-k1-reward": dict(place="reward", ratio="token", term=k1)}
    monkeypatch.setitem(sys.modules, "lab.kl_presets", presets)
    assert check_kl.main(["--preset", "fake-k3-loss", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == check(k3, "loss")
    assert check_kl.main(["--preset", "fake-k1-reward"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == "on-policy:  unbiased"
    # a flag given overrides the preset's
    assert check_kl.main(["--preset", "fake-k3-loss", "--aggregate", "seq-mean", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == check(k3, "loss", "seq-mean")
    assert "not both" in one_error_line(capsys, [f"{Path(__file__).resolve()}:k1", "--preset",
                                                 "fake-k3-loss"])
    assert "unknown preset 'nope': choose one of fake-k3-loss, fake-k1-reward" in one_error_line(
        capsys, ["--preset", "nope"])
    monkeypatch.setitem(sys.modules, "lab.kl_presets", None)  # as if the file were absent
    assert one_error_line(capsys, ["--preset", "fake-k3-loss"]) == (
        "check_kl: no presets here: lab/kl_presets.py is absent\n")


def test_show_prints_each_settings_numbers(capsys):
    assert check_kl.main([f"{Path(__file__).resolve()}:k1", "--place", "reward", "--show"]) == 0
    lines = capsys.readouterr().out.splitlines()[3:]
    assert len(lines) == 2 * len(SETTINGS)
    # on-policy K1-in-reward: E[g] is grad KL, digit for digit
    for line in lines[:len(SETTINGS)]:
        g, true = line.split("E[g] ")[1].split(", grad KL ")
        assert g.rstrip(",") == true
