"""rollout.py as it stood at a commit, imported beside the working tree's: the "before" side of the
sampling A/B studies (sampling-ab/ab.py, norms-rope-cpu/)."""
import importlib.util
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rollout_at(commit):
    """The module rollout.py was at `commit` (written to /tmp, imported under its own name)."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:rollout.py"],
                            capture_output=True, text=True, check=True).stdout
    path = Path(f"/tmp/rollout_{commit}.py")
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"rollout_{commit}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
