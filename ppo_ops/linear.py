"""Public API of the fused LM head: log-probs and entropy straight from hidden states, vocab-parallel, no [T, V] logits.

A thin wrapper: the shell both LM-head ops share (ppo_ops/shell.py) checks arguments (before any
collective), resolves the TP layout and the backend and flattens the leading dimensions; LinearLogProbEntropyFunction
(ppo_ops/_linear_function.py) computes; the leading dimensions are restored here.
"""

from __future__ import annotations

from typing import Optional

import torch

from ppo_ops.core import checks
from ppo_ops.lm_head import shell
from ppo_ops.lm_head.function import LinearLogProbEntropyFunction
from ppo_ops.api import LogProbsEntropy

_FN = "linear_log_probs_and_entropy"


def linear_log_probs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    *,
    tp_group=None,
    entropy: str = "none",
    temperature: float = 1.0,
    row_mask: Optional[torch.Tensor] = None,
    vocab_size: Optional[int] = None,
    reduce_dx: bool = True,
    backend: str = "auto",
    validate: bool = True,
) -> LogProbsEntropy:
    """Log-probability of each target token and the entropy of each row, from hidden states and a (vocab-parallel)
    LM-head weight, without ever holding the [T, V] logits.

    Same semantics and outputs as `log_probs_and_entropy(hidden @ weight.T, tokens, ...)` with the logits accumulated
    in fp32 (never rounded to the input dtype): per-token log-probs and entropies in fp32, gradients for `hidden` and
    `weight` in their dtype. Guarantees:
      - bitwise deterministic run to run (fixed tile shapes and reduction orders, no atomics);
      - bitwise identical log-probs, entropies and dW at every TP size: a column's logit never depends on which rank
        computes it (tiles start at the fixed global segments, the K loop over H is fixed), and the per-segment
        partials go through the logits op's all-gather and fixed-order merge;
      - bitwise identical log-probs and entropies for every row count, backend="torch" and backend="triton" with
        bf16/fp16 (the GEMMs run on fixed-shape chunks: a row's logits do not depend on the other rows of the call,
        nor on a row mask that moves it; the fp32 Triton GEMM kernels place rows in tiles by their index);
      - backend="torch": bitwise identical to `log_probs_and_entropy(logits, ..., backend="torch")` on the fp32 logits
        its tiles produce (it runs that op's own code on each tile). backend="triton" with bf16/fp16 (the CUDA path):
        cuBLAS GEMMs on fixed-shape chunks [1024 rows x one vocabulary segment], the logits op's own Triton kernels
        on each fp32 chunk, so bitwise identical to `log_probs_and_entropy(logits, ..., backend="triton")` on the
        logits those GEMMs produce; its backward rounds dlogits to the input dtype before the dX and dW GEMMs.
        backend="triton" with fp32: Triton GEMM tiles with the statistics fused in (the logits op's tolerances).
    The logits exist only as bounded chunks in forward and are recomputed chunk by chunk in backward: 4 GEMMs' worth
    of work instead of the unfused path's 3 (forward, recompute, dX, dW), so the fused op cannot beat 4/3 of the
    three GEMMs' time; it saves the [T, V] logits and their gradient. Under torch.no_grad it keeps nothing and costs
    one GEMM plus one pass over each fp32 chunk. Extra memory (CUDA, half precision): one fp32 chunk (78 MB at
    Qwen3's vocabulary), and in backward an fp32 dX accumulator [rows, H], a dlogits buffer of 8192 rows x one
    segment and, past 8192 rows, one segment's fp32 dW accumulator. To form the gradient of an RL loss in the forward
    instead (three GEMMs), see ppo_ops.linear_token_loss.

    Args:
      hidden: [..., H] float32/bfloat16/float16, the same on every rank of tp_group (the LM head's input).
      weight: [V_local, H], hidden's dtype and device; this rank's contiguous slice of the vocabulary
        ([rank * V_local, (rank + 1) * V_local)), as in Megatron's column-parallel output layer.
      tokens: hidden.shape[:-1] integer global token ids.
      tp_group: tensor-parallel process group, given explicitly (e.g. torch.distributed.group.WORLD for TP over
        the default group); None means one rank, always, also inside an initialised job. One rank issues no
        collective. Every rank of the group must call with the same hidden, rows, tokens, options and `validate`.
      entropy: "none"; "value" (returned without gradient); "grad" (differentiable).
      temperature: both quantities use logits / temperature; the gradients carry the 1 / temperature factor. Any
        real number > 0 whose reciprocal fits in float32: Python or NumPy scalars, or a one-element tensor (read
        with .item(): a host sync of its own when it is on a GPU).
      row_mask: hidden.shape[:-1] bool; False rows get log-prob 0, entropy 0 and zero gradient, cost no GEMM work
        (the kept rows are gathered first: O(rows * H) bytes, and on CUDA one host sync of its own for their count,
        with validate True or False), and their tokens are not checked.
      vocab_size: the true global vocabulary; global columns at or past it are padding (no mass, zero dW rows).
        An int (Python, NumPy or a one-element integer tensor).
      reduce_dx: True (default): backward all-reduces the hidden gradient over tp_group (in fp32, then one rounding
        to hidden's dtype), so the returned dX is the full gradient. False: each rank returns only its own
        vocabulary's contribution dlogits_local @ weight, and the caller reduces it. Use False when `hidden` reaches
        this op through Megatron's `copy_to_tensor_model_parallel_region` (the input of its column-parallel LM head),
        whose backward already all-reduces dX over the TP group (or, with sequence parallelism, through
        `gather_from_sequence_parallel_region`, whose backward reduce-scatters it); True would sum it twice.
      backend: "auto" (triton for CUDA tensors when triton imports, else torch), "torch" or "triton".
      validate: run the checks that read tensor values (token range; NaN / +inf logits; ranks agreeing on rows,
        tokens and options) and make failure collective, as `log_probs_and_entropy` does (ppo_ops/checks.py):
        one host read of values per call at any TP size: at TP = 1 at the end of the forward, at TP > 1 when the
        ranks' fixed-size headers have been all-gathered, before the partials' all-gather; every rank then raises
        the same error, naming the rank(s) at fault and the argument. A local argument error (a wrong shape, dtype
        or option) on one rank also raises on every rank. False: no value read, and what _validate lists is no
        longer guaranteed (an argument error raises on its own rank only, the others wait in the all-gather until
        the process group's timeout). Must be the same on every rank. Not checked either way: that `hidden` is the
        same on every rank.

    Host syncs per call on CUDA (forward + backward): validate=True, 1 without a row_mask and 2 with one (the kept-row
    count, needed to size the GEMMs before the partials exist, and the value read, which needs the partials);
    validate=False, 0 without a row_mask and 1 with one. On the CPU the count is no sync.

    Options of `log_probs_and_entropy` that do not apply:
      keep_mask: a dense [T, V] mask is as large as the logits this op exists not to hold.
      inplace_grad: there is no logits tensor whose storage could take the gradient.
      chunk_size: replaced by the backends' fixed GEMM chunks, which are part of the bit-exactness contract.

    Gradient: dW is this rank's [V_local, H] slice (no communication); dX as `reduce_dx` says. dW's bits are
    TP-invariant like the log-probs; dX's are deterministic but, at TP > 1, summed in a different order than at
    TP = 1 (within rounding of fp32).

    Returns:
      LogProbsEntropy(log_probs, entropy), float32, shaped like tokens.
    """
    group, world_size, rank = checks.check_tp_group(_FN, tp_group)
    try:
        call = shell.prepare(_FN, hidden, weight, tokens, group, world_size, rank, entropy=entropy,
                                     temperature=temperature, row_mask=row_mask, vocab_size=vocab_size,
                                     reduce_dx=reduce_dx, backend=backend, validate=validate, fused_loss=False)
    except Exception as exc:
        # TP > 1 with validate=True: the other ranks learn of this error from the header exchange and raise with it.
        checks.raise_collectively(_FN, exc, group, world_size, validate, hidden)
    out = LinearLogProbEntropyFunction.apply(call.hidden, weight, call.tokens, call.row_mask, call.plan)
    if entropy == "none":
        return LogProbsEntropy(out.reshape(call.lead), None)
    log_prob, ent = out
    return LogProbsEntropy(log_prob.reshape(call.lead), ent.reshape(call.lead))
