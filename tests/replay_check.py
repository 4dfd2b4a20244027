"""The logits op's replayed small calls (ppo_ops/logits/replay.py) against the op's own launches, with no GPU: used
by tests/test_logits_replay.py, which runs `python -m tests.replay_check` in a child process.

It must run WITHOUT TRITON_INTERPRET (under the interpreter nothing launches directly, so nothing replays). CPU
tensors stand in for CUDA ones, and every launch stops at the compiled kernel's launcher: a stand-in CompiledKernel
per specialisation key records what it is asked to run (grid and arguments) instead of running. Kernel outputs are
therefore never written; what is checked is the launches.

Per case: a first call of a signature (the op's own path, recorded), then two calls on fresh tensors of that
signature, forward and backward (the backward's first run per kind of upstream gradient takes the op's own path and
is recorded; the second call's replays). Each launch a replayed call makes is compared with the launch the op's own
path would make on the same buffers: the kernel (the stand-in of the key the launcher derives from those arguments),
the grid and every argument (pointers by address), built by the backend's own argument functions
(logits/triton_backend.py) on the buffers the replay allocated.

Also: the first call's logits are freed once the caller drops them (a record keeps no tensor of its call).

Prints one JSON object: {case: {"replayed": [passes replayed in the last call], "mismatches": [...]}}.
"""

import gc
import json
import os
import types
import weakref

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    raise SystemExit("run without TRITON_INTERPRET: under the interpreter nothing launches directly")

import torch  # noqa: E402

import ppo_ops  # noqa: E402
from ppo_ops.core import row_stats, shell, triton_launch  # noqa: E402
from ppo_ops.core.contracts import BackwardStats, RowInputs, UpstreamGrads  # noqa: E402
from ppo_ops.logits import function, replay, triton_backend as tb  # noqa: E402

RAN = []  # (launcher, stand-in kernel, grid, arguments) of every launch that reached a compiled kernel
ALLOCATED = []  # every tensor torch.empty / empty_like made (the replay's buffers are found here by address)
CONVERTED = []  # every upstream gradient as the op's backward converts it (function.as_fp32)
SHAPED = []  # every flattened input (shell.shaped): the replay's rows and tokens, a copy where they do not view


class _StandIn:
    """A CompiledKernel that records its launches."""

    def __init__(self, launcher, key):
        self.launcher, self.key, self.function, self.packed_metadata = launcher, key, 0, 0

    def run(self, gx, gy, gz, stream, function, metadata, launch_metadata, enter, exit_hook, *args):
        RAN.append((self.launcher, self, (gx, gy, gz), args))

    def launch_metadata(self, *args):
        return None


class _PerKey(dict):
    def __init__(self, launcher):
        super().__init__()
        self.launcher = launcher

    def get(self, key, default=None):
        if key not in self:
            self[key] = _StandIn(self.launcher, key)
        return self[key]


def _stand_in_cuda():
    tb._check_device = lambda name, tensor: None
    shell.interpret_requested = lambda: True  # backend="triton" on CPU tensors, without the interpreter
    replay._on_cuda = lambda tensor: True
    torch.cuda.current_device = lambda: 0
    torch.cuda.is_current_stream_capturing = lambda: False
    driver = types.SimpleNamespace(active=types.SimpleNamespace(get_current_stream=lambda device: 0))
    for launcher in (tb._FORWARD, tb._MERGE, tb._BACKWARD):
        assert launcher._read_signature()
        launcher._direct, launcher._compiled, launcher._driver = True, _PerKey(launcher), driver
    empty, empty_like = torch.empty, torch.empty_like

    def tracked(make):
        def allocate(*args, **kwargs):
            tensor = make(*args, **kwargs).zero_()  # no kernel writes it: zeros pass the value checks
            ALLOCATED.append(tensor)
            return tensor
        return allocate

    torch.empty, torch.empty_like = tracked(empty), tracked(empty_like)
    as_fp32 = function.as_fp32

    def converted(grad):
        grad = as_fp32(grad)
        CONVERTED.append(grad)
        return grad

    function.as_fp32 = converted
    shaped = shell.shaped

    def flattened(tensor, shape):
        flat = shaped(tensor, shape)
        SHAPED.append(flat)
        return flat

    shell.shaped = flattened


def _pointers_by_address(launcher, args):
    """The arguments with every pointer parameter (a tensor, or an address) as its address."""
    names = launcher._signature[0]
    return tuple((a.data_ptr() if isinstance(a, torch.Tensor) else a) if n.endswith("_ptr") else a
                 for n, a in zip(names, args))


def _own_launch(launcher, grid, kwargs):
    """What the launcher makes of (grid, kwargs): its stand-in kernel, 3-d grid and arguments."""
    key, args = triton_launch.key_and_arguments(*launcher._signature, kwargs)(kwargs)
    return (launcher._compiled.get((0, key)), tuple(grid) + (1,) * (3 - len(grid)),
            _pointers_by_address(launcher, args))


def _compare(name, ran, own, mismatches):
    launcher, kernel, grid, args = ran
    if kernel is not own[0]:
        mismatches.append(f"{name}: another compiled kernel")
    if grid != own[1]:
        mismatches.append(f"{name}: grid {grid} != {own[1]}")
    args = _pointers_by_address(launcher, args)
    if args != own[2]:
        names = launcher._signature[0]
        mismatches.append(f"{name}: arguments differ: "
                          f"{[(n, g, w) for n, g, w in zip(names, args, own[2]) if g != w]}")


def _allocated_at(launcher, args, name):
    """The tensor allocated at the address the launch passes as parameter `name`."""
    address = _pointers_by_address(launcher, args)[launcher._signature[0].index(name)]
    found = [t for t in ALLOCATED if t.data_ptr() == address]
    assert found, f"no allocation at {name}'s address"
    return found[-1]


def _replayed(out) -> bool:
    fn = out.log_probs.grad_fn
    while fn is not None and type(fn).__name__ not in ("ReplayedFunctionBackward", "LogProbEntropyFunctionBackward"):
        fn = fn.next_functions[0][0] if fn.next_functions else None
    return fn is not None and type(fn).__name__ == "ReplayedFunctionBackward"


def _backward(logits, out, grads, gen):
    """The backward with upstream gradients for the outputs in `grads`; returns them flat, as the Function gets
    them (None where not given)."""
    given = {"lp": out.log_probs, "ent": out.entropy}
    pairs = [(given[g], torch.rand(given[g].shape, generator=gen)) for g in grads if g != "sum"]
    if "sum" in grads:  # a sum's gradient: expanded (stride 0), which the op copies to a contiguous one
        CONVERTED.clear()
        torch.autograd.grad(out.log_probs.sum(), (logits,))
        copies = [t for t in CONVERTED if t is not None and t.stride() == (1,)]
        return copies[-1], None
    torch.autograd.grad([t for t, _ in pairs], (logits,), [g for _, g in pairs])
    upstream = {g: u.reshape(-1) for g, (_, u) in zip(grads, pairs)}
    return upstream.get("lp"), upstream.get("ent")


def _case(make_logits, make_tokens, grads, gen, expect_replay=True, **options):
    options = dict(dict(entropy="grad", validate=False, backend="triton"), **options)
    first = make_logits()
    _backward(first, ppo_ops.log_probs_and_entropy(first, make_tokens(), **options), grads, gen)
    first = weakref.ref(first)  # the record must not keep the recorded call's tensors
    for _ in range(2):  # the second call replays its backward too
        logits, tokens = make_logits(), make_tokens()
        RAN.clear()
        SHAPED.clear()
        out = ppo_ops.log_probs_and_entropy(logits, tokens, **options)
        flat = SHAPED[:2]  # a replayed call flattens its logits, then its tokens, first
        forward = list(RAN)
        RAN.clear()
        upstream = _backward(logits, out, grads, gen)
        backward = list(RAN)
    gc.collect()
    kept = ["the first call's logits are still held"] if first() is not None else []
    if not expect_replay:
        return {"replayed": [], "mismatches": (["replayed"] if _replayed(out) else []) + kept}
    if not _replayed(out):
        return {"replayed": [], "mismatches": ["did not replay"]}
    mismatches = kept
    partials = _allocated_at(tb._FORWARD, forward[0][3], "out_ptr")
    merged = _allocated_at(tb._MERGE, forward[1][3], "out_ptr")
    flags = _allocated_at(tb._MERGE, forward[1][3], "flags_ptr")
    # The plan the op's own path makes of this call (not the replay's record)
    plan = shell.prepare_logits("log_probs_and_entropy", logits, tokens, tp_group=None, keep_mask=None, row_mask=None,
                                inplace_grad=False, reduction_order="fused", chunk_size=None,
                                temperature=options.get("temperature", 1.0), vocab_size=options.get("vocab_size"),
                                entropy=options["entropy"], validate=options["validate"],
                                backend=options["backend"]).plan
    rows, flat_tokens = flat
    inputs = RowInputs(rows, flat_tokens, None, None)
    config = tb.launch_config("forward", rows.dtype, plan.shard.seg_len, False)
    grid, kwargs = tb.forward_launch_args(inputs, plan.shard, plan.entropy_mode != "none", partials, config)
    _compare("forward", forward[0], _own_launch(tb._FORWARD, grid, kwargs), mismatches)
    grid, kwargs = tb.merge_launch_args(partials, merged, flags, False)
    _compare("merge", forward[1], _own_launch(tb._MERGE, grid, kwargs), mismatches)
    if len(forward) != 2 or len(backward) != 1:
        mismatches.append(f"{len(forward)} forward and {len(backward)} backward launches, not 2 and 1")
        return {"replayed": ["forward", "merge"], "mismatches": mismatches}
    gradient = _allocated_at(tb._BACKWARD, backward[0][3], "out_ptr")
    stats = BackwardStats(*function.saved_stats(row_stats.merged_row_stats(merged, flags, False), plan))
    g_lp, g_ent = upstream
    config = tb.launch_config("backward", rows.dtype, rows.shape[1], False)
    kwargs = tb.backward_launch_args(inputs, plan.shard, stats, UpstreamGrads(
        g_lp, g_ent if plan.entropy_mode == "grad" else None), gradient, config)
    grid = (rows.shape[0], -(-rows.shape[1] // config.block_v))
    _compare("backward", backward[0], _own_launch(tb._BACKWARD, grid, kwargs), mismatches)
    return {"replayed": ["forward", "merge", "backward"], "mismatches": mismatches}


def _bad_token(make_logits, make_tokens):
    """validate=True: a replayed call with a token out of range raises the op's own error (its value checks run)."""
    options = dict(entropy="grad", validate=True, backend="triton")
    ppo_ops.log_probs_and_entropy(make_logits(), make_tokens(), **options)  # recorded
    logits, tokens = make_logits(), make_tokens()
    tokens[5] = logits.shape[-1] + 7
    errors = []
    for enabled in (True, False):
        replay.ENABLED = enabled
        try:
            ppo_ops.log_probs_and_entropy(logits, tokens, **options)
            errors.append(None)
        except ValueError as exc:
            errors.append(str(exc))
        finally:
            replay.ENABLED = True
    mismatches = [] if errors[0] is not None and errors[0] == errors[1] else [f"errors {errors}"]
    return {"replayed": [], "mismatches": mismatches}


def main():
    _stand_in_cuda()
    gen = torch.Generator().manual_seed(0)

    def logits(shape, dtype=torch.bfloat16, offset=0):
        def make():
            n = 1
            for size in shape:
                n *= size
            return torch.randn(n + offset, generator=gen).to(dtype)[offset:].view(shape).requires_grad_()
        return make

    def tokens(shape, vocab, dtype=torch.int64):
        return lambda: torch.randint(0, vocab, shape, generator=gen).to(dtype)

    cases = {
        "bf16, entropy with gradient": (logits((64, 1024)), tokens((64,), 1024), ("lp", "ent"), {}),
        "fp32": (logits((64, 1024), torch.float32), tokens((64,), 1024), ("lp", "ent"), {}),
        "fp16, temperature 0.7": (logits((48, 2048), torch.float16), tokens((48,), 2048), ("lp", "ent"),
                                  dict(temperature=0.7)),
        "temperature 0.7": (logits((64, 1024)), tokens((64,), 1024), ("lp", "ent"), dict(temperature=0.7)),
        "entropy value": (logits((64, 1024)), tokens((64,), 1024), ("lp",), dict(entropy="value")),
        "entropy none": (logits((64, 1024)), tokens((64,), 1024), ("lp",), dict(entropy="none")),
        "entropy gradient only": (logits((64, 1024)), tokens((64,), 1024), ("ent",), {}),
        "padded vocabulary": (logits((64, 1024)), tokens((64,), 1000), ("lp", "ent"), dict(vocab_size=1000)),
        "odd width, 3-d": (logits((3, 13, 1000)), tokens((3, 13), 1000), ("lp", "ent"), {}),
        "log-probs summed": (logits((64, 1024)), tokens((64,), 1024), ("sum",), {}),
        "misaligned logits": (logits((64, 1024), offset=3), tokens((64,), 1024), ("lp", "ent"), {}),
        "fewer rows": (logits((32, 1024)), tokens((32,), 1024), ("lp", "ent"), {}),
        "tokens a strided [B, S] view (copied)": (logits((4, 16, 1024)), lambda: tokens((4, 17), 1024)()[:, 1:],
                                                  ("lp", "ent"), {}),
    }
    report = {name: _case(*case[:3], gen, **case[3]) for name, case in cases.items()}
    report["int32 tokens (copied inside)"] = _case(logits((64, 1024)), tokens((64,), 1024, torch.int32),
                                                   ("lp", "ent"), gen, expect_replay=False)
    report["columns strided (copied inside)"] = _case(lambda: logits((1024, 64))().t(), tokens((64,), 1024),
                                                      ("lp", "ent"), gen, expect_replay=False)
    report["validate on"] = _case(logits((64, 1024)), tokens((64,), 1024), ("lp", "ent"), gen, validate=True)
    report["validate on, a token out of range"] = _bad_token(logits((64, 1024)), tokens((64,), 1024))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
