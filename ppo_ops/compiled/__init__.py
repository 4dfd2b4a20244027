"""The three ops as PyTorch custom operators (namespace `ppo_ops`), the route the public functions take while
torch.compile traces them (`torch.compiler.is_compiling()`); eager calls keep their autograd Functions.

Why operators: dynamo cannot trace a Triton launch made through Python, the value checks' host read, or a collective
on a Python process group. An operator is opaque to it: the compiler sees a fake implementation (output shapes and
dtypes from input shapes, symbolic in T, so varying T does not recompile) and an autograd formula registered with
torch.library; at run time the operator runs the same prepared call and the same forward and backward bodies as the
eager Function, so its outputs are the eager op's, bit for bit. What crosses an operator's schema is tensors and
Python scalars only:
  - tp_group crosses as its `group_name` ("" for one rank), resolved again inside the operator;
  - keep=(ids, offsets) as two optional tensors;
  - temperature, vocab_size and chunk_size as Python numbers (a tensor option would need a host read while tracing:
    refused with a TypeError naming it);
  - inplace_grad not at all: the compiler owns the logits' storage, the gradient comes back in a new tensor;
  - what the backward needs of the forward as extra outputs (the O(T) row statistics; the token loss's dX and dW).
One forward operator per op in two registrations: `<op>` and `<op>_syncing`, the latter tagged cudagraph_unsafe, used
when the call reads values on the host (validate=True; the LM head's row_mask, whose kept-row count sizes its
GEMMs), so that torch.compile(mode="reduce-overhead") keeps those calls out of its CUDA graphs.

Per op (one file each): logits_op.py (log_probs_and_entropy), linear_op.py (linear_log_probs_and_entropy),
token_loss_op.py (linear_token_loss with a shipped `TokenLoss`; any other callable is traced into the graph on the
general head's operator).
"""
