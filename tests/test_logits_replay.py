"""The logits op's replayed small calls (ppo_ops/logits/replay.py).

Any device: a child process without the interpreter (tests/replay_check.py) stands CPU tensors in for CUDA ones and
stops every launch at a stand-in compiled kernel, and checks that each launch of a replayed call (forward, merge,
backward) is the launch the op's own path makes on the same buffers: the same compiled kernel, grid and arguments.
Options, dtypes, shapes, alignment and the kinds of upstream gradient (a sum's expanded one included) each get a case
that shares a signature with another but for that one field; calls that copy their input inside the op (int32
tokens, strided columns) take the op's own path; with validate=True a replayed call runs the op's value checks.
The recorded call's tensors are not kept.

One GPU: replayed calls are the op's own path bit for bit (log-probs, entropies, gradient) on fresh inputs, with and
without the value checks; a recorded validate=True signature inside a capture raises the op's error; a call on
another current device than the record's takes the op's own path (two GPUs).
"""

import pytest
import torch

import ppo_ops
from ppo_ops.logits import replay
from tests.core_support import DEVICE, compile_check_report

CHECK_TIMEOUT_S = 300  # a dozen small cases through the op's Python path on the CI's 2 cores (~10 s)

any_device = pytest.mark.device("any")  # runs in a child process, whatever this process runs on
_CUDA = pytest.mark.skipif(DEVICE.type != "cuda", reason="replayed launches run on CUDA only")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return compile_check_report("tests.replay_check", tmp_path_factory.mktemp("triton_cache"), CHECK_TIMEOUT_S)


REPLAYED_CASES = ["bf16, entropy with gradient", "fp32", "fp16, temperature 0.7", "temperature 0.7",
                  "entropy value", "entropy none", "entropy gradient only", "log-probs summed", "padded vocabulary",
                  "odd width, 3-d", "misaligned logits", "fewer rows", "tokens a strided [B, S] view (copied)",
                  "validate on"]
OWN_PATH_CASES = ["int32 tokens (copied inside)", "columns strided (copied inside)"]


@any_device
@pytest.mark.parametrize("case", REPLAYED_CASES)
def test_replayed_launches_are_the_own_paths(report, case):
    assert report[case]["replayed"] == ["forward", "merge", "backward"], report[case]
    assert report[case]["mismatches"] == []


@any_device
@pytest.mark.parametrize("case", OWN_PATH_CASES)
def test_calls_that_copy_inside_are_not_replayed(report, case):
    assert report[case]["mismatches"] == [], report[case]


@any_device
def test_a_replayed_call_runs_the_value_checks(report):
    """validate=True: a token out of range in a replayed call raises the op's own error, word for word."""
    assert report["validate on, a token out of range"]["mismatches"] == []


def _replayed(out) -> bool:
    """Whether the outputs come from the replayed Function (under the reshape to the tokens' shape)."""
    fn = out.log_probs.grad_fn
    while fn is not None and type(fn).__name__ not in ("ReplayedFunctionBackward", "LogProbEntropyFunctionBackward"):
        fn = fn.next_functions[0][0] if fn.next_functions else None
    return fn is not None and type(fn).__name__ == "ReplayedFunctionBackward"


def _call(x, t, validate=False, **options):
    x = x.detach().clone().requires_grad_()
    out = ppo_ops.log_probs_and_entropy(x, t, validate=validate, **options)
    w = torch.linspace(0.5, 1.5, out.log_probs.numel(), device=x.device).reshape(out.log_probs.shape)
    loss = (out.log_probs * w).sum() + (0.0 if out.entropy is None else (out.entropy * w.flip(-1)).sum())
    replayed = _replayed(out)
    loss.backward()
    return [out.log_probs.detach(), None if out.entropy is None else out.entropy.detach(), x.grad], replayed


@_CUDA
@pytest.mark.parametrize("validate", [False, True])
@pytest.mark.parametrize("entropy", ["grad", "value", "none"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_replay_is_the_own_path_bitwise(monkeypatch, entropy, dtype, validate):
    gen = torch.Generator(device="cpu").manual_seed(3)
    shape, vocab = (4, 256), 151936 // 8
    calls = [(torch.randn(*shape, vocab, generator=gen).mul(3).to(DEVICE, dtype),
              torch.randint(0, vocab, shape, generator=gen).to(DEVICE)) for _ in range(3)]
    replayed = []
    for x, t in calls:  # the first records, the others replay
        got, was_replayed = _call(x, t, entropy=entropy, validate=validate)
        replayed.append(was_replayed)
        monkeypatch.setattr(replay, "ENABLED", False)
        own, _ = _call(x, t, entropy=entropy, validate=validate)
        monkeypatch.setattr(replay, "ENABLED", True)
        for g, o in zip(got, own):
            assert (g is None) == (o is None) and (g is None or torch.equal(g, o))
    assert replayed == [False, True, True]


@_CUDA
def test_validate_inside_a_capture_still_names_validate():
    """A recorded validate=True signature inside a CUDA graph capture: the op's own path and its error."""
    x = torch.randn(8, 1024, device=DEVICE)
    t = torch.randint(0, 1024, (8,), device=DEVICE)
    for _ in range(2):
        _call(x, t, entropy="grad", validate=True)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="validate=False"):
        with torch.cuda.graph(graph):
            ppo_ops.log_probs_and_entropy(x, t, entropy="grad", validate=True)


@_CUDA
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU to be the current device")
def test_another_current_device_takes_the_own_path():
    x = torch.randn(8, 1024, device="cuda:0")
    t = torch.randint(0, 1024, (8,), device="cuda:0")
    for _ in range(2):
        _call(x, t, entropy="grad")
    with torch.cuda.device(1):
        got, was_replayed = _call(x, t, entropy="grad")
    assert not was_replayed
    assert torch.equal(got[0], _call(x, t, entropy="grad")[0][0])
