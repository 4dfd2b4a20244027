"""ppo_ops.megatron: the output processor and gpt_log_probs against megatron-core's own output-layer path and float64,
in Megatron's layouts, and the batch helpers.

Spawned ranks (tests/megatron_support.py: megatron-core's VocabParallelEmbedding and ColumnParallelLinear, and a tiny
GPTModel with the local layer spec) run every case twice, through the processor and through Megatron's own path (its
output layer's logits, then ppo_ops' logits op), at TP = 1 and 2: sequence parallelism on and off, tied and untied
embeddings, Megatron's padded vocabulary (250 true tokens in 256 columns), temperature 0.7, dense rows with a loss
mask, packed samples with response-only rows, context parallelism of 2 (zigzag rows), log-probs with upstream weights
or a PPO token loss. Checked here: log-probs, entropies, loss, dX (this rank's rows under sequence parallelism, the
full dX otherwise) and the weight's gradient against the float64 reference with per-element bounds of the GEMMs'
rounding (tests/linear_support.py), for both paths; the processor against Megatron's path; bits across TP sizes and
between the CP ranks' rows and the unsplit batch. The rest runs in this process: the batch helpers against slow
references, the hook's keyword set, the version dispatch, MuP, errors, the keep set.

megatron-core 0.16.1 (the venv's) has no output_processor hook: the processor is called with exactly the keywords of
0.18.0's and 0.19.0's GPTModel._postprocess, and gpt_log_probs takes its path without the hook on the real GPTModel.
"""

import dataclasses
import inspect
import re
import types

import pytest
import torch

import ppo_ops
import ppo_ops.megatron as pm
from tests import megatron_support as ms
from tests.linear_support import SAFETY, U32, UNIT_ROUNDOFF, assert_within, bounds
from tests.reference import assert_entropy_close, assert_log_probs_close, reference_log_probs_and_entropy
from tests.ranks import DEVICE, run_gloo, run_ranks

# --- tolerances ---
# The processor and Megatron's path each lie within the float64 bound (checked for both); their difference lies within
# the sum of the two bounds.
VS_MEGATRON = 2.0
# The loss is an fp32 sum over T rows: T ulps of the sum of |terms| on top of the terms' own bound.
LOSS_SUM_ULPS = 1.0
# Embedding gradients (tied: the head's dW plus the lookup's; untied: the lookup's) and GPTModel parameters' gradients,
# processor against Megatron's path, relative to the tensor's largest entry: both carry dlogits within a few fp32
# roundings of float64 (bounded per element above) through the same backward; 2^-16 is far above that and far below a
# wrong term (a gradient summed twice, a dropped row, a padded column with mass: O(1) relative).
GRAD_REL = 2.0**-16


# --- the spawned ranks' results, once per TP size ---

@pytest.fixture(scope="module")
def ranks_results(tmp_path_factory):
    cache = {}

    def results(tp):
        if tp not in cache:
            out_dir = str(tmp_path_factory.mktemp(f"megatron_tp{tp}"))
            run_ranks(tp, ms.run_all, out_dir)
            cache[tp] = [torch.load(ms.results_path(out_dir, tp, r), weights_only=False) for r in range(tp)]
        return cache[tp]

    return results


def _case_param(case):
    marks = [pytest.mark.world_size(case.tp)] if case.tp > 1 else []
    return pytest.param(case, id=case.name, marks=marks)


def _rounding(with_loss, hidden, weight):
    """The bounds' rounding terms of the head's path on this device (tests/test_linear_*.py): on CUDA the token loss
    rounds dlogits to the input dtype and may keep probabilities as fp16; fp32 log-probs take the Triton tiles."""
    if DEVICE.type != "cuda" or not with_loss:
        return dict(dl_roundoff=0.0, prob_storage=False)
    from ppo_ops.lm_head import segment_gemms, token_loss_blocks

    h = hidden.reshape(-1, hidden.shape[-1]).to(DEVICE)
    passes = segment_gemms.backend("triton").passes
    return dict(dl_roundoff=UNIT_ROUNDOFF[hidden.dtype],
                prob_storage=token_loss_blocks.keeps_probs(passes, h, weight.to(DEVICE)))


def _reference(record, with_loss, n_counted):
    """Float64 values and bounds of one call (bounds() of tests/linear_support.py), with the token loss's upstream
    gradients taken at the reference values and the loss's own reference and bound."""
    hidden = record["hidden"].transpose(0, 1)  # [B, S, H]: the labels' layout
    weight, labels, mask, consts = record["weight"], record["labels"], record["loss_mask"] != 0, record["constants"]
    opts = dict(temperature=ms.TEMPERATURE, vocab_size=ms.VOCAB, row_mask=mask, **_rounding(with_loss, hidden, weight))
    if not with_loss:
        return bounds(hidden, weight, labels, consts["g_lp"], consts["g_ent"], **opts), None
    zero = torch.zeros(labels.shape)
    plain = bounds(hidden, weight, labels, zero, zero, **opts)
    token_loss = ms.token_loss_for(consts, record["loss_mask"], n_counted)
    lp = plain["log_probs"][0].float().reshape(-1).requires_grad_(True)
    ent = plain["entropy"][0].float().reshape(-1).requires_grad_(True)
    terms = token_loss(lp, ent, torch.arange(lp.numel()))
    g_lp, g_ent = torch.autograd.grad(terms.sum(), (lp, ent))
    terms = terms.detach()
    b = bounds(hidden, weight, labels, g_lp.reshape(labels.shape), g_ent.reshape(labels.shape), **opts)
    lp_tol, ent_tol = b["log_probs"][1].reshape(-1), b["entropy"][1].reshape(-1)
    loss_tol = (SAFETY * (g_lp.double().abs() * lp_tol + g_ent.double().abs() * ent_tol).sum()
                + LOSS_SUM_ULPS * terms.numel() * U32 * terms.double().abs().sum())
    return b, (terms.double().sum(), float(loss_tol))


def _dx_rows(ref_and_tol, case, rank):
    """The [B, S, H] reference dX as this rank's dX: [S, B, H], its own S / tp rows under sequence parallelism."""
    ref, tol = (t.transpose(0, 1) for t in ref_and_tol)
    if case.sp:
        rows = ref.shape[0] // case.tp
        ref, tol = ref[rank * rows:(rank + 1) * rows], tol[rank * rows:(rank + 1) * rows]
    return ref, tol


def _dw_rows(ref_and_tol, tp, rank):
    ref, tol = ref_and_tol
    rows = ref.shape[0] // tp
    return ref[rank * rows:(rank + 1) * rows], tol[rank * rows:(rank + 1) * rows]


def _assert_rel(name, got, want, rel=GRAD_REL):
    scale = want.abs().max().clamp(min=1e-30)
    err = (got - want).abs().max()
    assert err <= rel * scale, (f"{name}: max difference {err:.3e} is {err / scale:.2e} of the largest entry "
                                f"(> {rel:.1e})")


def _n_counted(records):
    return sum(float(r["loss_mask"].sum()) for r in records)


# --- the processor in Megatron's layouts ---

def _check_case_once(case, ranks):
    for rank, calls in enumerate(ranks):
        records = calls[case.name]
        n_counted = _n_counted(records)
        for call, record in enumerate(records):
            where = f"{case.name} rank {rank} call {call}"
            b, loss_ref = _reference(record, case.loss, n_counted)
            dx, dw = _dx_rows(b["dx"], case, rank), None if case.tied else _dw_rows(b["dw"], case.tp, rank)
            for path in ("processor", "megatron"):
                got = record[path]
                assert got["log_probs"].shape == record["labels"].shape and got["log_probs"].dtype == torch.float32
                assert_within(f"{where} {path} log_probs", got["log_probs"], b["log_probs"])
                assert_within(f"{where} {path} entropy", got["entropy"], b["entropy"])
                assert_within(f"{where} {path} dx", got["dx"], dx)
                if dw is not None:
                    assert_within(f"{where} {path} dw", got["dw"], dw)
                if case.loss:
                    err = abs(float(got["loss"]) - float(loss_ref[0]))
                    assert err <= loss_ref[1], f"{where} {path} loss: error {err:.3e} over its bound {loss_ref[1]:.3e}"
            ours, theirs = record["processor"], record["megatron"]
            for name, (_, tol) in (("log_probs", b["log_probs"]), ("entropy", b["entropy"]), ("dx", dx)) + (
                    (("dw", dw),) if dw is not None else ()):
                assert_within(f"{where} processor vs megatron {name}", ours[name], (theirs[name].double(),
                                                                                      VS_MEGATRON * tol))
            if case.loss:
                err = abs(float(ours["loss"]) - float(theirs["loss"]))
                assert err <= VS_MEGATRON * loss_ref[1], f"{where} loss: processor vs megatron {err:.3e}"
            name = "tied weight (embedding)" if case.tied else "embedding (lookup only)"
            _assert_rel(f"{where} {name} gradient", ours["d_embedding"], theirs["d_embedding"])


@pytest.mark.parametrize("case", [_case_param(c) for c in ms.CASES])
def test_processor_matches_float64_and_megatron(case, ranks_results):
    _check_case_once(case, ranks_results(case.tp))


@pytest.mark.world_size(2)
@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in ms.CASES if c.tp == 2])
def test_values_and_dw_bitwise_across_tp(case, ranks_results):
    """Log-probs, entropies (and the untied head's dW) at TP = 2 are those of TP = 1 bit for bit (the head's
    guarantee at V = 256, eight fixed segments), sequence parallel or not: the processor's gather and the head's
    merge change nothing."""
    tp1 = ranks_results(1)[0][ms.Case(1, False, case.tied, case.loss, case.layout).name]
    for rank, calls in enumerate(ranks_results(2)):
        for one, two in zip(tp1, calls[case.name]):
            for name in ("log_probs", "entropy"):
                assert torch.equal(one["processor"][name], two["processor"][name]), f"rank {rank} {name}"
            if not case.tied:
                rows = one["processor"]["dw"].shape[0] // 2
                assert torch.equal(one["processor"]["dw"][rank * rows:(rank + 1) * rows], two["processor"]["dw"])


@pytest.mark.parametrize("case", [_case_param(c) for c in ms.CASES if c.layout == "cp2"])
def test_cp_ranks_rows_are_the_unsplit_rows(case, ranks_results):
    """Each CP rank's call scores its zigzag rows (targets built on the whole stream before the split) exactly as the
    unsplit packed batch scores them: log-probs and entropies at the index's positions (bitwise with the PyTorch
    backend: a row's values do not depend on the other rows of the call), padding rows 0; the CP ranks' losses and
    dW add up to the unsplit batch's within their float64 bounds."""
    packed = dataclasses.replace(case, layout="packed")
    for rank, calls in enumerate(ranks_results(case.tp)):
        whole = calls[packed.name][0]
        parts = calls[case.name]
        n_counted = _n_counted(parts)
        b_whole, loss_whole = _reference(whole, case.loss, n_counted)
        for part in parts:
            index = part["index"]
            held = index >= 0
            b_part, _ = _reference(part, case.loss, n_counted)
            for name in ("log_probs", "entropy"):
                got = part["processor"][name].reshape(-1)
                want = whole["processor"][name].reshape(-1)[index.clamp(min=0)]
                assert torch.equal(got[~held], torch.zeros_like(got[~held])), f"{name}: padding rows"
                tol = b_part[name][1].reshape(-1) + b_whole[name][1].reshape(-1)[index.clamp(min=0)]
                if DEVICE.type == "cpu":
                    assert torch.equal(got[held], want[held]), f"rank {rank} {name}: CP rows differ from unsplit"
                else:
                    assert_within(f"rank {rank} {name}", got[held], (want[held].double(), tol[held]))
        if case.loss:
            split = sum(float(p["processor"]["loss"]) for p in parts)
            tol = loss_whole[1] + sum(_reference(p, True, n_counted)[1][1] for p in parts)
            assert abs(split - float(whole["processor"]["loss"])) <= tol
        if not case.tied:
            split = sum(p["processor"]["dw"].double() for p in parts)
            tol = _dw_rows(b_whole["dw"], case.tp, rank)[1] + sum(
                _dw_rows(_reference(p, case.loss, n_counted)[0]["dw"], case.tp, rank)[1] for p in parts)
            assert_within(f"rank {rank} dw (CP ranks summed)", split, (whole["processor"]["dw"].double(), tol))


# --- GPTModel through gpt_log_probs (the path without the hook: megatron-core 0.16.1) ---

def _gpt_param(case):
    marks = [pytest.mark.world_size(case.tp)] if case.tp > 1 else []
    return pytest.param(case, id=case.name, marks=marks)


@pytest.mark.parametrize("case", [_gpt_param(c) for c in ms.GPT_CASES])
def test_gpt_log_probs_matches_the_models_logits_path(case, ranks_results):
    """gpt_log_probs on a GPTModel (local spec, rotary positions, padded vocabulary) against the model's own logits
    (model(...) -> [B, S, V_local]) through the logits op: values and loss within float64 bounds of the decoder's
    output and the output weight, for both; every parameter's gradient (embedding, layers, output layer or the tied
    embedding) processor against model."""
    for rank, calls in enumerate(ranks_results(case.tp)):
        record = calls[case.name]
        where = f"{case.name} rank {rank}"
        b, loss_ref = _reference(record, case.loss, float(record["loss_mask"].sum()))
        for path in ("processor", "megatron"):
            assert_within(f"{where} {path} log_probs", record[path]["log_probs"], b["log_probs"])
            assert_within(f"{where} {path} entropy", record[path]["entropy"], b["entropy"])
            if case.loss:
                err = abs(float(record[path]["loss"]) - float(loss_ref[0]))
                assert err <= loss_ref[1], f"{where} {path} loss: error {err:.3e} over {loss_ref[1]:.3e}"
        ours, theirs = record["processor"]["grads"], record["megatron"]["grads"]
        assert set(ours) == set(theirs) == set(record["parameters"]), "every parameter gets a gradient on both paths"
        if case.tied:
            assert not any(name.startswith("output_layer.") for name in ours), "tied: the output layer holds no weight"
        for name in ours:
            _assert_rel(f"{where} grad of {name}", ours[name], theirs[name])


# Megatron's own path rounds its logits to bf16 once (the fused head never does): log-probs move by at most twice the
# largest logit change (d log p / d z has l1 norm <= 2), entropies by that change times 2 max |z| / t.
BF16_LOGIT_ROUNDING = UNIT_ROUNDOFF[torch.bfloat16]
# bf16 gradients of the two paths, relative to each tensor's largest entry: Megatron's dlogits come from bf16-rounded
# logits and are rounded to bf16 before its GEMMs, the head's carry its fp16 probabilities' rounding; both then run
# bf16 backward GEMMs through two layers: a few bf16 ulps (2^-8) of the largest entry, summed (2^-5.7 measured with
# the PyTorch backend on CPU). 2^-3 still fails a gradient summed twice or a row dropped (O(1)).
GRAD_REL_BF16 = 2.0**-3


@pytest.mark.device("cuda")  # bf16 through the compiled kernels: the GPU targets
def test_gpt_log_probs_bf16_on_cuda(tmp_path):
    """A bf16 GPTModel (tied embeddings, local spec) at TP = 1: gpt_log_probs' values within the float64 bounds of
    the bf16 decoder output and weight; the model's bf16 logits path within those plus one bf16 rounding of the
    logits; every parameter's gradient processor against model."""
    run_ranks(1, ms.run_gpt_bf16, str(tmp_path))
    record = torch.load(ms.results_path(str(tmp_path), 1, 0), weights_only=False)
    b, _ = _reference(record, False, float(record["loss_mask"].sum()))
    z = (record["hidden"].double().transpose(0, 1) @ record["weight"].double().T)[..., :ms.VOCAB] / ms.TEMPERATURE
    z_max = z.abs().amax(-1)
    rounding = {"log_probs": 2 * BF16_LOGIT_ROUNDING * z_max,
                "entropy": 2 * z_max * BF16_LOGIT_ROUNDING * z_max}
    mask = record["loss_mask"] != 0
    for name in ("log_probs", "entropy"):
        assert_within(f"processor {name}", record["processor"][name], b[name])
        ref, tol = b[name]
        assert_within(f"megatron {name}", record["megatron"][name], (ref, tol + torch.where(mask, rounding[name], 0.0)))
    ours, theirs = record["processor"]["grads"], record["megatron"]["grads"]
    assert set(ours) == set(theirs) == set(record["parameters"]), "every parameter gets a gradient on both paths"
    for name in ours:
        assert ours[name].dtype == torch.bfloat16
        _assert_rel(f"grad of {name}", ours[name].float(), theirs[name].float(), GRAD_REL_BF16)


def test_gpt_log_probs_on_an_earlier_pipeline_stage(ranks_results):
    """A stage before the last (post_process=False) gets the decoder's hidden states back, as from model(...)."""
    record = ranks_results(1)[0]["gpt-pipeline-stage"]
    assert torch.equal(record["gpt_log_probs"], record["model"])


@pytest.mark.world_size(2)
def test_zigzag_split_is_megatrons_cp_split(ranks_results):
    """pm.zigzag_split equals megatron-core's get_batch_on_this_cp_rank on each of 2 CP ranks (tokens [B, S] along 1,
    the attention mask [B, 1, S, S] along 2)."""
    for record in (calls["zigzag-vs-megatron"] for calls in ranks_results(2)):
        for key in ("tokens", "attention_mask"):
            assert torch.equal(record["ours"][key], record["megatron"][key]), key


@pytest.mark.world_size(2)
def test_sequence_parallel_gather_is_megatrons(ranks_results):
    """The processor's own sequence-parallel gather (any device and backend) against megatron-core's mapping: the
    same gathered rows and the same reduce-scattered gradient on each rank."""
    for rank, calls in enumerate(ranks_results(2)):
        record = calls["gather-vs-megatron"]
        for key in ("gathered", "grad"):
            assert torch.equal(record["ours"][key], record["megatron"][key]), f"rank {rank} {key}"


# --- the hook's call in this process (one rank, no Megatron parallel state) ---

class _Layer(torch.nn.Module):
    """An output layer as the processor reads one: a weight, and the attributes of ColumnParallelLinear it uses."""

    def __init__(self, weight, **attrs):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)
        self.bias = None
        for name, value in attrs.items():
            setattr(self, name, value)


def _inputs(b=2, s=5, seed=3):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(s, b, ms.HIDDEN, generator=gen)
    weight = torch.randn(ms.V_PAD, ms.HIDDEN, generator=gen) * ms.WEIGHT_STD
    labels = torch.randint(0, ms.VOCAB, (b, s), generator=gen)
    mask = (torch.rand(b, s, generator=gen) < 0.7).float()
    return hidden, weight, labels, mask


def _direct(hidden, weight, labels, mask, temperature=ms.TEMPERATURE, **opts):
    """The head called directly on the labels' layout: what the processor must equal bit for bit."""
    return ppo_ops.linear_log_probs_and_entropy(hidden.transpose(0, 1), weight, labels, row_mask=mask != 0,
                                                vocab_size=ms.VOCAB, temperature=temperature, **opts)


def test_processor_is_the_head_on_the_labels_layout():
    """With the hook's full keyword set: [B, S] fp32 outputs bit for bit those of the head on hidden.transpose(0, 1);
    loss_mask == 0 rows give 0 and a zero gradient; entropy="none" gives None."""
    hidden, weight, labels, mask = _inputs()
    layer = _Layer(weight)
    for entropy in ("none", "grad"):
        context = pm.Context(entropy=entropy, temperature=ms.TEMPERATURE, vocab_size=ms.VOCAB)
        h = hidden.clone().requires_grad_(True)
        out = pm.output_processor(**ms.hook_kwargs(h, layer, None, labels, mask, context, None))
        want = _direct(hidden, weight, labels, mask, entropy=entropy)
        assert out.log_probs.shape == labels.shape and out.log_probs.dtype == torch.float32
        assert torch.equal(out.log_probs, want.log_probs)
        assert (out.entropy is None) if entropy == "none" else torch.equal(out.entropy, want.entropy)
        out.log_probs.sum().backward()
        masked = (mask == 0).T  # [S, B], hidden's leading layout
        assert torch.equal(h.grad[masked], torch.zeros_like(h.grad[masked]))
        assert bool((out.log_probs[mask == 0] == 0).all())
    # Context.working_memory reaches the general head (a bad one is its error, naming it)
    bad = pm.Context(entropy="grad", vocab_size=ms.VOCAB, working_memory=-1)
    with pytest.raises(ValueError, match="linear_log_probs_and_entropy: .*working_memory"):
        pm.output_processor(**ms.hook_kwargs(hidden, layer, None, labels, mask, bad, None))


def test_processor_token_loss_returns_the_loss_and_values():
    hidden, weight, labels, mask = _inputs(seed=5)
    consts = {k: v.reshape(-1)[: labels.numel()].reshape(labels.shape)
              for k, v in ms.case_batches(ms.CASES[0])[1].items()}
    token_loss = ms.token_loss_for(consts, mask, float(mask.sum()))
    context = pm.Context(entropy="grad", temperature=ms.TEMPERATURE, vocab_size=ms.VOCAB, token_loss=token_loss)
    loss, out = pm.output_processor(**ms.hook_kwargs(hidden, _Layer(weight), None, labels, mask, context, None))
    want_loss, want = ppo_ops.linear_token_loss(hidden.transpose(0, 1), weight, labels, token_loss, entropy="grad",
                                                temperature=ms.TEMPERATURE, vocab_size=ms.VOCAB, row_mask=mask != 0)
    assert torch.equal(loss, want_loss) and torch.equal(out.log_probs, want.log_probs)
    assert torch.equal(out.entropy, want.entropy)
    # the token loss's working_memory reaches it (a bad one is its error, naming it)
    bad = dataclasses.replace(context, working_memory=-1)
    with pytest.raises(ValueError, match="linear_token_loss: .*working_memory"):
        pm.output_processor(**ms.hook_kwargs(hidden, _Layer(weight), None, labels, mask, bad, None))


def test_processor_uses_output_weight_over_the_layers():
    """Tied embeddings: output_weight (the shared embedding weight) is the weight, and gets the gradient."""
    hidden, weight, labels, mask = _inputs(seed=7)
    shared = weight.clone().requires_grad_(True)
    layer = _Layer(torch.zeros_like(weight))
    context = pm.Context(entropy="grad", temperature=ms.TEMPERATURE, vocab_size=ms.VOCAB)
    out = pm.output_processor(**ms.hook_kwargs(hidden, layer, shared, labels, mask, context, None))
    assert torch.equal(out.log_probs, _direct(hidden, weight, labels, mask, entropy="grad").log_probs)
    out.log_probs.sum().backward()
    assert shared.grad is not None and shared.grad.abs().sum() > 0 and layer.weight.grad is None


def test_mup_output_multiplier_folds_into_the_temperature():
    """megatron-core's MuP scales logits by mup_output_mult: (z * m) / t is z / (t / m)."""
    hidden, weight, labels, mask = _inputs(seed=9)
    config = types.SimpleNamespace(use_mup=True, mup_output_mult=0.5, sequence_parallel=False)
    context = pm.Context(entropy="grad", temperature=ms.TEMPERATURE, vocab_size=ms.VOCAB)
    out = pm.output_processor(**ms.hook_kwargs(hidden, _Layer(weight), None, labels, mask, context, config))
    want = _direct(hidden, weight, labels, mask, temperature=ms.TEMPERATURE / 0.5, entropy="grad")
    assert torch.equal(out.log_probs, want.log_probs) and torch.equal(out.entropy, want.entropy)


@pytest.mark.parametrize("bad, argument, error", [
    (dict(context="not a Context"), "output_processor_context", TypeError),
    (dict(labels=None), "labels", ValueError),
    (dict(output_layer=None), "no weight", ValueError),
    (dict(labels="short"), "labels must be [B, S]", ValueError),
    (dict(bias=True), "bias", NotImplementedError),
    (dict(config=types.SimpleNamespace(defer_embedding_wgrad_compute=True)), "defer_embedding_wgrad_compute",
     NotImplementedError),
])
def test_processor_errors_name_the_argument(bad, argument, error):
    hidden, weight, labels, mask = _inputs()
    layer = _Layer(weight)
    if bad.pop("bias", False):
        layer.bias = torch.nn.Parameter(torch.zeros(ms.V_PAD))
    kwargs = ms.hook_kwargs(hidden, layer, None, labels, mask, pm.Context(), None)
    if bad.get("labels") == "short":
        bad["labels"] = labels[:, :-1]
    kwargs.update(bad)
    with pytest.raises(error, match=f"megatron.output_processor: .*{re.escape(argument)}"):
        pm.output_processor(**kwargs)


def test_output_processor_takes_the_hooks_keywords():
    """Every keyword 0.18.0's / 0.19.0's _postprocess passes is accepted (the unused ones through **unused)."""
    params = inspect.signature(pm.output_processor).parameters
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    required = {name for name, p in params.items() if p.default is inspect.Parameter.empty
                and p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert required <= set(ms.hook_kwargs(*[None] * 7))


# --- gpt_log_probs' dispatch to the hook (megatron-core >= 0.18), without such a megatron-core here ---

class _HookedGPT(torch.nn.Module):
    """A GPTModel as megatron-core >= 0.18 presents it to gpt_log_probs: forward takes output_processor and calls it
    with _postprocess's keywords; post_process, share_embeddings_and_output_weights and _preprocess exist."""

    post_process = True
    share_embeddings_and_output_weights = False

    def __init__(self, weight):
        super().__init__()
        self.output_layer = _Layer(weight)
        self.calls = []

    def _preprocess(self, **kwargs):
        raise AssertionError("the hook path does not run the model's pieces itself")

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                inference_context=None, packed_seq_params=None, extra_block_kwargs=None, runtime_gather_output=None,
                *, inference_params=None, loss_mask=None, padding_mask=None, output_processor=None,
                output_processor_context=None):
        self.calls.append(dict(loss_mask=loss_mask, labels=labels))
        return output_processor(**ms.hook_kwargs(input_ids, self.output_layer, None, labels, loss_mask,
                                                 output_processor_context, None))


class _TupleWrapper(torch.nn.Module):
    """Float16Module's output conversion: tuples come back as plain tuples."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        out = self.module(*args, **kwargs)
        return tuple(tuple(x) if isinstance(x, tuple) else x for x in out)


def test_gpt_log_probs_calls_the_hook_where_the_model_has_one():
    hidden, weight, labels, mask = _inputs(seed=13)
    model = _HookedGPT(weight)
    context = pm.Context(entropy="grad", temperature=ms.TEMPERATURE, vocab_size=ms.VOCAB)
    out = pm.gpt_log_probs(_TupleWrapper(model), hidden, None, None, labels, mask, context)
    assert isinstance(out, ppo_ops.LogProbsEntropy) and len(model.calls) == 1 and model.calls[0]["loss_mask"] is mask
    want = _direct(hidden, weight, labels, mask, entropy="grad")
    assert torch.equal(out.log_probs, want.log_probs) and torch.equal(out.entropy, want.entropy)


def _preprocess_0_15(input_ids, position_ids, decoder_input=None, inference_context=None, packed_seq_params=None):
    raise AssertionError("not called")


def _preprocess_0_16(input_ids, position_ids, decoder_input=None, inference_context=None, packed_seq_params=None,
                     padding_mask=None):
    raise AssertionError("not called")


class _PreHookGPT(torch.nn.Module):
    """A GPTModel of a megatron-core without the hook: 0.15's or 0.16's _preprocess, with or without MTP."""

    post_process = True

    def __init__(self, with_padding_mask, mtp_process=False):
        super().__init__()
        self.mtp_process = mtp_process
        self.config = types.SimpleNamespace()
        self._preprocess = _preprocess_0_16 if with_padding_mask else _preprocess_0_15

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None, **kwargs):
        raise AssertionError("not called")


@pytest.mark.parametrize("model, error, match", [
    (_PreHookGPT(with_padding_mask=False), RuntimeError, "needs 0.16 or 0.17 .* or >= 0.18"),
    (_PreHookGPT(with_padding_mask=True, mtp_process=True), NotImplementedError, "multi-token prediction"),
])
def test_gpt_log_probs_refuses_what_it_cannot_run(model, error, match):
    with pytest.raises(error, match=match):
        pm.gpt_log_probs(model, None, None, None, None, None, pm.Context())


# --- the keep set ---

@pytest.mark.device("cpu")  # the pass-through is device-independent; a GPU target may not skip
def test_keep_reaches_the_head_in_label_layout():
    """Context.keep goes to the head unchanged, the rows being the flattened [B * S] label-layout positions: the
    processor's values equal the head's on hidden.transpose(0, 1) with the same keep set."""
    hidden, weight, labels, mask = _inputs(seed=17)
    gen = torch.Generator().manual_seed(18)
    per_row = torch.randint(1, 6, (labels.numel(),), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), per_row.cumsum(0)])
    ids = torch.randint(0, ms.VOCAB, (int(offsets[-1]),), generator=gen)
    context = pm.Context(entropy="grad", temperature=ms.TEMPERATURE, vocab_size=ms.VOCAB, keep=(ids, offsets))
    out = pm.output_processor(**ms.hook_kwargs(hidden, _Layer(weight), None, labels, mask, context, None))
    want = _direct(hidden, weight, labels, mask, entropy="grad", keep=(ids, offsets))
    assert torch.equal(out.log_probs, want.log_probs) and torch.equal(out.entropy, want.entropy)


# --- the batch helpers ---

def _slow_packed_targets(tokens, total_lengths, response_lengths):
    targets, rows = [0] * len(tokens), [False] * len(tokens)
    start = 0
    for length, response in zip(total_lengths, response_lengths):
        for i in range(start, start + length - 1):
            targets[i] = int(tokens[i + 1])
            rows[i] = i + 1 >= start + length - response
        start += length
    return torch.tensor(targets), torch.tensor(rows)


@pytest.mark.parametrize("total, response, t", [
    ((6, 7), (3, 4), 16),  # two samples and padding after them
    ((5,), (5,), 5),  # a response without a prompt: its first token has no predictor
    ((4, 0, 3, 1), (1, 0, 3, 0), 9),  # an empty sample, a one-token sample, no padding... and one spare position
    ((), (), 4),  # nothing packed: all padding
])
def test_packed_targets(total, response, t):
    tokens = torch.randint(0, ms.VOCAB, (t,), generator=torch.Generator().manual_seed(t))
    targets, rows = pm.packed_targets(tokens, list(total), torch.tensor(response, dtype=torch.int64))
    want_targets, want_rows = _slow_packed_targets(tokens, total, response)
    assert torch.equal(targets, want_targets) and torch.equal(rows, want_rows)
    assert targets.dtype == tokens.dtype and rows.dtype == torch.bool
    assert int(rows.sum()) == sum(max(0, min(r, n - 1)) for n, r in zip(total, response))


def _slow_zigzag_index(total_lengths, cp, rank, multiple_of):
    """The THD split (slime's, TransformerEngine's) written out: samples padded to 2 cp chunks, keeping r, 2cp-1-r."""
    index, start = [], 0
    for length in total_lengths:
        chunk = -(-length // (2 * cp))
        for c in (rank, 2 * cp - 1 - rank):
            index += [start + p if p < length else -1 for p in range(c * chunk, (c + 1) * chunk)]
        start += length
    index += [-1] * (-len(index) % multiple_of)
    return index


@pytest.mark.parametrize("total, cp, multiple_of", [
    ((6, 7), 2, 1),  # the tests' packed batch
    ((13, 1, 8), 4, 8),  # lengths below, at and above 2 cp; the end padded for sequence parallelism
])
def test_zigzag_packed_index(total, cp, multiple_of):
    seen = []
    for rank in range(cp):
        index = pm.zigzag_packed_index(list(total), cp, rank, multiple_of=multiple_of)
        assert index.tolist() == _slow_zigzag_index(total, cp, rank, multiple_of)
        seen += [i for i in index.tolist() if i >= 0]
    assert sorted(seen) == list(range(sum(total)))  # every position on exactly one rank
    assert pm.zigzag_packed_index(list(total), 1, 0).tolist() == list(range(sum(total)))


def test_zigzag_packed_targets_use_the_whole_stream():
    """A chunk's last position predicts the next token even where another CP rank holds it."""
    tokens = torch.arange(100, 116)
    whole_targets, whole_rows = pm.packed_targets(tokens, [6, 7], [3, 4])
    for rank in range(2):
        tok, tgt, rows = pm.zigzag_packed_targets(tokens, [6, 7], [3, 4], 2, rank)
        index = pm.zigzag_packed_index([6, 7], 2, rank)
        held = index >= 0
        assert torch.equal(tok[held], tokens[index[held]]) and torch.equal(tgt[held], whole_targets[index[held]])
        assert torch.equal(rows[held], whole_rows[index[held]]) and not rows[~held].any()
        assert not tok[~held].any() and not tgt[~held].any()
    # rank 0 holds position 1 (chunk 0) but not 2: its target, token 102, lives on rank 1
    assert pm.zigzag_packed_targets(tokens, [6, 7], [3, 4], 2, 0)[1][1] == 102


def test_zigzag_split_chunks():
    x = torch.arange(8)
    assert pm.zigzag_split(x, 2, 0).tolist() == [0, 1, 6, 7] and pm.zigzag_split(x, 2, 1).tolist() == [2, 3, 4, 5]
    assert pm.zigzag_split(x, 1, 0) is x
    with pytest.raises(ValueError, match="divisible by 2 \\* cp_size"):
        pm.zigzag_split(torch.arange(6), 2, 0)


# Packed samples with rollout nuclei: (total, response) per sample and its nucleus kind; T leaves padding at the end.
KEEP_SAMPLES = [
    (6, 3, "nucleus"),
    (4, 4, "nucleus"),  # a response without a prompt: its first token's nucleus has no row
    (5, 2, None),  # no nucleus recorded: full vocabulary
    (3, 0, "empty"),  # no response: offsets [0]
    (7, 5, "nucleus"),
]
KEEP_T = 28


def _nuclei(samples, vocab, seed):
    """Per sample slime's (ids int32, offsets int32) or None: 1 to 9 ids per response token, some repeated."""
    gen = torch.Generator().manual_seed(seed)
    ids, offsets = [], []
    for _, response, kind in samples:
        if kind is None:
            ids.append(None)
            offsets.append(None)
            continue
        counts = torch.randint(1, 10, (response,), generator=gen)
        ids.append(torch.randint(0, vocab, (int(counts.sum()),), generator=gen, dtype=torch.int32))
        offsets.append(torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32))
    return ids, offsets


def _slime_dense_mask(samples, ids, offsets, t, vocab):
    """The dense [T, V] mask a per-token Python loop builds from the nuclei (what the sparse keep set replaces):
    response token j of a sample, at position start + prompt + j, is scored at the row before it, which keeps its
    nucleus; every other row keeps everything."""
    mask = torch.ones(t, vocab, dtype=torch.bool)
    start = 0
    for k, (total, response, _) in enumerate(samples):
        for j in range(response):
            row = start + total - response + j - 1
            if offsets[k] is not None and row >= start:
                mask[row] = False
                mask[row, ids[k][int(offsets[k][j]):int(offsets[k][j + 1])].long()] = True
        start += total
    return mask


def test_packed_keep_is_the_per_token_nuclei_row_by_row():
    total, response = [s[0] for s in KEEP_SAMPLES], [s[1] for s in KEEP_SAMPLES]
    ids, offsets = _nuclei(KEEP_SAMPLES, ms.VOCAB, 71)
    tokens = torch.randint(0, ms.VOCAB, (KEEP_T,), generator=torch.Generator().manual_seed(72))
    keep_ids, keep_offsets = pm.packed_keep(tokens, total, response, ids, offsets)
    assert keep_ids.dtype == keep_offsets.dtype == torch.int64 and keep_offsets.shape == (KEEP_T + 1,)
    dense = _slime_dense_mask(KEEP_SAMPLES, ids, offsets, KEEP_T, ms.VOCAB)
    for row in range(KEEP_T):
        got = keep_ids[keep_offsets[row]:keep_offsets[row + 1]]
        kept = torch.zeros(ms.VOCAB, dtype=torch.bool).index_fill_(0, got, True) if got.numel() else True
        assert torch.equal(dense[row], torch.zeros_like(dense[row]) | kept), row  # an empty range: everything
    # the nuclei's ids in row order, each listed as recorded (repeats kept), less the unscored first token's
    skipped = int(offsets[1][1])  # sample 1 starts with its response
    assert keep_ids.numel() == sum(int(o[-1]) for o in offsets if o is not None) - skipped


def test_packed_keep_scores_as_the_dense_mask_slime_builds():
    """The op with the helper's sparse keep set against float64 with slime's dense mask: the same renormalised
    log-probs on the response rows."""
    total, response = [s[0] for s in KEEP_SAMPLES], [s[1] for s in KEEP_SAMPLES]
    ids, offsets = _nuclei(KEEP_SAMPLES, ms.VOCAB, 73)
    gen = torch.Generator().manual_seed(74)
    tokens = torch.randint(0, ms.VOCAB, (KEEP_T,), generator=gen)
    logits = (torch.randn(KEEP_T, ms.VOCAB, generator=gen) * 3).to(DEVICE)
    targets, rows = pm.packed_targets(tokens, total, response)
    keep = pm.packed_keep(tokens, total, response, ids, offsets)
    out = ppo_ops.log_probs_and_entropy(logits, targets.to(DEVICE), entropy="value", row_mask=rows.to(DEVICE),
                                        keep=tuple(t.to(DEVICE) for t in keep))
    dense = _slime_dense_mask(KEEP_SAMPLES, ids, offsets, KEEP_T, ms.VOCAB)
    ref = reference_log_probs_and_entropy(logits.cpu(), targets, entropy="value", keep_mask=dense, row_mask=rows)
    assert_log_probs_close(out.log_probs.cpu(), ref.log_probs)
    assert_entropy_close(out.entropy.cpu(), ref.entropy)


def test_packed_batch_with_nuclei_through_the_processor():
    """docs/integrations.md's Megatron example on one packed stream: packed_targets' labels and rows, packed_keep's
    keep set and a PPO loss through the processor equal linear_token_loss called directly with the same rows and
    keep set, and the nuclei renormalise the response rows' log-probs."""
    total, response = [s[0] for s in KEEP_SAMPLES], [s[1] for s in KEEP_SAMPLES]
    ids, offsets = _nuclei(KEEP_SAMPLES, ms.VOCAB, 77)
    gen = torch.Generator().manual_seed(78)
    tokens = torch.randint(0, ms.VOCAB, (1, KEEP_T), generator=gen)
    hidden = torch.randn(KEEP_T, 1, ms.HIDDEN, generator=gen)  # [S, B, H] as the hook hands it
    weight = torch.randn(ms.V_PAD, ms.HIDDEN, generator=gen) * ms.WEIGHT_STD
    labels, rows = pm.packed_targets(tokens[0], total, response)
    keep = pm.packed_keep(tokens[0], total, response, ids, offsets)
    loss_mask = rows[None].float()
    ppo = ppo_ops.policy_loss(-torch.rand(1, KEEP_T, generator=gen) * 4, torch.randn(1, KEEP_T, generator=gen),
                              clip_low=0.2, clip_high=0.28, loss_mask=loss_mask)
    context = pm.Context(entropy="grad", temperature=ms.TEMPERATURE, vocab_size=ms.VOCAB, keep=keep, token_loss=ppo)
    loss, out = pm.output_processor(**ms.hook_kwargs(hidden, _Layer(weight), None, labels[None], loss_mask, context,
                                                     None))
    want_loss, want = ppo_ops.linear_token_loss(hidden.transpose(0, 1), weight, labels[None], ppo, entropy="grad",
                                                temperature=ms.TEMPERATURE, vocab_size=ms.VOCAB, row_mask=rows[None],
                                                keep=keep)
    assert torch.equal(loss, want_loss) and torch.equal(out.log_probs, want.log_probs)
    full = _direct(hidden, weight, labels[None], loss_mask, entropy="value")  # no keep set
    nucleus_rows = rows & (keep[1][1:] > keep[1][:-1])
    assert bool((out.log_probs[0][nucleus_rows] > full.log_probs[0][nucleus_rows]).all())
    assert torch.equal(out.entropy, full.entropy)  # the entropy stays over the full distribution


@pytest.mark.parametrize("cp, multiple_of", [(2, 1), (3, 4)])
def test_zigzag_packed_keep_is_each_ranks_rows(cp, multiple_of):
    total, response = [s[0] for s in KEEP_SAMPLES], [s[1] for s in KEEP_SAMPLES]
    ids, offsets = _nuclei(KEEP_SAMPLES, ms.VOCAB, 75)
    tokens = torch.randint(0, ms.VOCAB, (sum(total),), generator=torch.Generator().manual_seed(76))
    whole_ids, whole_offsets = pm.packed_keep(tokens, total, response, ids, offsets)
    seen = 0
    for rank in range(cp):
        local_ids, local_offsets = pm.zigzag_packed_keep(tokens, total, response, ids, offsets, cp, rank,
                                                         multiple_of=multiple_of)
        index = pm.zigzag_packed_index(total, cp, rank, multiple_of=multiple_of)
        assert local_offsets.shape == (index.numel() + 1,) and int(local_offsets[-1]) == local_ids.numel()
        for i, g in enumerate(index.tolist()):
            got = local_ids[local_offsets[i]:local_offsets[i + 1]]
            want = whole_ids[whole_offsets[g]:whole_offsets[g + 1]] if g >= 0 else whole_ids[:0]
            assert torch.equal(got, want), (rank, i, g)
        seen += local_ids.numel()
    assert seen == whole_ids.numel()  # every listed id on exactly one rank


@pytest.mark.parametrize("ids, offsets, argument, says", [
    ([torch.tensor([1, 2])], [torch.tensor([0, 1, 2])], "top_p_token_ids", "one entry per sample"),
    ([torch.tensor([1, 2]), None], [torch.tensor([0, 2]), None], "top_p_token_offsets", "3 entries, got 2"),
    ([torch.tensor([1, 2]), None], [torch.tensor([0, 2, 1]), None], "top_p_token_offsets", "non-decreasing"),
    ([torch.tensor([1, 2]), None], [torch.tensor([0, 1, 3]), None], "top_p_token_offsets", "non-decreasing"),
    ([torch.tensor([1.0, 2.0]), None], [torch.tensor([0, 1, 2]), None], "top_p_token_ids", "integer"),
    (torch.tensor([1, 2]), torch.tensor([0, 1, 2]), "top_p_token_ids", "one entry per sample"),
])
def test_packed_keep_errors_name_the_argument(ids, offsets, argument, says):
    with pytest.raises((ValueError, TypeError), match=f"{argument}.*{says}|{says}"):
        pm.packed_keep(torch.zeros(8, dtype=torch.int64), [4, 3], [2, 1], ids, offsets)


@pytest.mark.parametrize("call, argument", [
    (lambda: pm.packed_targets(torch.zeros(4, dtype=torch.int64), [5], [1]), "total_lengths"),
    (lambda: pm.packed_targets(torch.zeros(4, dtype=torch.int64), [3], [4]), "response_lengths"),
    (lambda: pm.packed_targets(torch.zeros(4, dtype=torch.int64), [3, 1], [1]), "response_lengths"),
    (lambda: pm.zigzag_packed_index([4], 2, 2), "cp_rank"),
    (lambda: pm.zigzag_packed_index([4], 0, 0), "cp_size"),
    (lambda: pm.zigzag_packed_index([-1], 1, 0), "total_lengths"),
])
def test_helper_errors_name_the_argument(call, argument):
    with pytest.raises(ValueError, match=argument):
        call()


# --- a user's first mistakes ---

def test_processor_kwargs_without_the_hook_points_to_gpt_log_probs():
    """The venv's megatron-core (0.16.1) has no output_processor hook: processor_kwargs raises naming
    output_processor and gpt_log_probs, rather than megatron-core's own unexpected-keyword TypeError from model(...);
    a model whose forward takes the hook gets the keywords."""
    context = pm.Context(entropy="grad")
    with pytest.raises(RuntimeError, match="^ppo_ops.megatron.processor_kwargs: ") as caught:
        pm.processor_kwargs(context)
    assert caught.value.ppo_ops_argument == "output_processor"
    assert "takes no output_processor" in str(caught.value) and "gpt_log_probs" in str(caught.value)
    with pytest.raises(RuntimeError, match="gpt_log_probs"):
        pm.processor_kwargs(context, _TupleWrapper(_PreHookGPT(with_padding_mask=True)))
    kwargs = pm.processor_kwargs(context, _TupleWrapper(_HookedGPT(torch.zeros(4, 2))))
    assert kwargs == dict(output_processor=pm.output_processor, output_processor_context=context)
    with pytest.raises(TypeError, match="context must be a ppo_ops.megatron.Context"):
        pm.processor_kwargs("not a Context")


def _short_loss(labels):
    """A PPO loss over [B, S - 1] constants: one fewer per row than the labels it must score."""
    shape = (labels.shape[0], labels.shape[1] - 1)
    return ppo_ops.policy_loss(torch.zeros(shape), torch.ones(shape))


def test_processor_token_loss_counted_against_the_labels():
    """A Context whose token loss covers other rows than the labels: one ValueError naming token_loss and the labels'
    [B, S] shape, before the head runs."""
    hidden, weight, labels, mask = _inputs()
    context = pm.Context(entropy="grad", vocab_size=ms.VOCAB, token_loss=_short_loss(labels))
    with pytest.raises(ValueError, match="^ppo_ops.megatron.output_processor: ") as caught:
        pm.output_processor(**ms.hook_kwargs(hidden, _Layer(weight), None, labels, mask, context, None))
    assert caught.value.ppo_ops_argument == "token_loss"
    assert f"labels' [B, S] = {tuple(labels.shape)}" in str(caught.value)


def test_gpt_log_probs_token_loss_counted_before_the_model_runs():
    """At one rank gpt_log_probs checks the token loss against the labels before the embedding and decoder run (the
    model here fails the test if they do)."""
    _, _, labels, mask = _inputs()
    context = pm.Context(entropy="grad", token_loss=_short_loss(labels))
    with pytest.raises(ValueError, match="^ppo_ops.megatron.gpt_log_probs: ") as caught:
        pm.gpt_log_probs(_PreHookGPT(with_padding_mask=True), None, None, None, labels, mask, context)
    assert caught.value.ppo_ops_argument == "token_loss"


@pytest.mark.device("cpu")  # a CPU-only torch is what this is about
def test_gpt_log_probs_on_a_cpu_as_documented(tmp_path):
    """On a CPU, with torch.cuda.current_device as torch has it and no attention mask: megatron-core's training RNG
    tracker gets ppo_ops' error naming model and the fix (initialize_rng_tracker(inference_rng_tracker=True)); with
    the inference tracker the call runs, equal to the call with the explicit causal mask, and
    torch.cuda.current_device is torch's own again afterwards."""
    run_ranks(1, ms.run_gpt_cpu_as_a_user, str(tmp_path))
    record = torch.load(ms.results_path(str(tmp_path), 1, 0), weights_only=False)
    assert record["tracker_error"] is not None, "the training tracker's fork on a CPU raised nothing"
    kind, argument, message = record["tracker_error"]
    assert kind == "RuntimeError" and argument == "model" and "inference_rng_tracker=True" in message
    assert torch.equal(record["no_mask"], record["causal"])
    assert record["current_device_restored"]


@pytest.mark.device("cpu")  # gloo ranks on CPU tensors; the error's path is device-independent
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["nosp", "sp"])
def test_processor_token_loss_error_is_collective_at_tp2(sequence_parallel, tmp_path):
    """At TP = 2 with only rank 1's token loss short, both ranks raise the same ValueError naming token_loss and
    rank 1 (rank 0 from the head's header exchange, which meets rank 1's), with or without sequence parallelism."""
    run_gloo(2, ms.run_short_token_loss, str(tmp_path), sequence_parallel, timeout_s=30, deadline_s=240)
    for rank in range(2):
        record = torch.load(ms.results_path(str(tmp_path), 2, rank), weights_only=False)
        assert record is not None, f"rank {rank} raised nothing"
        kind, argument, message = record
        assert kind == "ValueError" and argument == "token_loss", f"rank {rank}: {record}"
        assert "rank 1" in message, f"rank {rank}: {message}"
