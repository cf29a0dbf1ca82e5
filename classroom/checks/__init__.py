"""One module per exercise, e1_*.py .. e8_*.py, each with OWN (the project modules the exercise
writes), OTHERS (modules its child may import, with a placeholder if they do not), PATCH (the
functions of other exercises replaced by stand-ins in its child) and tests(seed, hidden): a list of
dict(name, points, hint, seconds (per case), cases [(label, params)], check(params, run)). A check
calls run(probe, **inputs) for the submission's outputs (probes.py, in the child), computes the
expected values itself and raises harness.Wrong."""
