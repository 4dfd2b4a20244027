"""The command-line contract of the absl programs here (the Qwen3 check, its calibration, layer_diff_main, the bench and
the developer tools).

    from ppo_ops.runtime import cli
    cli.run(main, program="qwen3_parallel_check")   # instead of app.run(main)

- `--help` (and `--helpshort`, `--helpfull`, `--helpxml`) prints the usage, with the program's own flags, and exits 0
  (absl alone exits 1, which for the check is its FAIL code).
- A bad flag value, an unknown flag, a stray argument or an `app.UsageError` / `BadInput` raised by `main` is ONE
  line on stderr, `PROGRAM: error: ...` naming the flag, and exit code 2 (absl alone prints the module docstring and
  exits 1).
- Ctrl-C (SIGINT) is one line, `PROGRAM: interrupted`, and exit code 130 (128 + SIGINT, the shell's convention),
  after the `finally` blocks on the way out (servers, rank processes) have run: no traceback.
- `caller_path(path)`: a relative path is the caller's: `bazel run` starts programs inside the runfiles tree and
  says where the user was in BUILD_WORKING_DIRECTORY; elsewhere it is the current directory.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import NoReturn

from absl import app, flags

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130: what a shell reports for a program ended by Ctrl-C

# absl's help flags: each prints the usage and then exits with code 1 from inside flag parsing.
_HELP_FLAGS = ("help", "helpshort", "helpfull", "helpxml", "h", "?")


class BadInput(Exception):
    """Raised by a program's main for input it refuses: printed as `PROGRAM: error: MESSAGE`, exit code 2."""


def one_line(text: str) -> str:
    """The message on one line (absl's and the OS's messages can span several)."""
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def error_exit(program: str, message, code: int = EXIT_BAD_INPUT) -> NoReturn:
    """Prints `PROGRAM: error: MESSAGE` on one line and exits with `code`."""
    print(f"{program}: error: {one_line(message)}", file=sys.stderr, flush=True)
    sys.exit(code)


def caller_path(path: str) -> str:
    """`path` made absolute against where the user ran the command (module docstring); `~` is expanded."""
    base = os.environ.get("BUILD_WORKING_DIRECTORY") or os.getcwd()
    return os.path.normpath(os.path.join(base, os.path.expanduser(path)))


def _asks_for_help(argv) -> bool:
    for arg in argv[1:]:
        if arg == "--":
            return False
        name = arg.lstrip("-").split("=", 1)[0]
        if arg.startswith("-") and name in _HELP_FLAGS:
            return True
    return False


def flags_parser(program: str):
    """An absl flags_parser for app.run (module docstring: help exits 0; bad flags are one line and exit 2)."""

    def parse(argv):
        try:
            rest = flags.FLAGS(argv)
        except flags.Error as exc:
            error_exit(program, exc)
        except SystemExit:
            if _asks_for_help(argv):
                sys.exit(0)  # the usage went to stdout, as asked
            raise
        if len(rest) > 1:
            error_exit(program, f"unexpected arguments: {' '.join(rest[1:])}")
        return rest

    return parse


def run(main, *, program: str) -> None:
    """app.run(main) under the contract of the module docstring; main's return value is the exit code."""

    def guarded(argv):
        try:
            return main(argv)
        except (app.UsageError, BadInput) as exc:
            error_exit(program, exc)
        except KeyboardInterrupt:
            print(f"{program}: interrupted", file=sys.stderr, flush=True)
            sys.exit(EXIT_INTERRUPTED)

    app.run(guarded, flags_parser=flags_parser(program))
