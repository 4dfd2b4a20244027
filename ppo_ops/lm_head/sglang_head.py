"""The fused LM head in SGLang's order (reduction_order="sglang"): log-probs bit for bit those of SGLang's true
on-policy LM head, from hidden states and the weight, without holding [T, V] logits.

What SGLang computes (0.5.17, --rl-on-policy-target, batch-invariant mode): bf16 logits from its batch-invariant
matmul (`torch.matmul(hidden.bfloat16(), weight.T.bfloat16())`; sglang_matmul.py says how each logit's bits are
fixed), then the batch-invariant log_softmax of those logits in fp32 (logits/sglang_order.py, the logits op's
reduction_order="sglang"). With a temperature T the logits are divided as its sampler divides them,
`bf16(bf16 logit / T)` (sglang_matmul.py), and scored in the same order.

The schedule (four GEMMs' work for a gradient, none of them over more than a block of logits):
  forward   per row block of `block_rows` rows: its bf16 logits over this rank's vocabulary, one
            [block, seg_len] rectangle per fixed segment (the layout's V_global / 8 columns); the logits op's SGLang
            order on them (row max, block sums, the TP collectives of that order); the row statistics kept, O(R).
  backward  per segment: the logits of every kept row over its columns again (the same rectangles, so the same
            bits: the Triton kernel's are shape-independent, the torch backend's come from the same shapes), the
            logits op's gradient pass in place over them (bf16 dlogits), dX32 += dl @ W_s (fp32) and dW_s = dl^T @ X
            (one GEMM, K = R, written once in the weight's dtype: no accumulator).
  token loss (linear_token_loss): the forward's blocks, the caller's loss on each block's statistics (the
            Function's hooks), then the backward's segments with those gradients, inside the forward.
The temperature's 1 / T on the gradient scales the upstream gradients (the dlogits are linear in them), so the
logits op's passes run at temperature 1 on the divided logits.

Memory beyond the inputs and outputs: forward, one block of bf16 logits (block_rows x V_local); backward, one
segment's bf16 logits of every row (R x seg_len: a quarter of the bf16 [R, V] logits at V = 151936, TP = 1... an
eighth of the vocabulary, 2 bytes each), the fp32 dX accumulator [R, H], the bf16 copies of hidden and of the
weight where they are not bf16 already.

Exactness and its conditions (checked before any collective, core/checks.check_lm_head_order): the logits are
SGLang's only from the Triton kernel on the GPU generation it was checked on (sm_90); CUDA tensors with
backend="torch" (cuBLAS's K order) or another generation are refused, naming reduction_order. On CPU both backends
run (the torch backend with the BLAS's K order: the tests' reference of the order's logic). No sparse keep set.

Validation: at TP > 1 the header exchange runs before the first block's collectives (over the call's rows, tokens
and options); NaN / +inf logits are flagged per row from the order's global row max and the log-probs, and read
once at the end (TP = 1: with the token range, lm_head/function.py; TP > 1: one small all-reduce, then the read).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from ppo_ops.core import agreement, checks, registry, shell
from ppo_ops.core.contracts import (BackwardStats, GradsWanted, HeadRows, LinearSaved, LossHooks, RowInputs,
                                    RowStats, UpstreamGrads)
from ppo_ops.lm_head import sglang_matmul
from ppo_ops.lm_head.gemms import addmm_fp32, gemm_operand_rows, gemm_rows, mm_fp32, mm_rounded
from ppo_ops.lm_head.paths import sglang_block_rows
from ppo_ops.logits import sglang_order

def _bf16(t: torch.Tensor) -> torch.Tensor:
    """t as SGLang's `.bfloat16()` makes it (t itself when bf16 already)."""
    return t if t.dtype == torch.bfloat16 else t.to(torch.bfloat16)


class SglangHeadBackend:
    """The LM head's backend for reduction_order="sglang" (module docstring), on the passes of one kind."""

    def __init__(self, kind: str):
        self.kind = kind
        self.name = f"sglang-{kind}"

    @property
    def logits_backend(self):
        return registry.load("logits", self.kind)

    # ---- forward ----

    def logits_plan(self, plan):
        """The logits op's plan for the divided bf16 logits: its backend, temperature 1 (already applied), no
        value checks (the head's own run once for the call)."""
        return dataclasses.replace(plan, backend=self.logits_backend, validate=False, reduction_order="sglang",
                                   shard=dataclasses.replace(plan.shard, inv_temperature=1.0))

    def row_stats(self, plan, hidden, weight, tokens, call_tokens, call_row_mask) -> RowStats:
        """RowStats of the kept rows (hidden [R, H], tokens [R]); call_tokens / call_row_mask: the call's, for the
        header exchange (TP > 1 with validate) before the first collective."""
        if plan.validate and plan.layout.group is not None:
            shell.check_across_ranks(plan, call_tokens, call_row_mask,
                                     torch.zeros((), dtype=torch.bool, device=hidden.device))
        lplan = self.logits_plan(plan)
        parts = [self.block_stats(lplan, z, tokens[r0:r1])
                 for r0, r1, z in self.logit_blocks(plan, hidden, weight)]
        stats = _cat_stats(parts, hidden.device)
        if plan.validate and plan.layout.group is not None:
            _raise_bad_logits_collectively(plan, stats.bad_input)
        return stats

    def logit_blocks(self, plan, hidden, weight):
        """(r0, r1, bf16 logits [r1 - r0, V_local]) of each row block, one buffer reused."""
        rows, v_local = hidden.shape[0], weight.shape[0]
        step = sglang_block_rows(hidden.device)
        w16 = _bf16(weight)
        buffer = torch.empty((min(step, rows), v_local), dtype=torch.bfloat16, device=hidden.device)
        seg_len = plan.shard.seg_len
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            h16 = _bf16(hidden[r0:r1])
            z = buffer[:r1 - r0]
            for c0, c1 in self._column_spans(v_local, seg_len):
                sglang_matmul.bf16_logits(h16, w16[c0:c1], z[:, c0:c1], _temperature(plan), self.kind)
            yield r0, r1, z

    def _column_spans(self, v_local, seg_len):
        """The forward's GEMM rectangles along the vocabulary: the Triton kernel's bits do not depend on them (one
        launch over every column); the torch backend's GEMM is called on one segment at a time, the shape the
        backward calls it on."""
        if self.kind == "triton":
            return [(0, v_local)]
        return [(c0, c0 + seg_len) for c0 in range(0, v_local, seg_len)]

    def block_stats(self, lplan, z, tokens) -> RowStats:
        """The logits op's SGLang order (lplan: logits_plan's) on one block's divided bf16 logits; bad_input also
        flags non-finite log-probs (a NaN logit reaches the sums even where a max skipped it)."""
        stats = sglang_order.row_stats(lplan, RowInputs(z, tokens, None, None))
        bad = stats.bad_input | ~torch.isfinite(stats.log_prob)
        return dataclasses.replace(stats, bad_input=bad)

    # ---- backward ----

    def backward(self, head: HeadRows, saved: LinearSaved, upstream: UpstreamGrads, wanted: GradsWanted,
                 plan=None) -> tuple:
        """(dX fp32 [R, H] of this rank or None, dW [V_local, H] in weight's dtype or None)."""
        return self.grads(plan, head.hidden, head.weight, head.tokens, saved.shift, saved.log_sum,
                          saved.mean_shifted, upstream.grad_log_prob, upstream.grad_entropy, wanted)

    def grads(self, plan, hidden, weight, tokens, shift, log_sum, mean_shifted, g_lp, g_ent, wanted) -> tuple:
        rows, width, v_local = hidden.shape[0], hidden.shape[1], weight.shape[0]
        device = hidden.device
        inv_t = plan.shard.inv_temperature
        if inv_t != 1.0:  # d z / d logit = 1 / T: the dlogits are linear in the upstream gradients
            g_lp = None if g_lp is None else g_lp * inv_t
            g_ent = None if g_ent is None else g_ent * inv_t
        upstream = UpstreamGrads(g_lp, g_ent)
        stats = BackwardStats(shift, log_sum, None, mean_shifted)
        lplan = self.logits_plan(plan)
        n_gemm = gemm_rows(rows)  # zero rows up to a multiple of 8: cuBLAS's aligned kernels (gemms.py)
        w16 = _bf16(weight)
        h16 = gemm_operand_rows(_bf16(hidden), n_gemm)
        dl = torch.zeros((n_gemm, plan.shard.seg_len), dtype=torch.bfloat16, device=device)
        dx = torch.zeros((n_gemm, width), dtype=torch.float32, device=device) if wanted.dx else None
        dw = torch.empty_like(weight) if wanted.dw else None
        span = max(1, rows) if self.kind == "triton" else sglang_block_rows(device)
        for c0 in range(0, v_local, plan.shard.seg_len):
            c1 = c0 + plan.shard.seg_len
            # The forward's logits again, bit for bit: every row at once for the Triton kernel (whose bits do not
            # depend on the rectangle), the forward's row blocks for the torch backend (the same GEMM shapes).
            for r0 in range(0, rows, span):
                r1 = min(rows, r0 + span)
                sglang_matmul.bf16_logits(h16[r0:r1], w16[c0:c1], dl[r0:r1], _temperature(plan), self.kind)
            mine = dl[:rows]
            lplan.backend.backward_grad(RowInputs(mine, tokens, None, None), lplan.shard.segment(c0), stats,
                                        upstream, mine)
            if dx is not None:
                addmm_fp32(dx, dl, w16[c0:c1])
            if dw is not None:
                if weight.dtype == torch.float32:
                    mm_fp32(dl.t(), h16, dw[c0:c1])
                elif weight.dtype == torch.bfloat16:
                    mm_rounded(dl.t(), h16, dw[c0:c1])
                else:  # fp16: rounded once from fp32
                    dw[c0:c1].copy_(_mm32(dl.t(), h16))
        return (None if dx is None else dx[:rows]), dw

    # ---- linear_token_loss ----

    def loss_forward(self, head: HeadRows, with_entropy: bool, hooks: LossHooks, wanted: GradsWanted,
                     working_memory: Optional[int] = None, plan=None) -> Optional[torch.Tensor]:
        """The token loss: the forward's blocks with the caller's loss on each, then the backward's segments."""
        hidden, weight, tokens = head.hidden, head.weight, head.tokens
        rows = hidden.shape[0]
        hooks.headers()
        lplan = self.logits_plan(plan)
        parts, g_lp, g_ent = [], [], []
        for r0, r1, z in self.logit_blocks(plan, hidden, weight):
            stats = self.block_stats(lplan, z, tokens[r0:r1])
            parts.append(stats)
            grads = hooks.block_grads(stats, r0, r1)
            g_lp.append(grads.grad_log_prob)
            g_ent.append(grads.grad_entropy)
        if rows == 0 or not (wanted.dx or wanted.dw):
            return None
        stats = _cat_stats(parts, hidden.device)
        dx, dw = self.grads(plan, hidden, weight, tokens, stats.shift, stats.log_sum,
                            stats.mean_shifted if with_entropy else None, _cat(g_lp), _cat(g_ent), wanted)
        if dx is not None:
            hooks.finish_dx(dx, 0, rows)
        return dw


def _mm32(a, b):
    out = torch.empty((a.shape[0], b.shape[1]), dtype=torch.float32, device=a.device)
    mm_fp32(a, b, out)
    return out


def _temperature(plan) -> Optional[float]:
    """The divisor of SGLang's sampler, or None at temperature 1 (no division: the matmul's logits as they are)."""
    return None if plan.temperature == 1.0 else float(plan.temperature)


def _cat(parts):
    return None if not parts or parts[0] is None else torch.cat(parts)


def _cat_stats(parts, device) -> RowStats:
    if not parts:
        empty = torch.zeros(0, dtype=torch.float32, device=device)
        flag = torch.zeros(0, dtype=torch.bool, device=device)
        return RowStats(empty, empty, empty, empty, None, empty, flag, flag, flag)
    if len(parts) == 1:
        return parts[0]
    fields = {f.name: (None if getattr(parts[0], f.name) is None else torch.cat([getattr(p, f.name) for p in parts]))
              for f in dataclasses.fields(RowStats)}
    return RowStats(**fields)


def _raise_bad_logits_collectively(plan, bad_rows: torch.Tensor) -> None:
    """TP > 1: every rank raises the bad-logits error when any rank's rows saw NaN / +inf logits (one all-reduce
    of a flag, one host read)."""
    flag = bad_rows.any().to(torch.int64).reshape(1)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=plan.layout.group)
    if agreement.read_to_host(flag)[0]:
        where = f" (merged over the {plan.layout.world_size} tensor-parallel ranks)"
        raise checks.argument_error(ValueError, plan.fn_name, plan.naming.bad_logits_argument,
                                    plan.naming.bad_logits.format(where=where))


_BACKENDS = {}


def backend(kind: str) -> SglangHeadBackend:
    if kind not in _BACKENDS:
        _BACKENDS[kind] = SglangHeadBackend(kind)
    return _BACKENDS[kind]
