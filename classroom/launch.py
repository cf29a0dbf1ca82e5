"""The start of a child process (child.py runs `python -I -S -c <this file> UID GID FD ARGV...` as
the grader's user): a PID namespace of its own where the kernel allows one (root with
CAP_SYS_ADMIN), said on file descriptor FD ("1" or "0") before any submitted code runs, then the
child's user (UID -1: the grader's own), then ARGV, the probe process (probes.py). In its own
namespace the probe process is pid 1, and every process it starts dies with it; this process
waits for it and exits as it did."""
import ctypes
import os
import signal
import sys

CLONE_NEWPID = 0x20000000


def main(uid, gid, report, argv):
    confined = ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWPID) == 0
    os.write(report, b"1" if confined else b"0")
    os.close(report)
    if confined:
        pid = os.fork()  # the probe process, pid 1 of the new namespace
        if pid:
            os.closerange(0, 1 << 16)  # its pipes are its own: the grader sees them close
            status = os.waitpid(pid, 0)[1]
            if os.WIFSIGNALED(status):  # end as it ended (Python's own handlers aside)
                for sig in (signal.SIGINT, signal.SIGPIPE):
                    signal.signal(sig, signal.SIG_DFL)
                os.kill(os.getpid(), os.WTERMSIG(status))
            os._exit(os.waitstatus_to_exitcode(status))
    if uid >= 0:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    os.execv(argv[0], argv)


main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
