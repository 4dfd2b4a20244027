"""Spawned torch.distributed ranks: the one rendezvous port helper and the one way a rank leaves after its work.

`free_port(host="127.0.0.1")`: a TCP port that was free a moment ago, for a rendezvous (MASTER_PORT, tcp://) or a
server (the check's SGLang engines).

`leave()`: barrier, destroy the group, flush, `os._exit(0)`. Every program here that spawns torch.distributed ranks
(the bench's TP runner, the Qwen3 check's trainer and so its calibration, the test suite's rank groups) ends a rank
that finished its work with it:

  1. `dist.barrier()`: every rank is done before any tears the group down (a peer's early exit can abort gloo);
  2. `dist.destroy_process_group()`;
  3. multiprocessing queues given to it are closed and their feeder threads joined (what `os._exit` would skip: a
     message still in a feeder thread's buffer would be lost), then stdout and stderr are flushed;
  4. `os._exit(0)`: no interpreter finalization. There, gloo's background threads have aborted a rank that had
     finished ("terminate called without an active exception", SIGABRT) and failed a passing run at random.

A rank whose work raised never gets there: the exception propagates to torch.multiprocessing (or the program's own
reporting) with its traceback, and `destroy_on_error` only frees the group on the way.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from typing import NoReturn


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago (the OS picks it; another process may take it before use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def leave(*queues, barrier: bool = True) -> NoReturn:
    """Ends a rank whose work succeeded (module docstring). `queues`: multiprocessing queues this rank put messages
    on, flushed before the exit; `barrier=False` when the caller already synchronised every rank itself."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()
    for queue in queues:
        queue.close()
        queue.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextlib.contextmanager
def destroy_on_error():
    """Around a rank's work: when it raises, the process group is destroyed and the exception goes on unchanged."""
    try:
        yield
    except BaseException:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        raise
