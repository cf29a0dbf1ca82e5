"""A CPU run keeps the memory it frees (issue 62; docs/benchmarks.md, "Every freed block kept"):
runtime.start sets glibc's allocator to serve every block from its heap and never trim it, so a
pass's freed tensors are the next pass's, their pages resident. Read from the kernel's own account
of the process (/proc/self/statm's resident pages) in a fresh process.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from systems import runtime

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(runtime._libc is None or not Path("/proc/self/statm").exists(),
                    reason="needs glibc and Linux's /proc")
@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="runtime.start keeps freed memory on a CPU run only")
def test_a_cpu_run_keeps_the_pages_it_frees():
    """After runtime.start, a 256 MB tensor freed leaves its pages resident, and the next tensor
    of its size takes its address (no page faulted in again); without the start (the control),
    or with glibc's allocator set by the environment (lab/memory_plan.py --measure's pages of
    their own), glibc unmaps it when it is freed."""
    probe = (
        "import os, sys, torch; from systems import runtime\n"
        "if sys.argv[1] == 'start':\n"
        "    runtime.start()\n"
        "page = os.sysconf('SC_PAGE_SIZE')\n"
        "resident = lambda: int(open('/proc/self/statm').read().split()[1]) * page\n"
        "x = torch.ones(64 * 2**20)\n"
        "before, address = resident(), x.data_ptr()\n"
        "del x\n"
        "after = resident()\n"
        "print(before - after, torch.ones(64 * 2**20).data_ptr() == address)\n")

    def freed_bytes_and_same_address(how, **settings):
        env = {**os.environ, "PYTHONPATH": str(ROOT), **settings}
        result = subprocess.run([sys.executable, "-c", probe, how], cwd=ROOT, env=env, check=True,
                                capture_output=True, text=True)
        freed, same = result.stdout.split()
        return int(freed), same == "True"

    freed, same_address = freed_bytes_and_same_address("start")
    assert freed < 16 * 2**20 and same_address
    freed, _ = freed_bytes_and_same_address("no-start")
    assert freed > 200 * 2**20
    freed, _ = freed_bytes_and_same_address("start", MALLOC_MMAP_THRESHOLD_="65536")
    assert freed > 200 * 2**20
