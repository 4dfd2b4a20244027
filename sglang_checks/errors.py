"""The one exception type for a check that cannot go on: bad input (a flag, a file, a missing package, a port in
use) or an engine server that will not start. The binary prints its message and exits with code 2, no traceback."""


class CheckError(Exception):
    """The message says what was wrong and what was expected."""
