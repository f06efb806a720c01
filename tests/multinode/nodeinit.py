"""The init process of one Ray node's namespace: `python nodeinit.py STATUS_FD CMD...`.

It runs CMD (`ray start ...`), writes CMD's exit code as one line to file descriptor STATUS_FD
(a pipe from the cluster's owner) and closes it; then,
if CMD succeeded, stays alive reaping orphans until it is killed. `ray start` daemonizes the
node's processes and exits; orphans are normally adopted by pid 1, which on some machines never
reaps them, so every killed Ray process would linger as a zombie. As a child subreaper this
process adopts them instead, and the owner of the cluster reaps this one.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def main(status_fd: int, cmd: list[str]) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print(f"prctl(PR_SET_CHILD_SUBREAPER) failed: errno {ctypes.get_errno()}", flush=True)
    rc = subprocess.call(cmd)  # close_fds: CMD's daemons never hold the status pipe
    os.write(status_fd, f"{rc}\n".encode())
    os.close(status_fd)
    if rc != 0:
        return rc
    while True:
        try:
            os.wait()
        except ChildProcessError:  # no child right now; orphans may be adopted later
            time.sleep(1.0)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2:]))
