"""The cross-rank agreement of a call and the one host read of the value checks (validate=True).

At TP > 1 a rank never raises alone: its local error (core/checks.py) is recorded and reaches every rank through a
fixed-size header that the ranks all-gather before any collective whose shape depends on the call, so all ranks raise
the same error, naming the rank(s) at fault and the argument.

The header (int64, one entry per field of HEADER) holds what each rank can say about its call: its local error, T,
V_local, the vocabulary size, the temperature (float64 bits), the entropy mode, the keep mask's presence, the logits'
dtype, the reduction order, checksums of the row mask and of the kept rows' tokens, the kept rows' token min/max and a
flag for NaN / +inf logits taken from the rank's own forward partials, the softcap, a checksum of a per-row
temperature's fp32 reciprocals and a flag for its rejected values (a tensor of T values cannot travel in a fixed-size
header, its checksum can), then the sparse keep set's fields (its
number of ids, a checksum of ids and offsets, its offsets' error bits and id bounds: core/sparse_keep.py). The value
fields are computed on the device, so building the header costs no host sync; `read_to_host` of the gathered table
is the call's only one. At TP = 1 no header is exchanged: the token bounds, the bad-logits flag and the keep set's
values are read together after the forward, again by `read_to_host`, once.

With `validate=False` none of the value checks run and no header is exchanged: no host sync at all. Then a token out of
range gives a wrong result (its log-prob is that of a target no rank holds, -inf) instead of an error, NaN / +inf
logits give NaN outputs, and ranks that disagree on rows, tokens or options are not detected: a wrong result, or,
where their partials differ in size, an error or a wait until the process group's timeout. A local argument error
then raises on its own rank only, and the other ranks wait in the partials all-gather until that timeout.

Rows dropped by `row_mask` are not range checked: prompt rows routinely carry placeholder ids such as -100.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from typing import Callable, Mapping, NoReturn, Optional, Sequence

import torch
import torch.distributed as dist

from ppo_ops.core import sparse_keep
from ppo_ops.core.checks import (ENTROPY_MODES, FLOAT_DTYPES, REDUCTION_ORDERS, ROW_TEMPERATURE,
                                 ROW_TEMPERATURE_VALUES, argument_error, bad_inverse_rows, check_tp_group, error_prefix)
from ppo_ops.core.row_stats import MAX, SUMEXP  # the partials' channels (the bad-logits flag reads them)


# ---- the value checks: device-side bounds and flags, one host read ----

def read_to_host(t: torch.Tensor) -> list:
    """The host read of the value checks (a host sync on CUDA; HostRead below ends in it too): the only place ppo_ops
    reads device values in a call with validate=True, and it runs once per call."""
    return t.tolist()


class HostRead:
    """The same read started early: an asynchronous copy into pinned host memory behind the work queued so far, and
    an event. `values()` waits for that event only, so work queued after the copy keeps the GPU busy meanwhile
    (the token loss starts it once its last block's checks are formed, before that block's dX and dW GEMMs)."""

    def __init__(self, t: torch.Tensor):
        t = t.reshape(-1)
        if t.is_cuda:
            self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._host.copy_(t, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(t.device))  # the copy's stream, whatever the current device
        else:
            self._host, self._ready = t.clone(), None

    def values(self) -> list:
        if self._ready is not None:
            self._ready.synchronize()
        return read_to_host(self._host)  # host memory by now: counted as the call's read, no second sync


def token_bounds(tokens: torch.Tensor, row_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """[2] int64 (min, max) of the kept rows' token ids, on their device, without a host sync. Dropped rows count
    as id 0 (always in range); no rows at all gives (0, 0)."""
    t = tokens.reshape(-1).to(torch.int64)
    if t.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=tokens.device)
    if row_mask is not None:
        t = torch.where(row_mask.reshape(-1), t, torch.zeros_like(t))
    return torch.stack(torch.aminmax(t))


def _range_message(upper: int, found: int, has_row_mask: bool, where: str = "", tp_size: int = 1) -> str:
    message = (f"tokens{where} must be global token ids in [0, {upper}), found {found}"
               + (" (rows dropped by row_mask are not checked)" if has_row_mask else ""))
    if found >= upper:
        # The bound is V_local x the group's size: a missing or wrong tp_group shrinks it (tp_group=None is one rank).
        message += (f"; {upper} is this call's vocabulary (V_local x the {tp_size} rank(s) of tp_group, or "
                    "vocab_size): if this rank holds one shard of a larger vocabulary, tp_group must be that "
                    "tensor-parallel group (None means one rank)")
    return message


def check_single_rank_values(fn_name: str, bad_rows: torch.Tensor, tokens: torch.Tensor,
                             row_mask: Optional[torch.Tensor], upper: int, naming: Optional["Naming"] = None) -> None:
    """TP = 1, validate=True: reads the token bounds and the bad-logits flag in one host read and raises.
    `bad_rows` may cover only the kept rows (any length): only its any() is read."""
    raise_single_rank_values(fn_name, read_to_host(single_rank_values(bad_rows, tokens, row_mask)), row_mask, upper,
                             naming)


_BAD_LOGITS_BIT, _BAD_TEMPERATURE_BIT = 1, 2  # the single-rank read's value flags


def single_rank_values(bad_rows: torch.Tensor, tokens: torch.Tensor, row_mask: Optional[torch.Tensor],
                       extra_flags: Optional[torch.Tensor] = None,
                       row_inv_temperature: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The device-side int64 vector of the single-rank value read: token min, max, the value flags (_BAD_LOGITS_BIT;
    _BAD_TEMPERATURE_BIT from `row_inv_temperature`, the call's per-row 1 / T, where there is one: one entry, so a
    call without a per-row temperature builds it as it always did), then `extra_flags` (a [k] tensor on the same
    device: an op's own device-side checks, returned to it by raise_single_rank_values)."""
    flags = bad_rows.any().reshape(1).to(torch.int64)
    if row_inv_temperature is not None:
        flags = flags + _BAD_TEMPERATURE_BIT * bad_inverse_rows(row_inv_temperature).reshape(1).to(torch.int64)
    parts = [token_bounds(tokens, row_mask), flags]
    if extra_flags is not None:
        parts.append(extra_flags.reshape(-1).to(torch.int64))
    return torch.cat(parts)


def raise_single_rank_values(fn_name: str, values: Sequence[int], row_mask: Optional[torch.Tensor], upper: int,
                             naming: Optional["Naming"] = None) -> list:
    """Raises on the read values of single_rank_values (tokens first, then logits); returns the extras."""
    naming = LOGITS_NAMING if naming is None else naming
    lo, hi, flags, *extra = values
    bad, bad_temperature = flags & _BAD_LOGITS_BIT, flags & _BAD_TEMPERATURE_BIT
    if lo < 0 or hi >= upper:
        raise argument_error(ValueError, fn_name, "tokens", _range_message(upper, lo if lo < 0 else hi,
                                                                           row_mask is not None))
    if bad_temperature:
        raise argument_error(ValueError, fn_name, "temperature", ROW_TEMPERATURE_VALUES)
    if bad:
        raise argument_error(ValueError, fn_name, naming.bad_logits_argument, naming.bad_logits.format(where=""))
    return extra


# ---- the cross-rank header (TP > 1, validate=True) ----

def _float_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", value))[0]


def _bits_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


_DTYPES = (None,) + FLOAT_DTYPES  # the dtype field's encoding (0: none)


def _temperature_name(bits: int):
    value = _bits_float(bits)
    return "per-row tensor" if value == ROW_TEMPERATURE else value


def _softcap_name(bits: int):
    value = _bits_float(bits)
    return None if value == 0.0 else value


def _entropy_name(value: int):
    return ENTROPY_MODES[value] if 0 <= value < len(ENTROPY_MODES) else value


def _order_name(value: int):
    return REDUCTION_ORDERS[value] if 0 <= value < len(REDUCTION_ORDERS) else value


def _dtype_name(value: int):
    return str(_DTYPES[value]).replace("torch.", "") if 0 < value < len(_DTYPES) else value


@dataclasses.dataclass(frozen=True)
class HeaderField:
    """One int64 entry of the header: how errors describe it and, for a field the ranks must agree on, the argument a
    disagreement is about and how a rank's value is shown."""

    description: str
    argument: Optional[str] = None  # None: not compared across ranks (errors, per-rank bounds and flags)
    show: Callable[[int], object] = int
    checksum: bool = False  # a checksum of the argument, not its value (errors say so)


# The header's wire format, in order: entry i of every rank's header is HEADER[i].
HEADER = (
    HeaderField("error argument"),  # index + 1 into ARGUMENTS; 0: no error
    HeaderField("error type"),  # index + 1 into ERROR_TYPES
    HeaderField("number of rows T", "tokens"),
    HeaderField("V_local (logits.shape[-1])", "logits"),
    HeaderField("vocabulary size", "vocab_size"),
    HeaderField("temperature", "temperature", _temperature_name),  # float64 bits; checks.ROW_TEMPERATURE: per row
    HeaderField("entropy mode", "entropy", _entropy_name),
    HeaderField("keep_mask presence", "keep_mask", bool),
    HeaderField("logits dtype", "logits", _dtype_name),
    HeaderField("reduction order", "reduction_order", _order_name),
    HeaderField("working_memory (bytes; -1: the default)", "working_memory"),
    HeaderField("row_mask", "row_mask", checksum=True),
    HeaderField("tokens", "tokens", checksum=True),  # of the kept rows' tokens
    HeaderField("token min"),
    HeaderField("token max"),
    HeaderField("bad logits"),  # NaN / +inf in this rank's partials
    HeaderField("softcap", "softcap", _softcap_name),  # float64 bits; 0: none
    HeaderField("per-row temperature", "temperature", checksum=True),  # of the fp32 bits of 1 / T (0: none)
    HeaderField("bad per-row temperature"),  # a kept row's temperature is rejected (checks.bad_inverse_rows)
    # The sparse keep set (core/sparse_keep.py, header_values): the number of ids (-1: none), a checksum of ids and
    # offsets, then this rank's offsets error bits and id bounds.
    HeaderField("keep (number of ids; -1: none)", "keep"),
    HeaderField("keep (ids and offsets)", "keep", checksum=True),
    HeaderField("keep offsets error"),
    HeaderField("keep id min"),
    HeaderField("keep id max"),
)
(ERR_ARG, ERR_TYPE, ROWS, V_LOCAL, VOCAB, TEMPERATURE, ENTROPY, KEEP, DTYPE, ORDER, WORKING_MEMORY, ROW_SUM, TOKEN_SUM,
 TOKEN_MIN, TOKEN_MAX, BAD, SOFTCAP, TEMPERATURE_SUM, BAD_TEMPERATURE,
 SPARSE_KEEP) = range(len(HEADER) - sparse_keep.HEADER_VALUES + 1)
HEADER_FIELDS = tuple(field.description for field in HEADER)
AGREED_FIELDS = tuple(i for i, field in enumerate(HEADER) if field.argument is not None)
# Arguments an error can name in the header, and the exception types it can carry (index + 1; 0 = no error).
ARGUMENTS = ("logits", "tokens", "tp_group", "entropy", "keep_mask", "temperature", "row_mask", "vocab_size",
             "chunk_size", "inplace_grad", "backend", "validate", "arguments", "hidden", "weight", "reduce_dx",
             "token_loss", "reduction_order", "keep", "working_memory", "softcap")
ERROR_TYPES = (TypeError, ValueError, RuntimeError)


@dataclasses.dataclass(frozen=True)
class Naming:
    """How a function's value errors name its arguments: what each agreed header field is called and which argument
    it belongs to, and the NaN / +inf error ("{where}" in it becomes " on tensor-parallel rank(s) r of n" at TP > 1,
    else nothing). The logits op's is LOGITS_NAMING; the fused LM head's is LM_HEAD_NAMING (it has no logits
    argument)."""

    fields: Mapping[int, tuple]  # agreed header field -> (its description, the argument it belongs to)
    bad_logits_argument: str
    bad_logits: str


LOGITS_NAMING = Naming(
    fields={i: (HEADER[i].description, HEADER[i].argument) for i in AGREED_FIELDS},
    bad_logits_argument="logits",
    bad_logits="logits{where} contain NaN or +inf (after the temperature scaling)",
)
# The LM head's logits are hidden @ weight.T, and V_local is weight.shape[0].
LM_HEAD_NAMING = Naming(
    fields={**LOGITS_NAMING.fields, V_LOCAL: ("V_local (weight.shape[0])", "weight"),
            DTYPE: ("hidden dtype", "hidden")},
    bad_logits_argument="hidden",
    bad_logits="hidden @ weight.T{where} has NaN or +inf logits (after the temperature scaling); check hidden and "
               "weight for NaN / inf",
)


def _fold_checksum(values: torch.Tensor) -> torch.Tensor:
    """Position-weighted checksum of an int64 vector, exact in int64 (no overflow for T < 2^24)."""
    if values.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=values.device)
    weights = torch.arange(values.numel(), device=values.device, dtype=torch.int64) % 65521 + 1
    return ((values.remainder(2147483647) * weights).remainder(2147483647)).sum()


def _host_ints(values: list, device) -> torch.Tensor:
    """Python ints as an int64 tensor on `device`, copied without a host sync (a blocking host-to-device copy, as
    torch.tensor(..., device="cuda") makes, waits for the stream)."""
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)


def header_device(logits, group) -> torch.device:
    """Where the header lives: the logits' device, or (when the logits are not usable) the one the group's backend
    moves: the current CUDA device for NCCL, else the CPU."""
    if isinstance(logits, torch.Tensor) and not logits.is_meta:
        return logits.device
    if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def error_header(exc: BaseException, device) -> torch.Tensor:
    """The header of a rank whose own arguments are bad: the argument and error type, nothing else."""
    argument = getattr(exc, "ppo_ops_argument", "arguments")
    kind = next((i for i, t in enumerate(ERROR_TYPES) if isinstance(exc, t)), len(ERROR_TYPES) - 1)
    row = [0] * len(HEADER)
    row[ERR_ARG] = ARGUMENTS.index(argument if argument in ARGUMENTS else "arguments") + 1
    row[ERR_TYPE] = kind + 1
    return _host_ints(row, device)


def bad_logits(partials: torch.Tensor) -> torch.Tensor:
    """0-d bool: NaN or +inf logits reached a rank's forward partials ([segments, 5, T]; a kernel's max may skip NaN,
    the sum does not)."""
    maxima = partials[:, MAX]
    return (torch.isnan(maxima) | (maxima == math.inf) | torch.isnan(partials[:, SUMEXP])).any()


def rank_header(tokens: torch.Tensor, row_mask: Optional[torch.Tensor], bad: torch.Tensor, *, v_local: int,
                vocab_size: int, temperature: float, entropy_mode: str, has_keep_mask: bool,
                dtype: torch.dtype, reduction_order: str = "fused",
                keep: Optional["sparse_keep.SparseKeep"] = None, working_memory: Optional[int] = None,
                softcap: Optional[float] = None, row_inv_temperature: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The header of a rank whose arguments passed the local checks, its value fields computed on the device from
    its tokens, row mask, `bad` (0-d bool: NaN / +inf logits reached this rank, e.g. bad_logits of its partials),
    per-row temperature (its 1 / T, 1 in dropped rows: checks.row_inverse_temperature) and sparse keep set, with no
    host sync."""
    device = bad.device
    flat_tokens = tokens.reshape(-1).to(torch.int64)
    if row_mask is not None:
        rm = row_mask.reshape(-1)
        flat_tokens = torch.where(rm, flat_tokens, torch.zeros_like(flat_tokens))
        row_sum = _fold_checksum(rm.to(torch.int64))
    else:
        row_sum = torch.zeros((), dtype=torch.int64, device=device)
    # Every field the host knows, in one copy: the fixed fields, the softcap and, without a per-row temperature, its
    # two fields (0); sliced into their places below.
    host = _host_ints(
        [0, 0, flat_tokens.numel(), v_local, vocab_size, _float_bits(temperature), ENTROPY_MODES.index(entropy_mode),
         int(has_keep_mask), _DTYPES.index(dtype), REDUCTION_ORDERS.index(reduction_order),
         -1 if working_memory is None else working_memory, _float_bits(0.0 if softcap is None else softcap), 0, 0],
        device)
    if row_inv_temperature is None:
        transform = [host[ROW_SUM:]]  # softcap, per-row temperature checksum 0, its flag 0
    else:
        transform = [host[ROW_SUM:ROW_SUM + 1],
                     _fold_checksum(row_inv_temperature.view(torch.int32).to(torch.int64)).reshape(1),
                     bad_inverse_rows(row_inv_temperature).reshape(1).to(torch.int64)]
    return torch.cat([host[:ROW_SUM], row_sum.reshape(1), _fold_checksum(flat_tokens).reshape(1),
                      token_bounds(flat_tokens, None), bad.reshape(1).to(torch.int64), *transform,
                      sparse_keep.header_values(keep, device)])


def all_gather_into(out: torch.Tensor, tensor: torch.Tensor, group) -> None:
    """All-gathers `tensor` from every rank of `group` into `out`, rank-major along dim 0 (no list, no cat)."""
    # torch >= 2.13 names it all_gather_single and deprecates all_gather_into_tensor, the only name torch 2.11 has.
    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather_single(out, tensor.contiguous(), group=group)


def exchange_headers(header: torch.Tensor, group, world_size: int) -> list:
    """All-gathers the fixed-size headers (one small collective whose shape never depends on the call) and reads the
    table to the host: the call's one host sync. Returns one list of len(HEADER) ints per rank."""
    table = torch.empty((world_size * header.numel(),), dtype=torch.int64, device=header.device)
    all_gather_into(table, header, group)
    return read_to_host(table.view(world_size, header.numel()))


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def raise_if_any(fn_name: str, table: list, has_row_mask: bool,
                 local_error: Optional[BaseException] = None, naming: Optional[Naming] = None) -> None:
    """Decides from the gathered table, identically on every rank: local argument errors first, then the token range
    (each rank's kept tokens against its own vocabulary size), the sparse keep set's values (offsets, id range),
    then disagreement, then NaN / +inf logits.
    `local_error` is this rank's own error, appended to its message."""
    naming = LOGITS_NAMING if naming is None else naming
    world = len(table)
    p = error_prefix(fn_name)
    faulty = [r for r in range(world) if table[r][ERR_ARG]]
    if faulty:
        first = table[faulty[0]]
        exc_type = ERROR_TYPES[first[ERR_TYPE] - 1]
        what = "; ".join(f"rank {r}: {ARGUMENTS[table[r][ERR_ARG] - 1]} "
                         f"({ERROR_TYPES[table[r][ERR_TYPE] - 1].__name__})"
                         for r in faulty)
        mine = (f" This rank's error: {local_error}" if local_error is not None
                else f" See {_ranks(faulty)}'s own error for the details.")
        exc = exc_type(f"{p}invalid arguments on tensor-parallel {_ranks(faulty)} of {world} ({what}); every rank "
                       f"raises this error.{mine}")
        exc.ppo_ops_argument = ARGUMENTS[first[ERR_ARG] - 1]
        raise exc from local_error
    out_of_range = [r for r in range(world) if table[r][TOKEN_MIN] < 0 or table[r][TOKEN_MAX] >= table[r][VOCAB]]
    if out_of_range:
        row = table[out_of_range[0]]
        found = row[TOKEN_MIN] if row[TOKEN_MIN] < 0 else row[TOKEN_MAX]
        raise argument_error(
            ValueError, fn_name, "tokens",
            _range_message(row[VOCAB], found, has_row_mask, f" on tensor-parallel {_ranks(out_of_range)} of {world}",
                           tp_size=world))
    bad_temperature = [r for r in range(world) if table[r][BAD_TEMPERATURE]]
    if bad_temperature:
        raise argument_error(ValueError, fn_name, "temperature",
                             f"{ROW_TEMPERATURE_VALUES} (on tensor-parallel {_ranks(bad_temperature)} of {world})")
    keep_errors = [(r, sparse_keep.value_error(fn_name, table[r][SPARSE_KEEP:], table[r][VOCAB])) for r in range(world)]
    keep_errors = [(r, exc) for r, exc in keep_errors if exc is not None]
    if keep_errors:
        ranks = [r for r, _ in keep_errors]
        raise sparse_keep.value_error(fn_name, table[ranks[0]][SPARSE_KEEP:], table[ranks[0]][VOCAB],
                                      where=f" on tensor-parallel {_ranks(ranks)} of {world}")
    for field in AGREED_FIELDS:
        column = [row[field] for row in table]
        if any(v != column[0] for v in column):
            description, argument = naming.fields[field]
            raise argument_error(
                ValueError, fn_name, argument,
                f"the {description}{' checksum' if HEADER[field].checksum else ''} differs across the {world} "
                f"tensor-parallel ranks of tp_group (per rank: {[HEADER[field].show(v) for v in column]}); every rank "
                "must pass the same rows, tokens and options")
    bad = [r for r in range(world) if table[r][BAD]]
    if bad:
        raise argument_error(ValueError, fn_name, naming.bad_logits_argument,
                             naming.bad_logits.format(where=f" on tensor-parallel {_ranks(bad)} of {world}"))


def check_across_ranks(fn_name: str, group, world_size: int, tokens: torch.Tensor, row_mask: Optional[torch.Tensor],
                       bad: torch.Tensor, naming: Optional[Naming] = None, **fields) -> None:
    """TP > 1, validate=True, before the partials' all-gather: builds this rank's header (`fields` as rank_header
    takes them), all-gathers the headers, reads the table (the call's one host sync) and raises on every rank
    together, or returns on every rank. `tokens` and `row_mask` are the call's (all T rows); `bad` is this rank's
    NaN / +inf flag (0-d bool), whichever rows it covers."""
    header = rank_header(tokens, row_mask, bad, **fields)
    table = exchange_headers(header, group, world_size)
    raise_if_any(fn_name, table, row_mask is not None, naming=naming)


def raise_collectively(fn_name: str, exc: BaseException, group, world_size: int, validate, like) -> NoReturn:
    """A local check failed on this rank with `exc`. One rank, or validate=False: raises it here and now. TP > 1 with
    validate=True (or a validate that is itself the error): the other ranks learn of it from the header exchange
    they are in (check_across_ranks) and every rank raises the same error, this one with its own details.
    `like` is the tensor whose device the header goes on (the logits, or the hidden states)."""
    if group is None or validate is False:
        raise exc
    header = error_header(exc, header_device(like, group))
    table = exchange_headers(header, group, world_size)
    raise_if_any(fn_name, table, False, local_error=exc)
    raise exc  # not reached: the table holds this rank's error


def check_collectively(fn_name: str, tp_group, validate, like, check: Callable[..., None], *args) -> None:
    """Runs `check(*args)`, a local check the call shell does not make (a token loss's row count), before the shell
    prepares the call; its error raises as the shell's own do: here at one rank or with validate=False, else on every
    rank together through the header exchange the other ranks reach in their call. `like` as in raise_collectively."""
    try:
        check(*args)
    except Exception as exc:
        group, world_size, _ = check_tp_group(fn_name, tp_group)
        raise_collectively(fn_name, exc, group, world_size, validate, like)
