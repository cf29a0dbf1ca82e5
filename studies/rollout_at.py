"""A root module as it stood at a commit, imported beside the working tree's: the "before" side of
the A/B studies (rollout.py for sampling-ab/ab.py and norms-rope-cpu/; segment_attention.py for
sequences-cpu/)."""
import importlib.util
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_at(commit, name):
    """The module `name`.py was at `commit` (written to /tmp, imported under its own name)."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:{name}.py"],
                            capture_output=True, text=True, check=True).stdout
    path = Path(f"/tmp/{name}_{commit}.py")
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"{name}_{commit}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rollout_at(commit):
    """rollout.py at `commit`."""
    return module_at(commit, "rollout")
