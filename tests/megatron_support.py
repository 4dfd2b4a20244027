"""The rank side of tests/test_megatron.py: megatron-core's own layers and a tiny GPTModel on spawned ranks, each case
run through ppo_ops.megatron and through Megatron's own output-layer path, the results saved for the test process.

megatron-core's attention cannot run on CPU as shipped, so most cases drive the processor with megatron-core's own
VocabParallelEmbedding and ColumnParallelLinear output layer (built and run on CPU over gloo with
use_cpu_initialization=True) and hidden states from a small per-position decoder; the GPTModel cases (local layer
spec) run on CPU too. On a CPU-only torch megatron-core 0.16.1 needs three things: torch.cuda.current_device() must
answer "cpu" (megatron-core allocates its sequence-parallel and rotary buffers there), the RNG tracker must be its
inference one (dropout is 0, so its fork has nothing to do; the training tracker forks CUDA RNG states), and the causal
attention mask must be given (the default one is made on "cuda"). gpt_log_probs makes the first and the third itself
on a CPU and names the second in its error (run_gpt_cpu_as_a_user checks that); Megatron's own path, the yardstick,
gets all three from init_megatron and the batches. On a GPU none of these apply except the tracker, and the ranks
compute on their own GPU over NCCL (tests/ranks.py).

Megatron's own path, the yardstick: its output layer forms the [S, B, V_local] logits (all-gathering sequence-parallel
hidden states itself, reduce-scattering or all-reducing dX in its backward), then ppo_ops' logits op
log_probs_and_entropy on them, then the same token loss (TokenLoss.total) or the same upstream weights.
"""

import dataclasses
import inspect
import os
import types

import torch
import torch.distributed as dist

import ppo_ops
import ppo_ops.megatron as pm
from tests.ranks import rank_device

VOCAB = 250  # the true vocabulary; V_PAD - VOCAB padded columns hold real weights that must get no mass
V_PAD = 256  # Megatron's padding: a multiple of 128 x TP at TP = 1 and 2, 8 fixed segments of 32 (TP-invariant bits)
HIDDEN = 48  # not a power of two: GEMM K tiles with a tail
WEIGHT_STD = 3.0 / HIDDEN**0.5  # embedding and output weights: logits of O(2-3), peaked but not one-hot
MIX_SCALE = 2.0  # the decoder's per-feature gains: tanh(e * gain) in [-1, 1] beside e
TEMPERATURE = 0.7
SEED = 1234

# Layouts of the rows a call scores. dense: a [B = 2, S = 8] batch with a random loss mask. packed: B = 1, samples of
# PACKED_TOTAL tokens packed into T = 32 positions (the rest padding), the last PACKED_RESPONSE of each the response,
# targets and rows from pm.packed_targets. cp2: the packed stream split for context parallelism of 2 by
# pm.zigzag_packed_targets (each sample padded to a multiple of 4: 14 rows per CP rank, both ranks holding response
# rows and padding); the processor issues no CP collective, so each TP rank runs both CP ranks' calls in turn.
LAYOUTS = ("dense", "packed", "cp2")
DENSE_SHAPE = (2, 8)
PACKED_T = 32
PACKED_TOTAL = (16, 11)
PACKED_RESPONSE = (8, 6)
CP = 2

# GPTModel (local spec): 2 layers, rotary positions, B = 2, S = 8.
GPT_HIDDEN, GPT_HEADS, GPT_LAYERS = 32, 4, 2
GPT_SHAPE = (2, 8)


@dataclasses.dataclass(frozen=True)
class Case:
    tp: int
    sp: bool  # sequence parallelism (only at TP > 1, as Megatron)
    tied: bool  # output_weight = the embedding's weight, the output layer holds none
    loss: bool  # a PPO token loss (linear_token_loss) instead of upstream weights on log-probs and entropies
    layout: str

    @property
    def name(self) -> str:
        return "-".join([f"tp{self.tp}", "sp" if self.sp else "nosp", "tied" if self.tied else "untied",
                         "ppo" if self.loss else "logprobs", self.layout])


CASES = [Case(tp, sp, tied, loss, layout)
         for tp in (1, 2) for sp in ((False,) if tp == 1 else (False, True))
         for tied in (False, True) for loss in (False, True) for layout in LAYOUTS]


@dataclasses.dataclass(frozen=True)
class GptCase:
    tp: int
    tied: bool
    loss: bool

    @property
    def name(self) -> str:
        return f"gpt-tp{self.tp}-{'tied' if self.tied else 'untied'}-{'ppo' if self.loss else 'logprobs'}"


GPT_CASES = [GptCase(tp, tied, loss) for tp in (1, 2) for tied in (False, True) for loss in (False, True)]


def results_path(out_dir, world_size, rank):
    return os.path.join(out_dir, f"tp{world_size}_rank{rank}.pt")


def run_all(rank, world_size, out_dir):
    """Every case of this TP size on this rank (tests/ranks.py's worker signature), saved for the test process."""
    device = rank_device(rank)
    init_megatron(world_size, device)
    results = {case.name: run_case(case, device) for case in CASES if case.tp == world_size}
    results.update({case.name: run_gpt_case(case, device) for case in GPT_CASES if case.tp == world_size})
    if world_size == 1:
        results["gpt-pipeline-stage"] = run_gpt_pipeline_stage(device)
    else:
        results["zigzag-vs-megatron"] = run_zigzag_vs_megatron(device)
        results["gather-vs-megatron"] = run_gather_vs_megatron(device)
    torch.save(results, results_path(out_dir, world_size, rank))


def init_megatron(tp_size, device):
    if device.type == "cpu":
        torch.cuda.current_device = lambda: "cpu"  # megatron-core allocates some buffers on the "current device"
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size, create_gloo_process_groups=False)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)  # dropout 0: forks nothing


def _config(tp, sp, dtype=torch.float32, **fields):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(use_cpu_initialization=True, params_dtype=dtype, bf16=dtype == torch.bfloat16,
                             tensor_model_parallel_size=tp, sequence_parallel=sp, attention_dropout=0.0,
                             hidden_dropout=0.0, **fields)


def _normal(std):
    return lambda w: torch.nn.init.normal_(w, std=std)


# --- the batches ---

def case_batches(case: Case):
    """One or more calls' rows: [(ids [B, S], labels [B, S], loss_mask [B, S] float, index or None)], plus the
    per-position constants of the whole batch (upstream weights or the token loss's) and the packed stream's
    kept-row count. index: cp2's positions of the packed stream (-1: padding)."""
    gen = torch.Generator().manual_seed(SEED + (case.layout != "dense"))  # packed and cp2: the same stream
    if case.layout == "dense":
        ids = torch.randint(0, VOCAB, DENSE_SHAPE, generator=gen)
        labels = torch.randint(0, VOCAB, DENSE_SHAPE, generator=gen)
        mask = (torch.rand(DENSE_SHAPE, generator=gen) < 0.7).float()
        mask[0, 0], mask[1, -1] = 1.0, 0.0
        calls, full_shape = [(ids, labels, mask, None)], DENSE_SHAPE
    else:
        tokens = torch.randint(0, VOCAB, (PACKED_T,), generator=gen)
        targets, rows = pm.packed_targets(tokens, PACKED_TOTAL, PACKED_RESPONSE)
        if case.layout == "packed":
            calls = [(tokens[None], targets[None], rows[None].float(), None)]
        else:
            calls = []
            for cp_rank in range(CP):
                tok, tgt, row = pm.zigzag_packed_targets(tokens, PACKED_TOTAL, PACKED_RESPONSE, CP, cp_rank,
                                                         multiple_of=case.tp)
                index = pm.zigzag_packed_index(PACKED_TOTAL, CP, cp_rank, multiple_of=case.tp)
                calls.append((tok[None], tgt[None], row[None].float(), index))
        full_shape = (1, PACKED_T)
    constants = dict(g_lp=0.5 + torch.rand(full_shape, generator=gen),
                     g_ent=torch.rand(full_shape, generator=gen) * 2 - 1,
                     old_log_probs=-5.5 + torch.randn(full_shape, generator=gen),
                     advantages=torch.randn(full_shape, generator=gen),
                     ref_log_probs=-5.5 + torch.randn(full_shape, generator=gen))
    return calls, constants


def local_constants(constants, index, shape):
    """The per-position constants of one call's rows (cp2: gathered by the CP index, 0 on padding)."""
    if index is None:
        return {k: v.reshape(shape) for k, v in constants.items()}
    held = index >= 0
    return {k: torch.where(held, v.reshape(-1)[index.clamp(min=0)], 0.0).reshape(shape) for k, v in constants.items()}


def token_loss_for(consts, loss_mask, n_counted):
    """PPO's clipped surrogate with an entropy bonus and k3 KL, each counted row weighted 1 / n_counted (the token
    mean over the whole batch: a CP rank's rows weigh what they weigh in the unsplit batch)."""
    return ppo_ops.policy_loss(consts["old_log_probs"], consts["advantages"], clip_low=0.2, clip_high=0.28,
                               entropy_coef=0.01, kl_coef=0.01, ref_log_probs=consts["ref_log_probs"], kl_type="k3",
                               loss_mask=loss_mask / n_counted, normalization="sum")


def hook_kwargs(hidden_states, output_layer, output_weight, labels, loss_mask, context, config):
    """Every keyword GPTModel._postprocess passes its output processor (megatron-core 0.18.0 and 0.19.0)."""
    return dict(hidden_states=hidden_states, output_layer=output_layer, output_weight=output_weight, labels=labels,
                loss_mask=loss_mask, input_ids=None, position_ids=None, attention_mask=None, decoder_input=None,
                inference_context=None, packed_seq_params=None, runtime_gather_output=None, context=context,
                compute_language_model_loss=lambda labels, logits: None, scale_logits=lambda logits: logits,
                config=config)


# --- the layer cases ---

def run_case(case: Case, device):
    """[one record per call]: the processor's and Megatron's outputs and gradients, and (every rank) the call's
    whole-TP inputs for the float64 reference."""
    from megatron.core import parallel_state, tensor_parallel

    group = parallel_state.get_tensor_model_parallel_group()
    config = _config(case.tp, case.sp, num_layers=1, hidden_size=HIDDEN, num_attention_heads=2)
    torch.manual_seed(SEED)
    emb = tensor_parallel.VocabParallelEmbedding(V_PAD, HIDDEN, init_method=_normal(WEIGHT_STD),
                                                 reduce_scatter_embeddings=case.sp, config=config).to(device)
    head = tensor_parallel.ColumnParallelLinear(HIDDEN, V_PAD, config=config, init_method=_normal(WEIGHT_STD),
                                                bias=False, gather_output=False,
                                                skip_weight_param_allocation=case.tied).to(device)
    gain = (torch.randn(HIDDEN, generator=torch.Generator().manual_seed(SEED)) * MIX_SCALE).to(device)
    calls, constants = case_batches(case)
    n_counted = sum(float(mask.sum()) for _, _, mask, _ in calls)
    records = []
    for ids, labels, mask, index in calls:
        ids, labels, mask = ids.to(device), labels.to(device), mask.to(device)
        consts = {k: v.to(device) for k, v in local_constants(constants, index, tuple(labels.shape)).items()}
        token_loss = token_loss_for(consts, mask, n_counted) if case.loss else None
        context = pm.Context(entropy="grad", temperature=TEMPERATURE, vocab_size=VOCAB, token_loss=token_loss)
        record = {"index": index, "labels": labels.cpu(), "loss_mask": mask.cpu(),
                  "constants": {k: v.cpu() for k, v in consts.items()}}
        for path in ("processor", "megatron"):
            for module in (emb, head):
                module.zero_grad(set_to_none=True)
            hidden = _decoder(emb(ids), gain, case.sp)
            hidden.retain_grad()
            output_weight = emb.weight if case.tied else None
            if path == "processor":
                out = pm.output_processor(**hook_kwargs(hidden, head, output_weight, labels, mask, context, config))
                loss, out = out if case.loss else (None, out)
            else:
                logits, _ = head(hidden, weight=output_weight)
                out = ppo_ops.log_probs_and_entropy(logits.transpose(0, 1), labels, tp_group=group, entropy="grad",
                                                    temperature=TEMPERATURE, row_mask=mask != 0, vocab_size=VOCAB)
                loss = token_loss.total(out.log_probs, out.entropy) if case.loss else None
            objective = loss if case.loss else ((consts["g_lp"] * out.log_probs).sum()
                                                + (consts["g_ent"] * out.entropy).sum())
            objective.backward()
            record[path] = _cpu(dict(log_probs=out.log_probs.detach(), entropy=out.entropy.detach(),
                                     loss=None if loss is None else loss.detach(), dx=hidden.grad,
                                     dw=None if case.tied else head.weight.grad, d_embedding=emb.weight.grad))
        with torch.no_grad():  # the whole-TP inputs of the float64 reference
            hidden = _decoder(emb(ids), gain, case.sp)
            record["hidden"] = _gather(hidden, group if case.sp else None).cpu()  # [S, B, H]
            weight = emb.weight if case.tied else head.weight
            record["weight"] = _gather(weight, group).cpu()  # [V_PAD, H]
        records.append(record)
    return records


def _decoder(embedded, gain, sp):
    """A stand-in for the decoder: [S(/tp), B, H]. Elementwise, so each CP rank's rows need no other rank's and a
    row's bits do not depend on how many rows a rank holds (TP = 1 and 2 get the same hidden states)."""
    e = embedded if sp else embedded.transpose(0, 1)  # VocabParallelEmbedding: [S/tp, B, H] under SP, else [B, S, H]
    return e + torch.tanh(e * gain)


def _gather(x, group):
    if group is None or dist.get_world_size(group) == 1:
        return x.detach()
    out = x.new_empty((x.shape[0] * dist.get_world_size(group),) + tuple(x.shape[1:]))
    dist.all_gather_into_tensor(out, x.detach().contiguous(), group=group)
    return out


def _cpu(values: dict) -> dict:
    return {k: None if v is None else v.detach().cpu().clone() for k, v in values.items()}


# --- GPTModel (local spec) through gpt_log_probs ---

def _gpt(case_tp, tied, device, dtype=torch.float32, **kwargs):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = _config(case_tp, False, dtype, num_layers=GPT_LAYERS, hidden_size=GPT_HIDDEN,
                     num_attention_heads=GPT_HEADS, init_method_std=0.3)
    torch.manual_seed(SEED)
    # Every parameter in the model's dtype, as Megatron's Float16Module casts it (the local spec's norms are torch
    # modules created in fp32)
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=V_PAD, max_sequence_length=64,
                    position_embedding_type="rope", share_embeddings_and_output_weights=tied,
                    **kwargs).to(device=device, dtype=dtype)


def gpt_batch(device):
    gen = torch.Generator().manual_seed(SEED + 7)
    b, s = GPT_SHAPE
    ids = torch.randint(0, VOCAB, GPT_SHAPE, generator=gen)
    labels = torch.cat([ids[:, 1:], torch.randint(0, VOCAB, (b, 1), generator=gen)], dim=1)
    mask = (torch.rand(GPT_SHAPE, generator=gen) < 0.75).float()
    mask[0, 0] = 1.0
    constants = dict(g_lp=0.5 + torch.rand(GPT_SHAPE, generator=gen), g_ent=torch.rand(GPT_SHAPE, generator=gen) - 0.5,
                     old_log_probs=-5.5 + torch.randn(GPT_SHAPE, generator=gen),
                     advantages=torch.randn(GPT_SHAPE, generator=gen),
                     ref_log_probs=-5.5 + torch.randn(GPT_SHAPE, generator=gen))
    position_ids = torch.arange(s).expand(b, s)
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]  # True: masked out
    on = lambda t: t.to(device)
    return on(ids), on(position_ids), on(causal), on(labels), on(mask), {k: on(v) for k, v in constants.items()}


def run_gpt_case(case: GptCase, device, dtype=torch.float32):
    """The model's own logits path (model(...) -> [B, S, V_local] -> the logits op) against gpt_log_probs, with every
    parameter's gradient; the decoder's output and the output weight for the float64 reference."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    model = _gpt(case.tp, case.tied, device, dtype)
    ids, position_ids, causal, labels, mask, consts = gpt_batch(device)
    token_loss = token_loss_for(consts, mask, float(mask.sum())) if case.loss else None
    context = pm.Context(entropy="grad", temperature=TEMPERATURE, vocab_size=VOCAB, token_loss=token_loss)
    captured = {}

    def capture(module, args, out):  # returns None: the decoder's output stays as it is
        captured.setdefault("hidden", out.detach())

    hook = model.decoder.register_forward_hook(capture)
    record = {"labels": labels.cpu(), "loss_mask": mask.cpu(), "constants": {k: v.cpu() for k, v in consts.items()},
              "parameters": [name for name, p in model.named_parameters() if p.requires_grad]}
    for path in ("processor", "megatron"):
        model.zero_grad(set_to_none=True)
        if path == "processor":
            out = pm.gpt_log_probs(model, ids, position_ids, causal, labels, mask, context)
            loss, out = out if case.loss else (None, out)
        else:
            logits = model(ids, position_ids, causal)
            out = ppo_ops.log_probs_and_entropy(logits, labels, tp_group=group, entropy="grad",
                                                temperature=TEMPERATURE, row_mask=mask != 0, vocab_size=VOCAB)
            loss = token_loss.total(out.log_probs, out.entropy) if case.loss else None
        objective = loss if case.loss else ((consts["g_lp"] * out.log_probs).sum()
                                            + (consts["g_ent"] * out.entropy).sum())
        objective.backward()
        record[path] = _cpu(dict(log_probs=out.log_probs.detach(), entropy=out.entropy.detach(),
                                 loss=None if loss is None else loss.detach()))
        record[path]["grads"] = {name: p.grad.detach().cpu().clone() for name, p in model.named_parameters()
                                 if p.grad is not None}
    hook.remove()
    record["hidden"] = captured["hidden"].cpu()  # [S, B, H], the same on every TP rank (no sequence parallelism)
    weight = model.shared_embedding_or_output_weight() if case.tied else model.output_layer.weight
    record["weight"] = _gather(weight, group).cpu()
    return record


def run_gpt_cpu_as_a_user(rank, world_size, out_dir):
    """gpt_log_probs on a CPU as a user runs it: torch.cuda.current_device left as torch has it and no attention mask
    (gpt_log_probs makes both right on the CPU), first with megatron-core's training RNG tracker (which cannot fork
    on a CPU: ppo_ops' error naming the fix, before any work), then with the inference one; the values against the
    call with the explicit causal mask."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size, create_gloo_process_groups=False)
    initialize_rng_tracker(force_reset=True)  # the training tracker, no states added (a CPU cannot add one)
    own_current_device = torch.cuda.current_device
    model = _gpt(world_size, False, torch.device("cpu"))
    ids, position_ids, causal, labels, mask, _ = gpt_batch(torch.device("cpu"))
    context = pm.Context(entropy="grad", temperature=TEMPERATURE, vocab_size=VOCAB)
    record = {}
    try:
        pm.gpt_log_probs(model, ids, position_ids, None, labels, mask, context)
        record["tracker_error"] = None
    except Exception as err:  # saved for the test process to check
        record["tracker_error"] = (type(err).__name__, getattr(err, "ppo_ops_argument", None), str(err))
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    with torch.no_grad():
        record["no_mask"] = pm.gpt_log_probs(model, ids, position_ids, None, labels, mask, context).log_probs
        record["causal"] = pm.gpt_log_probs(model, ids, position_ids, causal, labels, mask, context).log_probs
    record["current_device_restored"] = torch.cuda.current_device is own_current_device
    torch.save(record, results_path(out_dir, world_size, rank))


def run_gpt_bf16(rank, world_size, out_dir):
    """A bf16 GPTModel (tied, as Qwen3-0.6B) at TP = 1 on a GPU: the compiled kernels' path (cuBLAS GEMMs and the
    logits op's Triton passes) against the model's bf16 logits."""
    device = rank_device(rank)
    init_megatron(world_size, device)
    record = run_gpt_case(GptCase(1, True, False), device, torch.bfloat16)
    torch.save(record, results_path(out_dir, world_size, rank))


def run_gpt_pipeline_stage(device):
    """A stage before the last (post_process=False): gpt_log_probs hands back the decoder's hidden states, as
    model(...) does, and calls no processor."""
    model = _gpt(1, False, device, post_process=False)
    ids, position_ids, causal, labels, mask, _ = gpt_batch(device)
    context = pm.Context(entropy="grad", temperature=TEMPERATURE, vocab_size=VOCAB)
    with torch.no_grad():
        return {"gpt_log_probs": pm.gpt_log_probs(model, ids, position_ids, causal, labels, mask, context).cpu(),
                "model": model(ids, position_ids, causal).cpu()}


def run_zigzag_vs_megatron(device):
    """megatron-core's get_batch_on_this_cp_rank over the world as the CP group (ranks = CP ranks) against
    pm.zigzag_split, for [B, S] tensors and the [B, 1, S, S] attention mask."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    gen = torch.Generator().manual_seed(SEED + 11)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=gen).to(device)
    attention = (torch.rand(2, 1, 16, 16, generator=gen) < 0.5).to(device)
    ours = {"tokens": pm.zigzag_split(tokens, dist.get_world_size(), dist.get_rank(), dim=1),
            "attention_mask": pm.zigzag_split(attention, dist.get_world_size(), dist.get_rank(), dim=2)}
    extra = {"is_hybrid_cp": False} if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters else {}
    theirs = get_batch_on_this_cp_rank({"tokens": tokens, "attention_mask": attention}, cp_group=dist.group.WORLD,
                                       **extra)  # 0.19 added is_hybrid_cp
    return {"ours": _cpu(ours), "megatron": _cpu(theirs)}


def run_gather_vs_megatron(device):
    """pm.gather_sequence_parallel against megatron-core's gather_from_sequence_parallel_region: the same [S, B, H]
    forward and the same reduce-scattered gradient for one upstream gradient (different on each rank)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    group = parallel_state.get_tensor_model_parallel_group()
    gen = torch.Generator().manual_seed(SEED + 13 + dist.get_rank())
    local = torch.randn(3, 2, HIDDEN, generator=gen).to(device)
    upstream = torch.randn(3 * dist.get_world_size(), 2, HIDDEN, generator=gen).to(device)
    out = {}
    for name, gather in (("ours", pm.gather_sequence_parallel),
                         ("megatron", lambda x, g: gather_from_sequence_parallel_region(x, group=g))):
        x = local.clone().requires_grad_(True)
        y = gather(x, group)
        (y * upstream).sum().backward()
        out[name] = _cpu({"gathered": y, "grad": x.grad})
    return out


def run_short_token_loss(rank, world_size, out_dir, sequence_parallel):
    """output_processor at TP = world_size over the world group, only rank 1's token loss one constant short per
    row: every rank's error, saved (type, argument named, message), or None where none was raised."""
    gen = torch.Generator().manual_seed(SEED + 17)
    b, s = DENSE_SHAPE
    s_local = s // world_size if sequence_parallel else s
    hidden = torch.randn(s, b, HIDDEN, generator=gen)[rank * s_local:(rank + 1) * s_local]
    weight = (torch.randn(V_PAD, HIDDEN, generator=gen) * WEIGHT_STD)[rank * V_PAD // world_size:
                                                                       (rank + 1) * V_PAD // world_size]
    labels = torch.randint(0, VOCAB, DENSE_SHAPE, generator=gen)
    shape = (b, s - 1) if rank == 1 else (b, s)
    token_loss = ppo_ops.policy_loss(torch.zeros(shape), torch.ones(shape))
    layer = types.SimpleNamespace(weight=weight, bias=None, sequence_parallel=sequence_parallel)
    context = pm.Context(entropy="grad", vocab_size=VOCAB, token_loss=token_loss, tp_group=dist.group.WORLD)
    try:
        pm.output_processor(**hook_kwargs(hidden, layer, None, labels, None, context, None))
        record = None
    except Exception as err:  # saved for the test process to check
        record = (type(err).__name__, getattr(err, "ppo_ops_argument", None), str(err))
    torch.save(record, results_path(out_dir, world_size, rank))
