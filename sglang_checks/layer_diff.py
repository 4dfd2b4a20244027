"""Where do the trainer and the engine part? The engine's tensor dump against the trainer's recorded tensors.

The engine side is what SGLang 0.5.17 writes under `--debug-tensor-dump-output-folder DIR`
(debug_utils/tensor_dump_forward_hook.py:TensorDumper): one folder per scheduler process
(`TP{tp}_PP{pp}_Rank{rank}_pid{pid}`) holding `PassNNNNN.pt` per forward pass, a dict of every leaf module's output
under "model." (a tuple output is a list, None dropped; rows are the pass's flattened tokens) and
`model.forward_batch_info.{input_ids, seq_lens, positions}`. Two quirks of the dumper: the top-level `model` and
`logits_processor` outputs are stored after the pass's file is written, so they land in the next pass's file (not
compared here: `model.norm` holds the same final hidden states); a module that all layers share (the rotary
embedding, SHARED_MODULES) is recorded under every layer's name with the last layer's output, so only the last
layer's entry is compared (the others are listed as shared); and a prefill with a cached prefix (the radix cache)
holds only the tokens after it, at their absolute positions.

The trainer side is on_policy.py's record: the same names, for the flattened tokens of `sequences` (each from
position 0, one after another).

Alignment: a pass holds its requests one after another; request j ends at position seq_lens[j] - 1 and starts at
the pass's next position, so its rows are positions p0 .. seq_lens[j] - 1. A request is matched to a sequence whose
tokens at those positions are its input_ids. The teacher-forced scoring request's passes are those in which every
request has at least two tokens (not a decode step) and ends at the full length of its sequence (prompt +
completion: sampling never runs a forward over the last completion token).

Comparison, per tensor name in the trainer's forward order: the aligned rows (each tensor viewed as [tokens, -1])
compared exactly (values as float64, NaN equal to NaN), with the dtypes; the result lists, per name, the engine and
trainer shapes and dtypes, max |diff|, the number of differing elements, and names the first tensor that differs (in
value, dtype or row width). Tensor-parallel dumps hold each rank's shard: compare an engine layout with tp = 1.
"""

from __future__ import annotations

import glob
import os
from typing import Dict, List, Optional, Sequence, Tuple

import torch

INPUT_IDS = "model.forward_batch_info.input_ids"
SEQ_LENS = "model.forward_batch_info.seq_lens"
POSITIONS = "model.forward_batch_info.positions"
NEXT_PASS_NAMES = ("model", "logits_processor")  # stored in the following pass's file (module docstring)
# Modules one instance of which every layer shares (SGLang 0.5.17's get_rope caches one RotaryEmbedding per
# configuration): the dumper hooks the instance once per layer name and each call runs every hook, so every layer's
# entry holds the last layer's call. Only the last layer's entry is compared.
SHARED_MODULES = ("self_attn.rotary_emb",)

# (engine row start, rows, sequence index, first position) of one request of a pass.
Segment = Tuple[int, int, int, int]


def pass_files(dump_dir: str) -> List[str]:
    """Every PassNNNNN.pt under the dump folder's process folders, by process folder then pass number."""
    return sorted(glob.glob(os.path.join(dump_dir, "*", "Pass*.pt")))


def segments(tensors: Dict[str, object], sequences: Sequence[Sequence[int]]) -> Optional[List[Segment]]:
    """The pass's requests matched to sequences, or None when the pass has no batch info or a request matches none
    (another request's tokens, or positions that do not run p0 .. seq_len - 1)."""
    if not all(name in tensors for name in (INPUT_IDS, SEQ_LENS, POSITIONS)):
        return None
    ids = tensors[INPUT_IDS].tolist()
    positions = tensors[POSITIONS].tolist()
    out, row, used = [], 0, set()
    for seq_len in tensors[SEQ_LENS].tolist():
        if row >= len(ids):
            return None
        first = positions[row]
        count = seq_len - first
        if count < 1 or positions[row:row + count] != list(range(first, seq_len)):
            return None
        tokens = ids[row:row + count]
        matches = [b for b, s in enumerate(sequences) if len(s) >= seq_len and list(s[first:seq_len]) == tokens]
        if not matches:
            return None
        fresh = [b for b in matches if b not in used]  # identical sequences: one request each, in order
        b = (fresh or matches)[0]
        used.add(b)
        out.append((row, count, b, first))
        row += count
    return out if row == len(ids) else None


def scoring_segments(tensors, sequences) -> Optional[List[Segment]]:
    """segments() when the pass is (part of) the teacher-forced scoring request (module docstring), else None."""
    found = segments(tensors, sequences)
    if not found or not all(n >= 2 and first + n == len(sequences[b]) for _, n, b, first in found):
        return None
    return found


def _flat(value) -> List[Tuple[str, torch.Tensor]]:
    """A dumped value as (suffix, tensor) pairs: a tensor, or each element of a list as [i]."""
    if isinstance(value, torch.Tensor):
        return [("", value)]
    return [(f"[{i}]", t) for i, t in enumerate(value)]


class _Entry:
    """Running statistics of one tensor name over the aligned rows of every scoring pass."""

    def __init__(self, name: str, trainer: torch.Tensor):
        self.name, self.trainer_shape, self.trainer_dtype = name, list(trainer.shape), str(trainer.dtype)
        self.engine_shape: Optional[List[int]] = None
        self.engine_dtype: Optional[str] = None
        self.max_abs_diff, self.differing, self.elements, self.width_mismatch = 0.0, 0, 0, False
        self.first_token: Optional[Dict[str, int]] = None  # sample and position of the first differing row

    def add(self, engine_rows: torch.Tensor, trainer_rows: torch.Tensor, sample: int, first: int) -> None:
        if engine_rows.shape != trainer_rows.shape:
            self.width_mismatch = True
            return
        a, b = engine_rows.double(), trainer_rows.double()
        unequal = (a != b) & ~(a.isnan() & b.isnan())
        self.differing += int(unequal.sum())
        self.elements += a.numel()
        if unequal.any():
            self.max_abs_diff = max(self.max_abs_diff, float((a - b).abs()[unequal].max()))
            if self.first_token is None:
                row = int(unequal.any(dim=1).nonzero()[0])
                self.first_token = {"sample": sample, "position": first + row}

    def as_dict(self) -> dict:
        return {"name": self.name, "engine_shape": self.engine_shape, "trainer_shape": self.trainer_shape,
                "engine_dtype": self.engine_dtype, "trainer_dtype": self.trainer_dtype,
                "max_abs_diff": self.max_abs_diff, "differing": self.differing, "elements": self.elements,
                "dtype_mismatch": self.engine_dtype is not None and self.engine_dtype != self.trainer_dtype,
                "width_mismatch": self.width_mismatch, "first_differing_token": self.first_token}

    def reason(self) -> Optional[str]:
        """Why this tensor counts as differing, or None when it does not (or was never compared)."""
        if self.engine_shape is None:
            return None
        if self.width_mismatch:
            return f"row widths differ (engine {self.engine_shape}, trainer {self.trainer_shape})"
        if self.differing:
            where = self.first_token
            return (f"{self.differing} of {self.elements} elements differ, max |diff| {self.max_abs_diff:.3e}, "
                    f"first at sample {where['sample']} position {where['position']}")
        if self.engine_dtype != self.trainer_dtype:
            return f"equal values, dtypes differ (engine {self.engine_dtype}, trainer {self.trainer_dtype})"
        return None


def _rows(tensor: torch.Tensor, tokens: int) -> Optional[torch.Tensor]:
    """The tensor as [tokens, -1] (q_norm's [tokens * heads, head_dim] included), or None when it is not per token."""
    if tokens == 0 or tensor.numel() % tokens or (tensor.dim() and tensor.shape[0] % tokens):
        return None
    return tensor.reshape(tokens, -1)


def diff(dump_dir: str, record: Dict[str, object], sequences: Sequence[Sequence[int]]) -> dict:
    """The comparison of the engine dump in `dump_dir` with the trainer's `record` over `sequences` (module
    docstring). Returns a JSON-ready dict: passes, tokens, tensors (per name, forward order), first_difference
    (name and reason, or None), engine_only / trainer_only names, and a one-line summary."""
    offsets = [0]
    for s in sequences:
        offsets.append(offsets[-1] + len(s))
    trainer_tokens = offsets[-1]
    entries: Dict[str, _Entry] = {}
    trainer_rows: Dict[str, Optional[torch.Tensor]] = {}
    for name, value in record.items():
        for suffix, tensor in _flat(value):
            entries[name + suffix] = _Entry(name + suffix, tensor)
            trainer_rows[name + suffix] = _rows(tensor, trainer_tokens)
    last_layer = max((int(n.split(".")[2]) for n in record if n.startswith("model.layers.")), default=None)
    passes, tokens, engine_names, shared = [], 0, set(), set()
    for path in pass_files(dump_dir):
        tensors = torch.load(path, map_location="cpu", weights_only=True)
        found = scoring_segments(tensors, sequences)
        if found is None:
            continue
        passes.append(os.path.relpath(path, dump_dir))
        pass_tokens = len(tensors[INPUT_IDS])
        tokens += sum(n for _, n, _, _ in found)
        for name, value in tensors.items():
            if name.startswith("model.forward_batch_info.") or name in NEXT_PASS_NAMES:
                continue
            if name.endswith(SHARED_MODULES) and not name.startswith(f"model.layers.{last_layer}."):
                shared.update(name + suffix for suffix, _ in _flat(value))
                continue
            for suffix, tensor in _flat(value):
                engine_names.add(name + suffix)
                entry = entries.get(name + suffix)
                if entry is None:
                    continue
                entry.engine_shape = entry.engine_shape or list(tensor.shape)  # the first scoring pass's
                if entry.engine_dtype is None:
                    entry.engine_dtype = str(tensor.dtype)
                elif str(tensor.dtype) not in entry.engine_dtype.split("/"):  # passes disagree: both named
                    entry.engine_dtype += f"/{tensor.dtype}"
                engine, trainer = _rows(tensor, pass_tokens), trainer_rows[name + suffix]
                if engine is None or trainer is None:
                    entry.width_mismatch = True
                    continue
                for row, n, b, first in found:
                    start = offsets[b] + first
                    entry.add(engine[row:row + n], trainer[start:start + n], b, first)
    return _result(dump_dir, passes, tokens, {n: e for n, e in entries.items() if n not in shared}, engine_names,
                   sorted(shared))


def _result(dump_dir, passes, tokens, entries: Dict[str, _Entry], engine_names, shared=()) -> dict:
    compared = [e for e in entries.values() if e.engine_shape is not None]
    first = next(((e.name, e.reason()) for e in entries.values() if e.reason() is not None), None)
    if not passes:
        summary = (f"no pass of the teacher-forced scoring request in {dump_dir} (was the server started with "
                   f"--debug-tensor-dump-output-folder, and the rollout scored by it?)")
    elif first is None:
        summary = (f"no difference: {len(compared)} tensors equal over {tokens} tokens of "
                   f"{len(passes)} scoring pass(es)")
    else:
        summary = f"first difference at {first[0]}: {first[1]}"
    return {
        "engine_dump": dump_dir,
        "passes": passes,
        "tokens": tokens,
        "summary": summary,
        "first_difference": None if first is None else {"name": first[0], "reason": first[1]},
        "tensors": [e.as_dict() for e in compared],
        "trainer_only": [e.name for e in entries.values() if e.engine_shape is None],
        "engine_only": sorted(engine_names - set(entries)),
        "shared": list(shared),  # entries of a shared module that hold another layer's call (SHARED_MODULES)
    }
