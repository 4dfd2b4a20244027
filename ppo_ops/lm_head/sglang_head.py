"""The fused LM head in SGLang's order (reduction_order="sglang"): log-probs bit for bit those of SGLang's true
on-policy LM head, from hidden states and the weight, holding [T, V] logits only where the token loss's allowance
takes them.

What SGLang computes (0.5.17, --rl-on-policy-target, batch-invariant mode): bf16 logits from its batch-invariant
matmul (`torch.matmul(hidden.bfloat16(), weight.T.bfloat16())`; sglang_matmul.py says how each logit's bits are
fixed), then the batch-invariant log_softmax of those logits in fp32 (logits/sglang_order.py, the logits op's
reduction_order="sglang"). With a temperature T the logits are divided as its sampler divides them,
`bf16(bf16 logit / T)` (sglang_matmul.py), and scored in the same order.

The schedule (the general op: four GEMMs' work for a gradient, none of them over more than a block of logits):
  forward   per row block of `block_rows` rows: its bf16 logits over this rank's vocabulary (the torch backend's
            one [block, span] rectangle per GEMM span, below); the logits op's SGLang order on them (row max, block
            sums, the TP collectives of that order); the row statistics kept, O(R).
  backward  per GEMM span (paths.sglang_gemm_span: half a fixed segment of V_global / 8 columns): the logits of
            every kept row over its columns again (the same bits: the Triton kernel's are shape-independent, the
            torch backend's come from the same rectangles), the logits op's gradient pass in place over them (bf16
            dlogits), dX32 += dl @ W_s (fp32) and dW_s = dl^T @ X (one GEMM, K = R, written once in the weight's
            dtype: no accumulator).
  token loss (linear_token_loss; lm_head/paths.py's sglang_path picks the path by the allowance, the call's
            working_memory or paths.TOKEN_LOSS_BYTES, counted at the global vocabulary): the caller's loss, called
            once on the statistics of every row of a token-loss block (the Function's hooks; on one block and on
            the recompute every kept row, so a sequence-scope loss sees its sequences whole:
            paths.sglang_scores_whole), gives the upstream gradients in the forward, so the logits already formed
            are turned into dlogits without a second GEMM:
    sglang_loss_one_block  every row one block, its logits held in one of two layouts, whichever holds less
            (paths.sglang_one_block_row_major): row-major [R8, V_local] (R8: R up to a multiple of 8, the rows
            above R zero), the forward written straight into it (the Triton kernel's every row in one launch and
            one pass of the order, the torch backend's in the general op's blocks), the logits op's gradient pass
            over all of it at once; or span-major [n_span, R8, span], each forward block copied in, the gradient
            pass per span, dW in the buffer's own storage from R8 >= H x (dW's element size) / 2 on (span s's over the
            dlogits of spans below s; the first through a temporary). Then per span dX32 += dl_s @ W_s and
            dW_s = dl_s^T @ X (K = R, in the weight's dtype), exactly the backward's GEMMs on the same operands
            (row-major: column views of the buffer, the same values at another leading dimension); dW is finished
            in the forward.
    sglang_loss_blocks  blocks of paths.sglang_loss_block_rows rows (a multiple of the forward's row block, so its
            row blocks are the general op's): each block's logits row-major [B, V_local], then per span the
            gradient pass into a [B8, span] dlogits buffer, dX rows (fp32, finished per block) and the fp32 dW
            accumulator [V_local, H] (its first block writes it); the Function rounds it once.
    sglang_blocks  where not even one forward row block fits beside the accumulator: the forward's blocks with the
            caller's loss, then the backward's spans over every row (every logit formed twice).
The temperature's 1 / T on the gradient scales the upstream gradients (the dlogits are linear in them), so the
logits op's passes run at temperature 1 on the divided logits. Every dX / dW GEMM has the span's shape (a function
of V_global), the same at every TP size, so dW's bits are TP = 1's.

Memory beyond the inputs and outputs (bf16 copies of hidden and of the weight where they are not bf16 already):
  general op   forward, one block of bf16 logits (block_rows x V_local); backward, one span's bf16 logits of every row
               (R x span), the fp32 dX accumulator [R, H].
  sglang_loss_one_block  R8 x V_local bf16 logits / dlogits and fp32 dX rows [R8, H]; row-major dW beside them,
               span-major one forward block (block_rows x V_local bf16) and dW in the logits' storage (where the
               rows hold it) with its first span's temporary.
  sglang_loss_blocks  B x V_local bf16 logits, B8 x span bf16 dlogits, fp32 dX rows [B8, H], the fp32 dW
               accumulator [V_local, H] until the backward.
  sglang_blocks (token loss)  the general op's forward and backward memory, both in the forward.
Values only (no gradient wanted): the forward's blocks and the caller's loss, nothing held, on every path.

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
from ppo_ops.lm_head import paths, sglang_matmul
from ppo_ops.lm_head.gemms import addmm_fp32, gemm_operand_rows, gemm_rows, mm_fp32, mm_rounded
from ppo_ops.lm_head.paths import Path, sglang_block_rows
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

    def logit_blocks(self, plan, hidden, weight, r_start: int = 0, r_stop: Optional[int] = None, rows_buffer=None,
                     whole: bool = False):
        """(r0, r1, bf16 logits [r1 - r0, V_local]) of each forward row block of rows r_start .. r_stop (r_start a
        multiple of the block rows, so the blocks are the general op's): into one block's buffer, reused, or, given
        `rows_buffer` [r_stop - r_start, V_local], into its rows. `weight` is cast to bf16 where it is not already
        (a caller looping over row ranges passes the cast one). `whole` (with rows_buffer): the Triton kernel's rows
        as one block, one launch of each pass instead of one per block (its bits and the order's are per row: the
        same values); the torch backend keeps the general op's blocks, whose GEMM shapes fix its bits."""
        r_stop = hidden.shape[0] if r_stop is None else r_stop
        v_local = weight.shape[0]
        step = sglang_block_rows(hidden.device)
        if whole and rows_buffer is not None and self.kind == "triton":
            step = max(1, r_stop - r_start)
        w16 = _bf16(weight)
        buffer = rows_buffer
        if buffer is None:
            buffer = torch.empty((min(step, r_stop - r_start), v_local), dtype=torch.bfloat16, device=hidden.device)
        span = paths.sglang_gemm_span(plan.shard.seg_len)
        for r0 in range(r_start, r_stop, step):
            r1 = min(r_stop, r0 + step)
            h16 = _bf16(hidden[r0:r1])
            z = buffer[:r1 - r0] if rows_buffer is None else buffer[r0 - r_start:r1 - r_start]
            for c0, c1 in self._column_spans(v_local, span):
                sglang_matmul.bf16_logits(h16, w16[c0:c1], z[:, c0:c1], _temperature(plan), self.kind)
            yield r0, r1, z

    def _column_spans(self, v_local, span):
        """The forward's GEMM rectangles along the vocabulary: the Triton kernel's bits do not depend on them (one
        launch over every column); the torch backend's GEMM is called on one GEMM span at a time, the shape the
        backward calls it on."""
        if self.kind == "triton":
            return [(0, v_local)]
        return [(c0, c0 + span) for c0 in range(0, v_local, span)]

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
        upstream = _upstream(plan, g_lp, g_ent)
        stats = BackwardStats(shift, log_sum, None, mean_shifted)
        lplan = self.logits_plan(plan)
        n_gemm = gemm_rows(rows)  # zero rows up to a multiple of 8: cuBLAS's aligned kernels (gemms.py)
        w16 = _bf16(weight)
        h16 = gemm_operand_rows(_bf16(hidden), n_gemm)
        span = paths.sglang_gemm_span(plan.shard.seg_len)
        dl = torch.zeros((n_gemm, span), dtype=torch.bfloat16, device=device)
        dx = torch.zeros((n_gemm, width), dtype=torch.float32, device=device) if wanted.dx else None
        dw = torch.empty_like(weight) if wanted.dw else None
        row_step = max(1, rows) if self.kind == "triton" else sglang_block_rows(device)
        for c0 in range(0, v_local, span):
            c1 = c0 + span
            # The forward's logits again, bit for bit: every row at once for the Triton kernel (whose bits do not
            # depend on the rectangle), the forward's row blocks for the torch backend (the same GEMM shapes).
            for r0 in range(0, rows, row_step):
                r1 = min(rows, r0 + row_step)
                sglang_matmul.bf16_logits(h16[r0:r1], w16[c0:c1], dl[r0:r1], _temperature(plan), self.kind)
            mine = dl[:rows]
            lplan.backend.backward_grad(RowInputs(mine, tokens, None, None), lplan.shard.segment(c0, span), stats,
                                        upstream, mine)
            if dx is not None:
                addmm_fp32(dx, dl, w16[c0:c1])
            if dw is not None:
                _dw_segment(dl, h16, dw[c0:c1])
        return (None if dx is None else dx[:rows]), dw

    # ---- linear_token_loss ----

    def loss_path(self, plan, hidden, weight) -> paths.HeadPath:
        """The token loss's path for these kept rows (paths.head_path: sglang_path by the call's working_memory)."""
        return paths.head_path(kind=self.kind, dtype=hidden.dtype, device=hidden.device, token_loss=True,
                               aligned=False, needs_grad=True, n_rows=hidden.shape[0], width=hidden.shape[1],
                               seg_len=plan.shard.seg_len, working_memory=plan.working_memory,
                               reduction_order="sglang", weight_dtype=weight.dtype)

    def scores_every_row_at_once(self, plan, hidden, weight) -> bool:
        """Whether the caller's loss sees every kept row in one call on loss_path's path (paths.sglang_scores_whole):
        then a sequence-scope loss needs no statistics pass."""
        return paths.sglang_scores_whole(self.loss_path(plan, hidden, weight), hidden.shape[0])

    def loss_forward(self, head: HeadRows, with_entropy: bool, hooks: LossHooks, wanted: GradsWanted,
                     working_memory: Optional[int] = None, plan=None) -> Optional[torch.Tensor]:
        """The token loss on loss_path's path (module docstring). Returns dW: in the weight's dtype (one block,
        sglang_blocks) or its fp32 accumulator (blocks); None where no gradient is wanted."""
        hidden, weight, tokens = head.hidden, head.weight, head.tokens
        rows = hidden.shape[0]
        hooks.headers()
        lplan = self.logits_plan(plan)
        if not (wanted.dx or wanted.dw):  # values only: the forward's blocks and the loss, nothing held
            scored = _Scored(self, lplan, hooks, tokens, with_entropy)
            for r0, r1, z in self.logit_blocks(plan, hidden, weight):
                scored.add(z, r0, r1)
            scored.take()
            return None
        if rows == 0:  # no row (a row mask that drops every row): no gradient
            return torch.zeros_like(weight) if wanted.dw else None
        path = self.loss_path(plan, hidden, weight)
        if path.path is Path.SGLANG_LOSS_ONE_BLOCK:
            return self._one_block(plan, lplan, hidden, weight, tokens, with_entropy, hooks, wanted)
        if path.path is Path.SGLANG_LOSS_BLOCKS:
            return self._blocks(plan, lplan, path.block_rows, hidden, weight, tokens, with_entropy, hooks, wanted)
        scored = _Scored(self, lplan, hooks, tokens, with_entropy)
        for r0, r1, z in self.logit_blocks(plan, hidden, weight):
            scored.add(z, r0, r1)
        del z  # the last block's view would keep the forward's block buffer alive through grads()
        stats, (g_lp, g_ent) = scored.take()
        dx, dw = self.grads(plan, hidden, weight, tokens, stats.shift, stats.log_sum, stats.mean_shifted, g_lp,
                            g_ent, wanted)
        if dx is not None:
            hooks.finish_dx(dx, 0, rows)
        return dw

    def _one_block(self, plan, lplan, hidden, weight, tokens, with_entropy, hooks, wanted) -> Optional[torch.Tensor]:
        """sglang_loss_one_block: every row's logits held (row-major, or span-major where that holds less:
        paths.sglang_one_block_row_major), the loss, then per span grads()'s pass and GEMMs on them (the same
        operands, shapes and calls: the same bits). dW finished."""
        rows, width, v_local = hidden.shape[0], hidden.shape[1], weight.shape[0]
        span, device = paths.sglang_gemm_span(plan.shard.seg_len), hidden.device
        n_span, n_gemm = v_local // span, gemm_rows(rows)
        row_major = paths.sglang_one_block_row_major(rows, width, plan.shard.seg_len, weight.element_size(), device)
        w16 = _bf16(weight)
        scored = _Scored(self, lplan, hooks, tokens, with_entropy)
        if row_major:  # the forward's blocks land in place; span s is the column view [:, s * span:]
            storage = torch.empty((n_gemm, v_local), dtype=torch.bfloat16, device=device)
            if n_gemm > rows:
                storage[rows:].zero_()
            for r0, r1, z in self.logit_blocks(plan, hidden, w16, rows_buffer=storage[:rows], whole=True):
                scored.add(z, r0, r1)
            logits = [storage[:, c0:c0 + span] for c0 in range(0, v_local, span)]
        else:
            storage = torch.empty(n_span * n_gemm * span, dtype=torch.bfloat16, device=device)
            logits = storage.view(n_span, n_gemm, span)  # logits[s]: grads()'s [n_gemm, span] dlogits operand
            if n_gemm > rows:
                logits[:, rows:].zero_()
            for r0, r1, z in self.logit_blocks(plan, hidden, w16):
                scored.add(z, r0, r1)
                logits[:, r0:r1].copy_(z.view(r1 - r0, n_span, span).transpose(0, 1))
            del z  # the forward's block buffer: not held through the GEMMs
        stats, upstream = scored.backward_inputs(plan)
        h16 = gemm_operand_rows(_bf16(hidden), n_gemm)
        dx = torch.zeros((n_gemm, width), dtype=torch.float32, device=device) if wanted.dx else None
        in_logits = not row_major and paths.sglang_dw_in_logits(n_gemm, width, weight.element_size())
        dw = None
        if wanted.dw:
            dw = (storage.view(weight.dtype)[:v_local * width].view(v_local, width) if in_logits
                  else torch.empty_like(weight))
        if row_major:  # one pass over every row (per-span column views run it at 0.4 of the bandwidth: rows
            # 2 V_local bytes apart); elementwise, so the same bits as grads()'s passes per span
            lplan.backend.backward_grad(RowInputs(storage[:rows], tokens, None, None), lplan.shard, stats, upstream,
                                        storage[:rows])
        for s, c0 in enumerate(range(0, v_local, span)):
            c1 = c0 + span
            dl = logits[s]
            if not row_major:
                lplan.backend.backward_grad(RowInputs(dl[:rows], tokens, None, None), lplan.shard.segment(c0, span),
                                            stats, upstream, dl[:rows])
            if dx is not None:
                addmm_fp32(dx, dl, w16[c0:c1])
            if dw is None:
                continue
            if in_logits and s == 0:  # its rows lie over span 0's dlogits, which its own GEMM reads
                first = torch.empty((span, width), dtype=weight.dtype, device=device)
                _dw_segment(dl, h16, first)
                dw[c0:c1].copy_(first)
                del first
            else:  # over the dlogits of spans below s only (paths.sglang_dw_in_logits), or its own tensor
                _dw_segment(dl, h16, dw[c0:c1])
        if dx is not None:
            hooks.finish_dx(dx[:rows], 0, rows)
        return dw

    def _blocks(self, plan, lplan, block, hidden, weight, tokens, with_entropy, hooks,
                wanted) -> Optional[torch.Tensor]:
        """sglang_loss_blocks (`block` rows each): per block its row-major logits, the loss, then per segment the
        gradient pass into one segment's dlogits, dX rows and dW_s (+)= dl_s^T X into the fp32 accumulator
        (returned unrounded)."""
        rows, width, v_local = hidden.shape[0], hidden.shape[1], weight.shape[0]
        span, device = paths.sglang_gemm_span(plan.shard.seg_len), hidden.device
        most = min(block, rows)
        logits = torch.empty((most, v_local), dtype=torch.bfloat16, device=device)
        dl = torch.empty((gemm_rows(most), span), dtype=torch.bfloat16, device=device)
        dx = torch.empty((gemm_rows(most), width), dtype=torch.float32, device=device) if wanted.dx else None
        acc = torch.empty(weight.shape, dtype=torch.float32, device=device) if wanted.dw else None
        w16, h16 = _bf16(weight), _bf16(hidden)
        for b0 in range(0, rows, block):
            b1 = min(rows, b0 + block)
            n, n_gemm = b1 - b0, gemm_rows(b1 - b0)
            z = logits[:n]
            scored = _Scored(self, lplan, hooks, tokens, with_entropy)
            for r0, r1, z_rows in self.logit_blocks(plan, hidden, w16, b0, b1, rows_buffer=z):
                scored.add(z_rows, r0, r1)
            stats, upstream = scored.backward_inputs(plan)
            x = gemm_operand_rows(h16[b0:b1], n_gemm)
            if n_gemm > n:  # the GEMMs' extra rows: zero dlogits
                dl[n:n_gemm].zero_()
            d = dl[:n_gemm]
            for s, c0 in enumerate(range(0, v_local, span)):
                c1 = c0 + span
                lplan.backend.backward_grad(RowInputs(z[:, c0:c1], tokens[b0:b1], None, None),
                                            lplan.shard.segment(c0, span), stats, upstream, dl[:n])
                if dx is not None:
                    if s == 0:
                        mm_fp32(d, w16[c0:c1], dx[:n_gemm])
                    else:
                        addmm_fp32(dx[:n_gemm], d, w16[c0:c1])
                if acc is not None:
                    if b0 == 0:
                        mm_fp32(d.t(), x, acc[c0:c1])
                    else:
                        addmm_fp32(acc[c0:c1], d.t(), x)
            if dx is not None:
                hooks.finish_dx(dx[:n], b0, b1)
        return acc


class _Scored:
    """A token-loss block's forward blocks scored: the logits op's SGLang order on each, then the caller's loss once
    on all of their statistics (hooks.block_grads over the token-loss block's rows: a sequence-scope loss sees every
    sequence of the block whole), and what the gradient pass over the block then reads."""

    def __init__(self, head: SglangHeadBackend, lplan, hooks: LossHooks, tokens, with_entropy: bool):
        self.head, self.lplan, self.hooks, self.tokens = head, lplan, hooks, tokens
        self.with_entropy = with_entropy
        self.stats, self.r0, self.r1 = [], None, None

    def add(self, z, r0: int, r1: int) -> None:
        self.r0 = r0 if self.r0 is None else self.r0
        self.r1 = r1
        self.stats.append(self.head.block_stats(self.lplan, z, self.tokens[r0:r1]))

    def take(self) -> tuple:
        """(the blocks' RowStats, (upstream gradient of the log-probs, of the entropies), each None where none):
        the caller's loss runs here, once."""
        stats = _cat_stats(self.stats, self.tokens.device)
        grads = self.hooks.block_grads(stats, self.r0, self.r1)
        if not self.with_entropy:
            stats = dataclasses.replace(stats, mean_shifted=None)
        return stats, (grads.grad_log_prob, grads.grad_entropy)

    def backward_inputs(self, plan) -> tuple:
        """(BackwardStats, UpstreamGrads) of the gradient pass over the blocks' rows (temperature applied)."""
        stats, (g_lp, g_ent) = self.take()
        return BackwardStats(stats.shift, stats.log_sum, None, stats.mean_shifted), _upstream(plan, g_lp, g_ent)


def _upstream(plan, g_lp, g_ent) -> UpstreamGrads:
    """The upstream gradients of the divided logits' log-probs and entropies: d z / d logit = 1 / T, and the
    dlogits are linear in them."""
    inv_t = plan.shard.inv_temperature
    if inv_t != 1.0:
        g_lp = None if g_lp is None else g_lp * inv_t
        g_ent = None if g_ent is None else g_ent * inv_t
    return UpstreamGrads(g_lp, g_ent)


def _dw_segment(dl, h16, out) -> None:
    """out = dl^T @ X (fp32 accumulation, K = dl's rows) in out's dtype: fp32 written as is, bf16 rounded once by
    the GEMM, fp16 rounded once from fp32."""
    if out.dtype == torch.float32:
        mm_fp32(dl.t(), h16, out)
    elif out.dtype == torch.bfloat16:
        mm_rounded(dl.t(), h16, out)
    else:
        out.copy_(_mm32(dl.t(), h16))


def _mm32(a, b):
    out = torch.empty((a.shape[0], b.shape[1]), dtype=torch.float32, device=a.device)
    mm_fp32(a, b, out)
    return out


def _temperature(plan) -> Optional[float]:
    """The divisor of SGLang's sampler, or None at temperature 1 (no division: the matmul's logits as they are)."""
    return None if plan.temperature == 1.0 else float(plan.temperature)


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
