"""What exact equality (--expect_bitwise, true on-policy) is checked with: the one-ulp weight control and the
calibration's exact-equality verdict (sglang_checks/controls.py, calibrate.bitwise_table).

- `one_ulp_off` moves exactly one element of the final norm's weight by exactly one ulp of its dtype, on a copy;
  the model it was given is untouched, and the copy's log-probs move (on `tiny`, in fp32).
- `bitwise_table`: a healthy configuration is ok only at exactly 0 on the exact-equality comparisons (sampled
  log-probs, from the engine's decode kernels, do not count); a control only when its metrics are not 0, a bitwise
  control judged on the exact-equality comparisons.
"""

import pytest
import torch

from sglang_checks import calibrate, controls, models

pytestmark = pytest.mark.device("cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    info = models.resolve_model("tiny", cache_dir=str(tmp_path_factory.mktemp("cache")), seed=0, log=lambda m: None)
    return models.load_hf_model(info, dtype=torch.float32, device=torch.device("cpu"))


def test_one_ulp_off_moves_one_element_by_one_ulp_on_a_copy(tiny):
    before = dict(tiny.named_parameters())[controls.ULP_WEIGHT].detach().clone()
    other = controls.one_ulp_off(tiny)
    after = dict(other.named_parameters())[controls.ULP_WEIGHT].detach()
    assert torch.equal(dict(tiny.named_parameters())[controls.ULP_WEIGHT].detach(), before)  # untouched
    changed = (after != before).view(-1)
    assert changed.sum() == 1 and changed[0]
    bits = lambda t: t.view(-1)[:1].view(torch.int32).item()  # noqa: E731  fp32: adjacent floats differ by 1 bit
    assert abs(bits(after) - bits(before)) == 1
    for name, p in other.named_parameters():
        if name != controls.ULP_WEIGHT:
            assert torch.equal(p, dict(tiny.named_parameters())[name]), name
    ids = torch.randint(0, tiny.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        moved = (tiny(ids).logits.log_softmax(-1) != other(ids).logits.log_softmax(-1)).float().mean()
    assert moved > 0  # measured: 6% of the log-probs of 64 tokens


def _row(kind, control, config, subject, tolerance_name, value):
    return dict(kind=kind, control=control, engine="sglang", config=config, section="s", subject=subject,
                metric="m", tolerance_name=tolerance_name, value=value)


def test_bitwise_table_demands_zero_healthy_and_nonzero_controls():
    tf = "sglang tp1 teacher-forced (raw)"
    rows = [
        _row("healthy", "none", "seed 0", tf, "mismatch_tol", 0.0),
        _row("healthy", "none", "seed 0", "sglang tp1 sampled (temperature)", "mismatch_tol", 0.3),  # not exact
        _row("healthy", "none", "seed 1", tf, "mismatch_tol", 1e-9),
        _row("control", controls.TRAINER_WEIGHT_ULP, "seed 0", tf, "mismatch_tol", 2e-3),
        _row("control", controls.TRAINER_WEIGHTS, "seed 0", tf, "mismatch_tol", 0.0),
        _row("control", controls.TRAINER_WEIGHTS, "seed 0", tf, "kl_tol", 0.0),
    ]
    verdicts = {(e["kind"], e["what"]): e["ok"] for e in calibrate.bitwise_table(rows)}
    assert verdicts == {("healthy", "seed 0"): True, ("healthy", "seed 1"): False,
                        ("control", controls.TRAINER_WEIGHT_ULP): True, ("control", controls.TRAINER_WEIGHTS): False}
    assert "VIOLATED" in calibrate.bitwise_markdown(calibrate.bitwise_table(rows))
