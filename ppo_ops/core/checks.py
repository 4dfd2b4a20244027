"""Argument checks, the cross-rank agreement of a call, and the one host read of the value checks.

Local checks (types, shapes, devices, option values) always run and read no tensor values. At one rank they raise
at once. At TP > 1 with `validate=True` a rank never raises alone: its error is recorded and reaches every rank
through a fixed-size header that the ranks all-gather before any collective whose shape depends on the call, so all
ranks raise the same error, naming the rank(s) at fault and the argument.

The header (int64, HEADER_FIELDS) holds what each rank can say about its call: its local error, T, V_local, the
vocabulary size, the temperature (float64 bits), the entropy mode, the keep mask's presence, the logits' dtype,
checksums of the row mask and of the kept rows' tokens, the kept rows' token min/max and a flag for NaN / +inf
logits taken from the rank's own forward partials. The last five are computed on the device, so building the header
costs no host sync; `read_to_host` of the gathered table is the call's only one. At TP = 1 no header is exchanged: the
token bounds and the bad-logits flag are read together after the forward, again by `read_to_host`, once.

With `validate=False` none of the value checks run and no header is exchanged: no host sync at all. Then a token out of
range gives a wrong result (its log-prob is that of a target no rank holds, -inf) instead of an error, NaN / +inf
logits give NaN outputs, and ranks that disagree on rows, tokens or options are not detected: a wrong result, or,
where their partials differ in size, an error or a wait until the process group's timeout. A local argument error
then raises on its own rank only, and the other ranks wait in the partials all-gather until that timeout.

Rows dropped by `row_mask` are not range checked: prompt rows routinely carry placeholder ids such as -100.
Errors name the argument and what was expected: TypeError for a wrong dtype or type, ValueError for a wrong shape or
value.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import struct
from typing import Mapping, NoReturn, Optional, Sequence

import torch
import torch.distributed as dist

from ppo_ops.core.row_stats import MAX, SUMEXP  # the partials' channels (the bad-logits flag reads them)

ENTROPY_MODES = ("none", "value", "grad")
BACKENDS = ("auto", "torch", "triton")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FLT_MAX = 3.4028234663852886e38  # largest finite fp32
# Smallest temperature accepted: 1 / temperature, rounded to fp32 (the kernels multiply by it), must be finite.
MIN_TEMPERATURE = 1.0 / FLT_MAX


def _prefix(fn_name: str) -> str:
    return f"ppo_ops.{fn_name}: "


def argument_error(exc_type, fn_name: str, argument: str, detail: str) -> Exception:
    """An exception whose message starts with the function and names `argument`; `argument` is kept on it so that
    the cross-rank header can say which argument a rank rejected."""
    exc = exc_type(f"{_prefix(fn_name)}{detail}")
    exc.ppo_ops_argument = argument
    return exc


# ---- local checks (no tensor values read) ----

def _scalar(fn_name: str, name: str, value, integral: bool):
    """A Python/NumPy number or a one-element tensor as a Python int (integral) or float."""
    kind = "an int" if integral else "a real number"
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise argument_error(ValueError, fn_name, name,
                                 f"{name} must be a scalar, got a tensor of shape {tuple(value.shape)}")
        if value.is_meta:
            raise argument_error(ValueError, fn_name, name, f"{name} must have a value, got a tensor on the meta device")
        if value.dtype == torch.bool or value.dtype.is_complex or (integral and value.dtype.is_floating_point):
            raise argument_error(TypeError, fn_name, name, f"{name} must be {kind}, got a {value.dtype} tensor")
        value = value.item()  # a host read of its own when the tensor is on a GPU
    if isinstance(value, bool) or not isinstance(value, numbers.Integral if integral else numbers.Real):
        raise argument_error(TypeError, fn_name, name, f"{name} must be {kind}, got {type(value).__name__}")
    return int(value) if integral else float(value)


def check_options(
    fn_name: str,
    *,
    entropy,
    backend,
    temperature,
    chunk_size,
    vocab_size,
    inplace_grad,
    validate,
) -> tuple:
    """Checks the non-tensor options; returns (temperature, 1 / temperature in fp32, chunk_size, vocab_size) as Python
    numbers (chunk_size and vocab_size may be None)."""
    if not isinstance(entropy, str) or entropy not in ENTROPY_MODES:
        raise argument_error(ValueError, fn_name, "entropy", f"entropy must be one of {ENTROPY_MODES}, got {entropy!r}")
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise argument_error(ValueError, fn_name, "backend", f"backend must be one of {BACKENDS}, got {backend!r}")
    temperature = _scalar(fn_name, "temperature", temperature, integral=False)
    if not math.isfinite(temperature) or temperature <= 0.0:
        raise argument_error(ValueError, fn_name, "temperature",
                             f"temperature must be finite and > 0, got {temperature}")
    inv_temperature = float(torch.tensor(1.0 / temperature if temperature >= MIN_TEMPERATURE / 2 else math.inf,
                                         dtype=torch.float32).item())  # a CPU tensor: no device sync
    if not math.isfinite(inv_temperature):
        raise argument_error(
            ValueError, fn_name, "temperature",
            f"temperature must be >= {MIN_TEMPERATURE:.4g} (1 / temperature must fit in float32), got {temperature:g}")
    if chunk_size is not None:
        chunk_size = _scalar(fn_name, "chunk_size", chunk_size, integral=True)
        if chunk_size == 0 or chunk_size < -1:
            raise argument_error(ValueError, fn_name, "chunk_size",
                                 f"chunk_size must be -1 (no chunking) or >= 1, got {chunk_size}")
    if vocab_size is not None:
        vocab_size = _scalar(fn_name, "vocab_size", vocab_size, integral=True)
        if vocab_size < 1:
            raise argument_error(ValueError, fn_name, "vocab_size", f"vocab_size must be >= 1, got {vocab_size}")
    for name, flag in (("inplace_grad", inplace_grad), ("validate", validate)):
        if not isinstance(flag, bool):
            raise argument_error(TypeError, fn_name, name, f"{name} must be a bool, got {type(flag).__name__}")
    return temperature, inv_temperature, chunk_size, vocab_size


def check_tp_group(fn_name: str, tp_group) -> tuple:
    """(group or None, world size, rank). None means one rank, always (also inside an initialised job); TP over the
    default group is `tp_group=torch.distributed.group.WORLD`, given explicitly. A group of one rank is one rank.
    Raised on this rank alone: without a valid group there is no one to tell."""
    if tp_group is None:
        return None, 1, 0
    if not (dist.is_available() and isinstance(tp_group, dist.ProcessGroup)):
        raise argument_error(
            TypeError, fn_name, "tp_group",
            f"tp_group must be a torch.distributed.ProcessGroup (e.g. torch.distributed.group.WORLD) or None for one "
            f"rank, got {type(tp_group).__name__}")
    world_size = dist.get_world_size(tp_group)
    rank = dist.get_rank(tp_group)
    if rank < 0:
        raise argument_error(ValueError, fn_name, "tp_group", "tp_group does not contain this process")
    if world_size == 1:
        return None, 1, 0
    return tp_group, world_size, rank


def check_tensors(
    fn_name: str,
    logits: torch.Tensor,
    tokens: torch.Tensor,
    keep_mask: Optional[torch.Tensor],
    row_mask: Optional[torch.Tensor],
) -> None:
    def fail(exc_type, name, detail):
        raise argument_error(exc_type, fn_name, name, detail)

    if not isinstance(logits, torch.Tensor):
        fail(TypeError, "logits", f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dtype not in FLOAT_DTYPES:
        fail(TypeError, "logits", f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    if logits.is_meta:
        fail(ValueError, "logits", "logits must be on a device with values (CPU or CUDA), got meta: the op reads them")
    if logits.dim() < 2:
        fail(ValueError, "logits", f"logits must have shape [..., V_local] with at least 2 dims, got {tuple(logits.shape)}")
    if logits.shape[-1] < 1:
        fail(ValueError, "logits", f"logits must have a non-empty vocabulary dimension, got {tuple(logits.shape)}")
    lead = tuple(logits.shape[:-1])
    check_row_tensors(fn_name, "logits", logits.device, lead, tokens,
                      (("keep_mask", keep_mask, tuple(logits.shape)), ("row_mask", row_mask, lead)))


def check_row_tensors(fn_name: str, source: str, device, lead: tuple, tokens, masks) -> None:
    """The per-row arguments of an op whose rows come from `source` (logits or hidden, of leading shape `lead`, on
    `device`): integer tokens of shape `lead`, and each (name, mask or None, shape) a bool tensor of that shape."""
    def fail(exc_type, name, detail):
        raise argument_error(exc_type, fn_name, name, detail)

    if not isinstance(tokens, torch.Tensor):
        fail(TypeError, "tokens", f"tokens must be a torch.Tensor of integer ids, got {type(tokens).__name__}")
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        fail(TypeError, "tokens", f"tokens must hold integer token ids, got dtype {tokens.dtype}")
    if tuple(tokens.shape) != lead:
        fail(ValueError, "tokens", f"tokens must have shape {lead} ({source}.shape[:-1]), got {tuple(tokens.shape)}: "
                                   f"token/{source} length mismatch")
    if tokens.device != device:
        fail(ValueError, "tokens", f"tokens must be on {device} like {source}, got {tokens.device}")
    for name, mask, shape in masks:
        if mask is None:
            continue
        if not isinstance(mask, torch.Tensor):
            fail(TypeError, name, f"{name} must be a bool torch.Tensor or None, got {type(mask).__name__}")
        if mask.dtype != torch.bool:
            fail(TypeError, name, f"{name} must have dtype torch.bool, got {mask.dtype}")
        if tuple(mask.shape) != shape:
            fail(ValueError, name, f"{name} must have shape {shape}, got {tuple(mask.shape)}")
        if mask.device != device:
            fail(ValueError, name, f"{name} must be on {device} like {source}, got {mask.device}")


def check_vocab(fn_name: str, vocab_size: Optional[int], v_global: int) -> None:
    if vocab_size is not None and vocab_size > v_global:
        raise argument_error(
            ValueError, fn_name, "vocab_size",
            f"vocab_size must be <= the global vocabulary V_local * tp_size = {v_global}, got {vocab_size}")


def overlaps(t: torch.Tensor) -> bool:
    """True when two indices of `t` address the same element (a stride-0 / expanded or otherwise overlapping view)."""
    dims = sorted((stride, size) for size, stride in zip(t.shape, t.stride()) if size > 1)
    extent = 1
    for stride, size in dims:
        if stride < extent:
            return True
        extent = stride * size
    return False


def check_inplace_target(fn_name: str, flat: torch.Tensor, needs_unit_stride: bool) -> None:
    """inplace_grad=True: every logit must own its storage element, or backward's rows would write one element
    several times (a stride-0 / expanded view, an overlapping as_strided view)."""
    if overlaps(flat):
        raise argument_error(
            ValueError, fn_name, "inplace_grad",
            f"inplace_grad=True needs logits whose elements do not overlap in memory, got shape {tuple(flat.shape)} "
            f"with strides {flat.stride()} (an expanded or overlapping view): pass a contiguous tensor or "
            "inplace_grad=False")
    if needs_unit_stride and flat.shape[1] > 1 and flat.stride(1) != 1:
        raise argument_error(ValueError, fn_name, "inplace_grad",
                             "inplace_grad=True with this backend needs logits.stride(-1) == 1")


# ---- the value checks: device-side bounds and flags, one host read ----

def read_to_host(t: torch.Tensor) -> list:
    """The host read of the value checks (a host sync on CUDA): the only place ppo_ops reads device values in a
    call with validate=True, and it runs once per call."""
    return t.tolist()


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
                             row_mask: Optional[torch.Tensor], upper: int, naming: Optional["Naming"] = None,
                             extra_flags: Optional[torch.Tensor] = None) -> list:
    """TP = 1, validate=True: reads the token bounds and the bad-logits flag in one host read and raises.
    `bad_rows` may cover only the kept rows (any length): only its any() is read. `extra_flags` (a [k] tensor on the
    same device: an op's own device-side checks) travel in the same read; their values are returned for the caller
    to act on, after the token and logits checks."""
    naming = LOGITS_NAMING if naming is None else naming
    parts = [token_bounds(tokens, row_mask), bad_rows.any().reshape(1).to(torch.int64)]
    if extra_flags is not None:
        parts.append(extra_flags.reshape(-1).to(torch.int64))
    lo, hi, bad, *extra = read_to_host(torch.cat(parts))
    if lo < 0 or hi >= upper:
        raise argument_error(ValueError, fn_name, "tokens", _range_message(upper, lo if lo < 0 else hi,
                                                                           row_mask is not None))
    if bad:
        raise argument_error(ValueError, fn_name, naming.bad_logits_argument, naming.bad_logits.format(where=""))
    return extra


# ---- the cross-rank header (TP > 1, validate=True) ----

HEADER_FIELDS = (
    "error argument", "error type", "number of rows T", "V_local (logits.shape[-1])", "vocabulary size",
    "temperature", "entropy mode", "keep_mask presence", "logits dtype", "row_mask", "tokens",
    "token min", "token max", "bad logits",
)
(ERR_ARG, ERR_TYPE, ROWS, V_LOCAL, VOCAB, TEMPERATURE, ENTROPY, KEEP, DTYPE, ROW_SUM, TOKEN_SUM, TOKEN_MIN, TOKEN_MAX,
 BAD) = range(len(HEADER_FIELDS))
AGREED_FIELDS = (ROWS, V_LOCAL, VOCAB, TEMPERATURE, ENTROPY, KEEP, DTYPE, ROW_SUM, TOKEN_SUM)
# Arguments an error can name in the header, and the exception types it can carry (index + 1; 0 = no error).
ARGUMENTS = ("logits", "tokens", "tp_group", "entropy", "keep_mask", "temperature", "row_mask", "vocab_size",
             "chunk_size", "inplace_grad", "backend", "validate", "arguments", "hidden", "weight", "reduce_dx",
             "token_loss")
ERROR_TYPES = (TypeError, ValueError, RuntimeError)
# The argument a disagreement on each agreed field is about (named in the error).
_FIELD_ARGUMENT = {ROWS: "tokens", V_LOCAL: "logits", VOCAB: "vocab_size", TEMPERATURE: "temperature",
                   ENTROPY: "entropy", KEEP: "keep_mask", DTYPE: "logits", ROW_SUM: "row_mask", TOKEN_SUM: "tokens"}
_DTYPES = (None,) + FLOAT_DTYPES


@dataclasses.dataclass(frozen=True)
class Naming:
    """How a function's value errors name its arguments: what each agreed header field is called and which argument
    it belongs to, and the NaN / +inf error ("{where}" in it becomes " on tensor-parallel rank(s) r of n" at TP > 1,
    else nothing). The logits op's is LOGITS_NAMING; the fused LM head has its own (no logits argument there)."""

    fields: Mapping[int, tuple]  # agreed header field -> (its description, the argument it belongs to)
    bad_logits_argument: str
    bad_logits: str


LOGITS_NAMING = Naming(
    fields={field: (HEADER_FIELDS[field], _FIELD_ARGUMENT[field]) for field in AGREED_FIELDS},
    bad_logits_argument="logits",
    bad_logits="logits{where} contain NaN or +inf (after the temperature scaling)",
)


def _float_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", value))[0]


def _bits_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


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
    row = [0] * len(HEADER_FIELDS)
    row[ERR_ARG] = ARGUMENTS.index(argument if argument in ARGUMENTS else "arguments") + 1
    row[ERR_TYPE] = kind + 1
    return _host_ints(row, device)


def rank_header(tokens: torch.Tensor, row_mask: Optional[torch.Tensor], partials: torch.Tensor, *, v_local: int,
                vocab_size: int, temperature: float, entropy_mode: str, has_keep_mask: bool,
                dtype: torch.dtype) -> torch.Tensor:
    """The header of a rank whose arguments passed the local checks, its value fields computed on the device from
    its tokens, row mask and forward partials ([segments, 5, T]), with no host sync."""
    device = partials.device
    flat_tokens = tokens.reshape(-1).to(torch.int64)
    if row_mask is not None:
        rm = row_mask.reshape(-1)
        flat_tokens = torch.where(rm, flat_tokens, torch.zeros_like(flat_tokens))
        row_sum = _fold_checksum(rm.to(torch.int64))
    else:
        row_sum = torch.zeros((), dtype=torch.int64, device=device)
    maxima = partials[:, MAX]
    bad = (torch.isnan(maxima) | (maxima == math.inf) | torch.isnan(partials[:, SUMEXP])).any()
    fixed = _host_ints(
        [0, 0, flat_tokens.numel(), v_local, vocab_size, _float_bits(temperature), ENTROPY_MODES.index(entropy_mode),
         int(has_keep_mask), _DTYPES.index(dtype)], device)
    return torch.cat([fixed, row_sum.reshape(1), _fold_checksum(flat_tokens).reshape(1),
                      token_bounds(flat_tokens, None), bad.reshape(1).to(torch.int64)])


def exchange_headers(header: torch.Tensor, group, world_size: int) -> list:
    """All-gathers the fixed-size headers (one small collective whose shape never depends on the call) and reads the
    table to the host: the call's one host sync. Returns one list of HEADER_FIELDS ints per rank."""
    table = torch.empty((world_size * header.numel(),), dtype=torch.int64, device=header.device)
    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather_single(table, header.contiguous(), group=group)
    return read_to_host(table.view(world_size, header.numel()))


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _show(field: int, value: int):
    if field == TEMPERATURE:
        return _bits_float(value)
    if field == ENTROPY:
        return ENTROPY_MODES[value] if 0 <= value < len(ENTROPY_MODES) else value
    if field == KEEP:
        return bool(value)
    if field == DTYPE:
        return str(_DTYPES[value]).replace("torch.", "") if 0 < value < len(_DTYPES) else value
    return value


def raise_if_any(fn_name: str, table: list, has_row_mask: bool,
                 local_error: Optional[BaseException] = None, naming: Optional[Naming] = None) -> None:
    """Decides from the gathered table, identically on every rank: local argument errors first, then the token range
    (each rank's kept tokens against its own vocabulary size), then disagreement, then NaN / +inf logits.
    `local_error` is this rank's own error, appended to its message."""
    naming = LOGITS_NAMING if naming is None else naming
    world = len(table)
    p = _prefix(fn_name)
    faulty = [r for r in range(world) if table[r][ERR_ARG]]
    if faulty:
        first = table[faulty[0]]
        exc_type = ERROR_TYPES[first[ERR_TYPE] - 1]
        what = "; ".join(f"rank {r}: {ARGUMENTS[table[r][ERR_ARG] - 1]} ({ERROR_TYPES[table[r][ERR_TYPE] - 1].__name__})"
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
    for field in AGREED_FIELDS:
        column = [row[field] for row in table]
        if any(v != column[0] for v in column):
            checksum = field in (ROW_SUM, TOKEN_SUM)
            description, argument = naming.fields[field]
            raise argument_error(
                ValueError, fn_name, argument,
                f"the {description}{' checksum' if checksum else ''} differs across the {world} "
                f"tensor-parallel ranks of tp_group (per rank: {[_show(field, v) for v in column]}); every rank must "
                "pass the same rows, tokens and options")
    bad = [r for r in range(world) if table[r][BAD]]
    if bad:
        raise argument_error(ValueError, fn_name, naming.bad_logits_argument,
                             naming.bad_logits.format(where=f" on tensor-parallel {_ranks(bad)} of {world}"))


def check_across_ranks(fn_name: str, group, world_size: int, tokens: torch.Tensor, row_mask: Optional[torch.Tensor],
                       partials: torch.Tensor, naming: Optional[Naming] = None, **fields) -> None:
    """TP > 1, validate=True, before the partials' all-gather: builds this rank's header (`fields` as rank_header
    takes them), all-gathers the headers, reads the table (the call's one host sync) and raises on every rank
    together, or returns on every rank. `tokens` and `row_mask` are the call's (all T rows); `partials` may cover
    only the rows a backend computed (only its NaN / +inf flag is read)."""
    header = rank_header(tokens, row_mask, partials, **fields)
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
