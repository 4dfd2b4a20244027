"""Trainer-side scoring of the saved rollout under each trainer layout, on real torch.distributed ranks.

The parent runs the model once: final hidden states h [B, S, H] (after the last RMSNorm) and the LM head W [V, H];
the model's logits are h @ W^T (what Qwen3ForCausalLM.forward does). Each rank of a layout with factors
(tp, cp, dp) gets, by its coordinates (d, c, t) (layouts.py), the sequences of batch part d, the positions of sequence
part c, and the LM-head rows of vocabulary part t, and computes its own shard of the logits, h_part @ W_t^T, with W_t
as a leaf so the LM-head gradient exists, just as a Megatron output layer does (h_part is a leaf too). Then per rank:

  log_probs, entropy = ppo_ops.log_probs_and_entropy(logits_shard, targets, tp_group=<its TP group>, row_mask=...,
                                                     temperature=T_trainer, keep_mask=<top-p set shard or None>)
  loss = ppo_loss(log_probs, entropy, rows=<its tokens' indices into the batch>).sum()

with `ppo_loss` the library's own, ppo_ops.policy_loss over the whole batch [B, S] (PPO's clipped surrogate with an
entropy bonus, loss_mask = the completion rows, normalization "token_mean" or "seq_mean" with seq_ids = the sequence):

  per-token term = weight_t * (max(-A_b r, -A_b clip(r, 1 - CLIP_LOW, 1 + CLIP_HIGH)) - entropy_coef * entropy)
  with r = exp(lp - old), A_b the sequence's advantage,
  token_mean: weight_t = 1 / (completion tokens in the whole batch)
  seq_mean:   weight_t = 1 / (its sequence's completion tokens * sequences with a completion)

old = the layout's own log-probs from a forward before the step (no gradient), as a trainer recomputes them: the
first minibatch of a PPO step, every ratio 1 up to rounding, so the clip never binds and the gradient is
-A * d lp - entropy_coef * d entropy, weighted. A TokenLoss is row-separable: each rank calls it on its own tokens
(`rows`), with the global weights, so each rank's loss is its share of the global loss, the global loss is the sum over
the ranks of one vocabulary part (the "data group": same t), and the gradient of the local loss is the global gradient
of the local tensors: no collective in the loss. Reported, in float64: the loss (all-reduced over the data group), the
norm of the gradient w.r.t. the logits (every element has one owner: squared norms all-reduced over the layout), the
norm of the gradient w.r.t. the hidden states (each TP rank's part summed over the TP group, then squared norms over
the data group) and the norm of the LM-head gradient (W_t's gradients all-reduced over the data group, then squared
norms over the TP group). Log-probs and entropy come back from the t = 0 ranks and are reassembled to [B, S].

The fused LM head (a layout named `...-fused`, layouts.FUSED): the rank never forms logits; ppo_ops.linear_token_loss
takes h_part, W_t, the targets and the same `ppo_loss` (its rows mapped to the batch's), forms the loss's gradient in
its forward, and loss.backward() hands dX and dW over (dX all-reduced over the TP group by the op). There is no
logits gradient to report. The fused head has no keep mask and forms the logits in fp32, never rounding them to the
model's dtype (docs/api.md: linear_log_probs_and_entropy), so a fused layout is compared with its own baseline, not tp1:
`tp1-unfused` (layouts.UNFUSED), the logits op on h @ W^T formed in fp32 from leaves in fp32, without the keep mask,
at TP = 1. run_jobs adds it to every job with a fused layout; LayoutResult.baseline points to it. Under
`sglang_on_policy` the fused head runs with reduction_order="sglang": it forms SGLang's bf16 logits itself and scores
them in SGLang's order, so a fused layout is compared with tp1 (bit for bit under --expect_bitwise) and no unfused
baseline runs.

Trainer numerics (--trainer_numerics): `hf` is the above, in the model's dtype. `sglang_on_policy` mirrors SGLang's
--rl-on-policy-target path (on_policy.py): h is the fp32 output of its final norm, W the bf16 head, and each rank
enables SGLang's batch-invariant mode (the Triton matmul its model runner installs) and forms its logits shard as
SGLang's LM head does, torch.matmul(h.bfloat16(), W_t.T.bfloat16()): that matmul's reduction runs over the hidden
dimension only, so a shard is the full logits' columns bit for bit. ppo_ops then reproduces SGLang's batch-invariant
log_softmax (reduction_order="sglang", passed by `log_probs_and_entropy` below, the one place that knows it).

Processes: one group of max(world sizes) ranks is spawned once (gloo on CPU, NCCL with one GPU per rank) and runs
every layout in turn, creating each layout's subgroups (every rank takes part in new_group, as torch requires). Inputs
go through one torch.save file the ranks memory-map (shared memory may be small in containers). A rank that fails
sends its traceback; the parent then stops all ranks, and always reaps them, also on Ctrl-C.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue as queue_lib
import signal
import tempfile
import threading
import time
import traceback
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from ppo_ops.runtime import ranks as runtime_ranks
from sglang_checks import layouts as layouts_lib
from sglang_checks.controls import VOCAB_OFFSET_ROWS
from sglang_checks.layouts import Layout

VARIANTS = ("token_mean", "seq_mean")  # ppo_ops.policy_loss normalizations the check scores
# The PPO clip (DAPO's clip-higher, the README's example). The ratios here are 1 up to rounding (old = the layout's
# own forward), so it never binds: it is there because a trainer has it.
CLIP_LOW, CLIP_HIGH = 0.2, 0.28
# The baseline every fused layout is compared with (module docstring).
UNFUSED_BASELINE = Layout("tp1-unfused", head=layouts_lib.UNFUSED)
HF = "hf"  # transformers' forward in the model's dtype; ppo_ops' own reduction order
SGLANG_ON_POLICY = "sglang_on_policy"  # SGLang's on-policy forward and kernels (on_policy.py); its log_softmax order
NUMERICS = (HF, SGLANG_ON_POLICY)


@dataclasses.dataclass
class TrainerInputs:
    """What every rank needs; all on CPU."""

    hidden: torch.Tensor  # [B, S, H] final hidden states, model dtype
    lm_head: torch.Tensor  # [V, H], model dtype
    targets: torch.Tensor  # [B, S] int64
    row_mask: torch.Tensor  # [B, S] bool
    keep_mask: Optional[torch.Tensor]  # [B, S, V] bool (top-p set) or None
    advantages: torch.Tensor  # [B] fp32
    temperature: float
    entropy_coef: float
    numerics: str = HF  # one of NUMERICS
    sglang_site: Optional[str] = None  # where sglang is imported from under SGLANG_ON_POLICY (None: sys.path as is)
    variants: Tuple[str, ...] = VARIANTS  # the loss normalizations scored (the training steps: their own only)


@dataclasses.dataclass
class LayoutResult:
    layout: Layout
    log_probs: np.ndarray  # [B, S] fp32 (0 off the completion rows)
    entropy: np.ndarray  # [B, S] fp32
    # variant -> {"loss", "logits_grad_norm" (None: fused, no logits), "hidden_grad_norm", "lm_head_grad_norm"}
    losses: Dict[str, Dict[str, Optional[float]]]
    baseline: Optional["LayoutResult"] = None  # what a fused layout is compared with (tp1-unfused); None: tp1


class TrainerRankError(RuntimeError):
    """A rank failed, crashed or timed out. `layout` and `rank` name where (None when unknown), `detail` holds the
    rank's traceback or the reason, `finished` the layouts of the first job that completed before it."""

    def __init__(self, message: str, *, layout: Optional[str], rank: Optional[int], detail: str = "",
                 finished: Optional[List["LayoutResult"]] = None):
        super().__init__(message)
        self.layout, self.rank, self.detail = layout, rank, detail
        self.finished = finished or []


def model_outputs(model, input_ids: torch.Tensor, *, numerics: str = HF, lengths: Optional[List[int]] = None,
                  kernels=None, record=None):
    """(hidden [B, S, H], lm_head weight [V, H], logits [B, S, V]). HF: exactly the model's own forward's.
    SGLANG_ON_POLICY: on_policy.py's forward over the first lengths[b] tokens of each row with `kernels`, each step
    recorded into `record` (a dict, or None)."""
    if numerics == SGLANG_ON_POLICY:
        from sglang_checks import on_policy

        return on_policy.model_outputs(model, input_ids, lengths, kernels=kernels, record=record)
    with torch.no_grad():
        hidden = model.model(input_ids=input_ids.to(model.device)).last_hidden_state
        logits = model.lm_head(hidden)
    return hidden, model.lm_head.weight.detach(), logits


def log_probs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, *, numerics: str = HF, **kwargs):
    """ppo_ops.log_probs_and_entropy in the trainer numerics' reduction order: SGLang's batch-invariant log_softmax
    (reduction_order="sglang") under SGLANG_ON_POLICY, ppo_ops' default otherwise. Every trainer log-prob of the
    check goes through here."""
    import ppo_ops

    if numerics == SGLANG_ON_POLICY:
        kwargs["reduction_order"] = "sglang"
    return ppo_ops.log_probs_and_entropy(logits, targets, **kwargs)


def lm_head_logits(hidden: torch.Tensor, weight: torch.Tensor, numerics: str = HF) -> torch.Tensor:
    """h @ W^T as the numerics' LM head forms it (SGLANG_ON_POLICY: logits_processor.py's on-policy matmul, run by
    the batch-invariant matmul in a rank that enabled it)."""
    if numerics == SGLANG_ON_POLICY:
        return torch.matmul(hidden.bfloat16(), weight.T.bfloat16())
    return torch.matmul(hidden, weight.t())


@dataclasses.dataclass
class Job:
    """One set of inputs scored under some layouts; `vocab_offset_layouts` names layouts given the vocab_offset
    fault (controls.py): their last TP rank takes LM-head rows VOCAB_OFFSET_ROWS too far."""

    inputs: TrainerInputs
    layouts: List[Layout]
    vocab_offset_layouts: Tuple[str, ...] = ()


def run_layouts(inputs: TrainerInputs, layouts: List[Layout], *, backend: str, threads: int = 1,
                timeout_s: float = 900.0, progress=None, vocab_offset_layouts: Tuple[str, ...] = ()
                ) -> List[LayoutResult]:
    """Runs every layout on one spawned group of ranks; returns results in layout order."""
    return run_jobs([Job(inputs, layouts, vocab_offset_layouts)], backend=backend, threads=threads,
                    timeout_s=timeout_s, progress=progress)[0]


def run_jobs(jobs: List[Job], *, backend: str, threads: int = 1, timeout_s: float = 900.0,
             progress=None) -> List[List[LayoutResult]]:
    """Runs every job's layouts, job after job, on one spawned group of ranks (one start-up for all). A job with a
    fused layout also runs UNFUSED_BASELINE, given to its fused layouts' results as `baseline` (not listed itself)."""
    jobs = [_with_unfused_baseline(job) for job in jobs]
    if progress is not None:
        shown = progress
        progress = lambda layout: None if layout.head == layouts_lib.UNFUSED else shown(layout)  # noqa: E731
    world = max(layout.world_size for job in jobs for layout in job.layouts)
    ctx = torch.multiprocessing.get_context("spawn")
    results: Dict[Tuple[int, str], Dict[int, dict]] = {(j, layout.name): {} for j, job in enumerate(jobs)
                                                       for layout in job.layouts}
    plan = [(j, [(layout, layout.name in job.vocab_offset_layouts) for layout in job.layouts])
            for j, job in enumerate(jobs)]
    with tempfile.TemporaryDirectory(prefix="qwen3_check_trainer_") as tmp:
        payload = os.path.join(tmp, "inputs.pt")
        torch.save([dataclasses.asdict(job.inputs) for job in jobs], payload)
        messages = ctx.Queue()
        group = _RankGroup(world=world, port=runtime_ranks.free_port(), backend=backend, payload_path=payload,
                           plan=plan, messages=messages, threads=threads)
        procs = [ctx.Process(target=_rank_main, daemon=True, args=(rank, group)) for rank in range(world)]
        try:
            for p in procs:
                with _interrupts_held():
                    p.start()
            _collect(procs, messages, jobs, results, timeout_s, progress)
        except TrainerRankError as exc:
            exc.finished = _job_results(jobs[0], {name: by_rank for (j, name), by_rank in results.items() if j == 0})
            raise
        finally:
            _reap(procs)
            messages.close()
    return [_job_results(job, {name: by_rank for (i, name), by_rank in results.items() if i == j})
            for j, job in enumerate(jobs)]


def _with_unfused_baseline(job: Job) -> Job:
    """The job with UNFUSED_BASELINE before its first fused layout (the job as is without one, or under
    SGLANG_ON_POLICY, where the fused head forms SGLang's bf16 logits and is compared with tp1 itself)."""
    first = next((i for i, layout in enumerate(job.layouts) if layout.fused), None)
    if first is None or job.inputs.numerics != HF:
        return job
    return dataclasses.replace(job, layouts=job.layouts[:first] + [UNFUSED_BASELINE] + job.layouts[first:])


def _job_results(job: Job, by_name: Dict[str, Dict[int, dict]]) -> List[LayoutResult]:
    """The job's finished layouts in order, UNFUSED_BASELINE not among them but each fused one's `baseline` (a fused
    layout whose baseline did not finish is left out)."""
    done = {layout.name: _assemble(layout, by_name[layout.name], job.inputs) for layout in job.layouts
            if len(by_name[layout.name]) == layout.world_size}
    out = []
    for layout in job.layouts:
        if layout.head == layouts_lib.UNFUSED or layout.name not in done:
            continue
        result = done[layout.name]
        if layout.fused and job.inputs.numerics == HF:
            if UNFUSED_BASELINE.name not in done:
                continue
            result.baseline = done[UNFUSED_BASELINE.name]
        out.append(result)
    return out


def _first_unfinished(jobs, results):
    for j, job in enumerate(jobs):
        for layout in job.layouts:
            if len(results[(j, layout.name)]) < layout.world_size:
                missing = [r for r in range(layout.world_size) if r not in results[(j, layout.name)]]
                return layout.name, missing
    return None, []


def _collect(procs, messages, jobs, results, timeout_s, progress) -> None:
    expected = sum(layout.world_size for job in jobs for layout in job.layouts)
    received, done, deadline = 0, set(), time.monotonic() + timeout_s
    while received < expected or len(done) < len(procs):
        try:
            message = messages.get(timeout=0.5)
        except queue_lib.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                layout, _ = _first_unfinished(jobs, results)
                rank, code = dead[0]
                raise TrainerRankError(f"trainer layout {layout}: rank {rank} exited with code {code} without a "
                                       f"report", layout=layout, rank=rank) from None  # an empty poll, not a cause
            if time.monotonic() > deadline:
                layout, missing = _first_unfinished(jobs, results)
                rank = missing[0] if missing else None
                raise TrainerRankError(f"trainer layout {layout}: rank {rank} did not finish within "
                                       f"--trainer_timeout_s={timeout_s:g} s", layout=layout, rank=rank) from None
            continue
        kind = message[0]
        if kind == "error":
            _, rank, layout, tb = message
            last = tb.strip().splitlines()[-1] if tb.strip() else "unknown error"
            raise TrainerRankError(f"trainer layout {layout}: rank {rank} failed: {last}", layout=layout, rank=rank,
                                   detail=tb)
        if kind == "done":
            done.add(message[1])
            continue
        _, j, name, rank, payload = message
        results[(j, name)][rank] = payload
        received += 1
        layout = next(candidate for candidate in jobs[j].layouts if candidate.name == name)
        if progress is not None and len(results[(j, name)]) == layout.world_size:
            progress(layout)


@contextlib.contextmanager
def _interrupts_held():
    """A Ctrl-C during the block is delivered when it ends. Around Process.start: interrupted while it writes the
    new rank's start-up data, the parent would leave a child that dies reading half of it, with a traceback on the
    shared stderr; held, a rank is spawned whole, and the interrupt then reaps it with the others. A Python-level
    handler, not a signal mask: a process-directed SIGINT may land on any thread without it blocked (torch's), while
    Python handlers always run in the main thread. Main thread only (elsewhere no handler can be set)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received and callable(previous):
            previous(signal.SIGINT, None)  # Python's default handler raises KeyboardInterrupt here
        elif received and previous == signal.SIG_DFL:
            signal.raise_signal(signal.SIGINT)


def _reap(procs) -> None:
    """Every started rank is gone when this returns: a polite terminate, then a kill. Ranks never started (Ctrl-C
    while an earlier one was being spawned) are skipped: joining one would raise over the interrupt."""
    procs = [p for p in procs if p.pid is not None]
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join()


def _assemble(layout: Layout, by_rank: Dict[int, dict], inputs: TrainerInputs) -> LayoutResult:
    batch, seq = inputs.targets.shape
    log_probs = np.zeros((batch, seq), dtype=np.float32)
    entropy = np.zeros((batch, seq), dtype=np.float32)
    for rank, payload in by_rank.items():
        d, c, t = layout.coords(rank)
        if t == 0:
            rows = slice(d * batch // layout.dp, (d + 1) * batch // layout.dp)
            cols = slice(c * seq // layout.cp, (c + 1) * seq // layout.cp)
            log_probs[rows, cols] = payload["log_probs"]
            entropy[rows, cols] = payload["entropy"]
    return LayoutResult(layout, log_probs, entropy, by_rank[0]["losses"])


# ----------------------------------------------------------------------------------------------- inside each rank


@dataclasses.dataclass(frozen=True)
class _RankGroup:
    """What every spawned trainer rank is given besides its rank (run_jobs)."""

    world: int  # ranks spawned: the largest layout's world size
    port: int  # the rendezvous on 127.0.0.1
    backend: str  # "gloo" | "nccl"
    payload_path: str  # the torch.save file of every job's TrainerInputs (as dicts)
    plan: list  # [(job index, [(layout, vocab_offset fault)])], in the order the ranks run them
    messages: object  # the parent's multiprocessing queue: results, "done", errors
    threads: int  # torch threads per rank


def _rank_main(rank: int, group: _RankGroup) -> None:
    current, messages = None, group.messages
    try:
        torch.set_num_threads(max(group.threads, 1))
        if group.backend == "nccl":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        else:
            device = torch.device("cpu")
        dist.init_process_group(group.backend, init_method=f"tcp://127.0.0.1:{group.port}", rank=rank,
                                world_size=group.world)
        all_inputs = torch.load(group.payload_path, mmap=True, weights_only=True)
        for j, layouts in group.plan:
            for layout, vocab_offset_fault in layouts:
                current = layout.name
                groups = _layout_groups(layout, rank)  # collective over the whole spawned group
                if rank < layout.world_size:
                    result = _run_rank(layout, rank, groups, all_inputs[j], device, vocab_offset_fault)
                    messages.put(("result", j, layout.name, rank, result))
        current = None
        dist.barrier()  # every rank done before any says so (the parent reaps the ranks once all have)
        messages.put(("done", rank))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent, which stops the others
        messages.put(("error", rank, current, traceback.format_exc()))
        if dist.is_initialized():
            dist.destroy_process_group()
        return
    # Destroy the group, flush the queue, exit without interpreter finalization, where gloo's threads can abort a
    # finished rank (ppo_ops/runtime/ranks.py); the barrier above already synchronised the ranks.
    runtime_ranks.leave(messages, barrier=False)


@dataclasses.dataclass
class _Groups:
    tp: object  # this rank's TP group (also when it has one rank: ppo_ops must not use the default group)
    tp_size: int
    data: object  # ranks with the same vocabulary part
    data_size: int
    layout: object  # all ranks of the layout
    layout_size: int


def _layout_groups(layout: Layout, rank: int) -> Optional[_Groups]:
    mine = {}
    for kind, members_list in (("tp", layout.tp_groups()), ("data", layout.data_groups()),
                               ("layout", [list(range(layout.world_size))])):
        for members in members_list:
            group = dist.new_group(members)
            if rank in members:
                mine[kind] = (group, len(members))
    if rank >= layout.world_size:
        return None
    return _Groups(*mine["tp"], *mine["data"], *mine["layout"])


def _sum(value: torch.Tensor, group, size: int) -> torch.Tensor:
    if size > 1:
        dist.all_reduce(value, group=group)
    return value


def _run_rank(layout: Layout, rank: int, groups: _Groups, inputs: dict, device: torch.device,
              vocab_offset_fault: bool = False) -> dict:
    import ppo_ops

    numerics = inputs.get("numerics", HF)
    if numerics == SGLANG_ON_POLICY:  # as SGLang's model runner does, for the rest of this rank's life
        from sglang_checks import on_policy

        on_policy.enable_batch_invariant_mode(inputs.get("sglang_site"))
    d, c, t = layout.coords(rank)
    batch, seq = inputs["targets"].shape
    vocab = inputs["lm_head"].shape[0]
    rows = slice(d * batch // layout.dp, (d + 1) * batch // layout.dp)
    cols = slice(c * seq // layout.cp, (c + 1) * seq // layout.cp)
    start, end = t * vocab // layout.tp, (t + 1) * vocab // layout.tp
    if vocab_offset_fault and layout.tp > 1 and t == layout.tp - 1:  # the vocab_offset control (controls.py)
        start, end = start - VOCAB_OFFSET_ROWS, end - VOCAB_OFFSET_ROWS
    vocab_part = slice(start, end)

    hidden = inputs["hidden"][rows, cols].to(device)
    weight = inputs["lm_head"][vocab_part].to(device)
    keep = inputs["keep_mask"] if layout.head == layouts_lib.LOGITS else None  # the other heads take none
    head = _Head(layout.head, numerics, groups.tp, targets=inputs["targets"][rows, cols].to(device),
                 row_mask=inputs["row_mask"][rows, cols].to(device), temperature=float(inputs["temperature"]),
                 entropy="grad" if float(inputs["entropy_coef"]) else "value",
                 keep=None if keep is None else keep[rows, cols, vocab_part].to(device))
    leaf_dtype = torch.float32 if layout.head == layouts_lib.UNFUSED else hidden.dtype
    # The loss's constants over the whole batch (its weights need the global counts); this rank's tokens are `index`.
    full_mask = inputs["row_mask"].to(device)
    advantages = inputs["advantages"].to(device=device, dtype=torch.float32)[:, None].expand(batch, seq)
    seq_ids = torch.arange(batch, device=device)[:, None].expand(batch, seq)
    index = torch.arange(batch * seq, device=device).reshape(batch, seq)[rows, cols].reshape(-1)
    with torch.no_grad():  # PPO's old log-probs: this layout's own forward before the step (module docstring)
        old = torch.zeros(batch, seq, device=device)
        old[rows, cols] = head.log_probs(hidden, weight)

    out = {"losses": {}}
    variants = tuple(inputs.get("variants", VARIANTS))
    for variant in variants:
        ppo_loss = ppo_ops.policy_loss(old, advantages, clip_low=CLIP_LOW, clip_high=CLIP_HIGH,
                                       entropy_coef=float(inputs["entropy_coef"]), loss_mask=full_mask,
                                       normalization=variant, seq_ids=seq_ids)
        x = hidden.detach().to(leaf_dtype).clone().requires_grad_(True)
        w = weight.detach().to(leaf_dtype).clone().requires_grad_(True)
        loss, scores, logits = head.loss(x, w, ppo_loss, index)
        loss.backward()
        # dX: the fused op all-reduced it over the TP group already; the logits path holds each TP rank's part.
        dx = x.grad.double() if layout.fused else _sum(x.grad.double(), groups.tp, groups.tp_size)
        hidden_sq = _sum(dx.square().sum(), groups.data, groups.data_size)
        head_grad = _sum(w.grad.double(), groups.data, groups.data_size)
        head_sq = _sum(head_grad.square().sum(), groups.tp, groups.tp_size)
        logits_norm = None
        if logits is not None:
            logits_norm = float(_sum(logits.grad.double().square().sum(), groups.layout, groups.layout_size).sqrt())
        out["losses"][variant] = {"loss": float(_sum(loss.detach().double(), groups.data, groups.data_size)),
                                  "logits_grad_norm": logits_norm, "hidden_grad_norm": float(hidden_sq.sqrt()),
                                  "lm_head_grad_norm": float(head_sq.sqrt())}
        if variant == variants[0]:
            out["log_probs"] = scores.log_probs.detach().float().cpu().numpy()
            out["entropy"] = scores.entropy.detach().float().cpu().numpy()
    return out


@dataclasses.dataclass
class _Head:
    """How one rank of a layout scores (layouts.LOGITS, FUSED, UNFUSED; module docstring), on its tokens."""

    kind: str
    numerics: str
    tp_group: object
    targets: torch.Tensor  # [b, s] this rank's
    row_mask: torch.Tensor  # [b, s]
    temperature: float
    entropy: str  # "grad" | "value"
    keep: Optional[torch.Tensor]  # [b, s, V_t]: LOGITS only (the others have none)

    @property
    def fused_order(self) -> str:
        """The fused head's reduction order: SGLang's under SGLANG_ON_POLICY (its bf16 logits, its log_softmax)."""
        return "sglang" if self.numerics == SGLANG_ON_POLICY else "fused"

    def _logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.kind == layouts_lib.UNFUSED:  # fp32, never rounded: the fused head's specification
            return torch.matmul(hidden.float(), weight.float().t())
        return lm_head_logits(hidden, weight, self.numerics)

    def _scores(self, logits: torch.Tensor):
        numerics = self.numerics if self.kind == layouts_lib.LOGITS else HF
        return log_probs_and_entropy(logits, self.targets, numerics=numerics, tp_group=self.tp_group,
                                     entropy=self.entropy, keep_mask=self.keep, temperature=self.temperature,
                                     row_mask=self.row_mask)

    def log_probs(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """[b, s] fp32 log-probs (a forward without the loss)."""
        import ppo_ops

        if self.kind == layouts_lib.FUSED:
            return ppo_ops.linear_log_probs_and_entropy(hidden, weight, self.targets, tp_group=self.tp_group,
                                                        temperature=self.temperature, row_mask=self.row_mask,
                                                        reduction_order=self.fused_order).log_probs
        return self._scores(self._logits(hidden, weight)).log_probs

    def loss(self, hidden: torch.Tensor, weight: torch.Tensor, ppo_loss, index: torch.Tensor):
        """(this rank's share of the loss, its LogProbsEntropy, the logits with their gradient kept or None) from the
        leaves hidden [b, s, H] and weight [V_t, H]; `ppo_loss` a TokenLoss over the batch, `index` [b * s] where this
        rank's tokens are in it."""
        import ppo_ops

        if self.kind == layouts_lib.FUSED:
            loss, scores = ppo_ops.linear_token_loss(
                hidden, weight, self.targets, lambda lp, ent, rows: ppo_loss(lp, ent, index[rows]),
                tp_group=self.tp_group, entropy=self.entropy, temperature=self.temperature, row_mask=self.row_mask,
                reduction_order=self.fused_order)
            return loss, scores, None
        logits = self._logits(hidden, weight)
        logits.retain_grad()
        scores = self._scores(logits)
        entropy = scores.entropy.reshape(-1) if ppo_loss.needs_entropy else None
        return ppo_loss(scores.log_probs.reshape(-1), entropy, index).sum(), scores, logits
