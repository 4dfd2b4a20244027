"""Processes seen from /proc, for the tests that interrupt a program and check that its ranks are gone, and the
lines a command-line program leaves on stderr.

- `children(pid)`: the processes whose parent is `pid`;
- `gone(pid)`: it no longer runs (exited, or a zombie left for a reaper that is not the program under test);
- `only_line(stderr)`: the one line of a program refusing bad input, asserting there is no other and no traceback;
- `interrupted_line(stderr, program)`: the program's one line after Ctrl-C, asserting there is no traceback;
- `assert_gone(pids)`: waits up to RANKS_GONE_S for every one of `pids` to be gone, then asserts it;
- `assert_interrupt_stops_ranks(proc, program, ...)`: Ctrl-C once the ranks run; exit 130, one line, no rank left.
"""

import os
import signal
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


def only_line(stderr):
    """The only non-blank line of `stderr`, asserting there is no other and no traceback."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


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


def assert_interrupt_stops_ranks(proc, program, *, stream, ready_text, ranks_start_s=60):
    """Sends Ctrl-C to `proc` (a subprocess.Popen of `program` with text stdout and stderr pipes) while its ranks run,
    then asserts the command-line contract: exit code 130, the one line `PROGRAM: interrupted`, every rank gone.
    The ranks run once a line of `stream` (proc.stdout or proc.stderr) contains `ready_text` and `proc` has at least
    two children (waited for up to `ranks_start_s`). `proc` is killed if anything fails before it exits."""
    try:
        for line in stream:
            if ready_text in line:
                break
        deadline = time.monotonic() + ranks_start_s
        while len(children(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        ranks = children(proc.pid)
        assert len(ranks) >= 2, "the ranks did not start"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert interrupted_line(err, program) == f"{program}: interrupted"
    assert_gone(ranks)
