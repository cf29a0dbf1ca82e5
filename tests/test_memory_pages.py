"""Huge pages for the CPU's large tensors (issue 62; docs/benchmarks.md, "Huge pages"): runtime.start
asks PyTorch's allocator for them before the process's first allocation. Read from the kernel's own
account of the process (/proc/self/smaps): whether the mapping that holds a tensor may take huge
pages (THPeligible).
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(not THP_MODE.exists() or "[never]" in THP_MODE.read_text(),
                    reason="needs a kernel with transparent huge pages on (always or madvise)")
def test_start_puts_large_cpu_tensors_where_huge_pages_may_back_them():
    """A fresh process that calls runtime.start and then allocates 64 MB: the tensor's mapping is
    THP-eligible (in madvise mode only because the allocator madvised it); with the user's
    THP_MEM_ALLOC_ENABLE=0 it is not, in madvise mode."""
    probe = (
        "import os, torch; from pathlib import Path; from systems import runtime; runtime.start()\n"
        "x = torch.ones(16 * 2**20)\n"
        "lines, inside = Path('/proc/self/smaps').read_text().splitlines(), False\n"
        "for line in lines:\n"
        "    fields = line.split()\n"
        "    if '-' in fields[0] and not fields[0].endswith(':'):\n"
        "        low, high = (int(v, 16) for v in fields[0].split('-'))\n"
        "        inside = low <= x.data_ptr() < high\n"
        "    elif inside and fields[0] == 'THPeligible:':\n"
        "        print(fields[1])\n")

    def eligible(env):
        result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, check=True,
                                capture_output=True, text=True)
        return result.stdout.split() == ["1"]

    base = {key: value for key, value in os.environ.items() if key != "THP_MEM_ALLOC_ENABLE"}
    base["PYTHONPATH"] = str(ROOT)
    assert eligible(base)
    if "[madvise]" in THP_MODE.read_text():
        assert not eligible({**base, "THP_MEM_ALLOC_ENABLE": "0"})
