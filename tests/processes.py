"""Processes seen from /proc, for the tests that interrupt a program and check that its ranks are gone.

- `children(pid)`: the processes whose parent is `pid`;
- `gone(pid)`: it no longer runs (exited, or a zombie left for a reaper that is not the program under test);
- `interrupted_line(stderr, program)`: the program's one line after Ctrl-C, asserting there is no traceback;
- `assert_gone(pids)`: waits up to RANKS_GONE_S for every one of `pids` to be gone, then asserts it.
"""

import os
import time

# The programs terminate their ranks on the way out and kill them 10 s later (tools/bench/runner.py,
# sglang_checks/trainer.py); a little more for the kernel to reap them.
RANKS_GONE_S = 15


def children(pid):
    """Processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def gone(pid):
    """True when `pid` no longer runs (exited, or a zombie waiting for a reaper that is not the program tested)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def interrupted_line(stderr, program):
    """The program's own line after Ctrl-C: the last line, the only one that is the program's, and no traceback.
    Other lines come from libraries in the ranks (c10d warns that it cannot resolve its hostname in a sandbox)."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert [line for line in lines if line.startswith(f"{program}:")] == lines[-1:], stderr
    return lines[-1]


def assert_gone(pids, within_s=RANKS_GONE_S):
    """Every process of `pids` is gone within `within_s` seconds (the ranks of a program that has exited)."""
    deadline = time.monotonic() + within_s
    while not all(gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(gone(pid) for pid in pids), [pid for pid in pids if not gone(pid)]
