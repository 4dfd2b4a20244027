"""The README's performance figures are what the bench's report gives from the committed records (docs/bench/*.csv,
read as `bench.py --render_only` reads them): the logits op's headline rows, and the LM head's table of the run it
names. A figure edited by hand, or a record the report cannot read, fails here."""

import pathlib
import re

import pytest

from tools.bench import report

pytestmark = pytest.mark.device("cpu")

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
LM_HEAD_RUN = "H4: the lm_head suite with Liger and verl (8f85dfd)"  # the run the README's LM-head table quotes
# The README's LM-head table: its row name -> the bench's provider (set against 1 GEMM for the forward only).
LM_HEAD_ROWS = {
    "`linear_log_probs_and_entropy`": "fused",
    "`linear_token_loss`, PPO loss": "token_loss",
    "`linear_log_probs_and_entropy` under `no_grad`": "fused_nograd",
    "Liger-Kernel's fused linear scaled CE": "liger_flsce",
    "unfused (bf16 logits, `log_softmax`)": "unfused",
}


def _rows(name):
    return report.read_csv(str(ROOT / "docs" / "bench" / name))


def _one(rows, **fields):
    found = [r for r in rows if all(r.get(k) == v for k, v in fields.items())]
    assert len(found) == 1, f"{fields}: {len(found)} rows"
    return found[0]


def test_the_logits_op_figures_are_the_headline_rows():
    rows = report.latest_per_case(_rows("results.csv"))
    head = [r for r in rows if all(r.get(k) == v for k, v in report.HEADLINE.items())]
    off = _one(head, provider="triton", validate="off", inplace_grad="off")
    default = _one(head, provider="triton", validate="on", inplace_grad="off")
    inplace = _one(head, provider="triton", validate="on", inplace_grad="on")
    legacy = _one(head, provider="legacy")
    n = report.number
    expected = (f"{n(off, 'p50_ms'):.3f} ms with `validate=False`\n({n(off, 'frac_copy_bw'):.0%} of copy bandwidth), "
                f"{n(default, 'p50_ms'):.3f} ms by default, {n(inplace, 'p50_ms'):.3f} ms with `inplace_grad=True`; "
                f"the legacy path {n(legacy, 'p50_ms'):.1f} ms, {n(legacy, 'peak_extra_mib'):.0f} MiB")
    assert expected in README


def test_the_lm_head_table_is_the_reports_comparisons_of_its_run():
    rows = [r for r in _rows("lm_head.csv") if r["label"] == LM_HEAD_RUN]
    assert rows, f"no rows of the run {LM_HEAD_RUN!r} in docs/bench/lm_head.csv"
    assert report.comparisons(rows), "the report sets none of the run's rows against its baseline"
    for name, provider in LM_HEAD_ROWS.items():
        cells = []
        for tokens in ("8192", "32768"):
            row = _one(rows, provider=provider, T=tokens, V="151936")
            base = _one(rows, **dict(dict(provider=provider, T=tokens, V="151936"),
                                     **report.parse_fields(row["baseline"])))
            ratio = report.number(row, "p50_ms") / report.number(base, "p50_ms")
            cells += [f"{report.number(row, 'p50_ms'):.1f}", f"{ratio:.2f}"]
        cells.append(f"{report.number(row, 'peak_extra_mib') / 1024:.1f} GiB")
        line = "| " + " | ".join([name] + cells) + " |"
        assert line in README, f"README's row for {name} is not the report's: {line}"
    assert re.search(r"\| provider \| T = 8192 ms \| x GEMMs \| T = 32768 ms \| x GEMMs \| peak extra at 32768 \|",
                     README)
