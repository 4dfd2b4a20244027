"""layer_diff.py on synthetic dumps laid out as SGLang's tensor dumper writes them: equal tensors say so, a perturbed
one is named first, a dtype change is named, and the scoring pass's rows are aligned to the samples (requests in
another order, a cached prefix, identical samples) while sampling passes are left out. Then layer_diff_main end to
end on a report folder whose "engine" dump is the on-policy forward's own record (torch stand-ins on `tiny`). CPU,
a few seconds."""

import json
import os
import subprocess
import sys

import pytest
import torch

from sglang_checks import layer_diff, models, on_policy, report, rollout as rollout_lib
from tests import processes

pytestmark = pytest.mark.device("cpu")

HEADS = 2  # q_norm-like tensors hold [tokens * heads, head_dim] rows
NAMES = ("model.embed_tokens", "model.layers.0.input_layernorm", "model.layers.0.self_attn.q_norm",
         "model.layers.0.self_attn.attn", "model.layers.1.input_layernorm", "model.norm")


def _record(sequences):
    """A trainer record in on_policy.py's shapes: per-token tensors, a per-head one, tuple outputs as lists."""
    gen = torch.Generator().manual_seed(0)
    tokens = sum(len(s) for s in sequences)

    def t(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen).to(dtype)

    return {
        NAMES[0]: t(tokens, 8),
        NAMES[1]: t(tokens, 8),
        NAMES[2]: t(tokens * HEADS, 4),
        NAMES[3]: t(tokens, 8, dtype=torch.bfloat16),
        NAMES[4]: [t(tokens, 8), t(tokens, 8)],
        NAMES[5]: [t(tokens, 8), t(tokens, 8)],
    }


def _engine_pass(record, sequences, requests):
    """A PassNNNNN.pt dict holding `requests` [(sequence, first position, end)] as one pass: the trainer's rows of
    those positions, flattened in request order, and the batch info the dumper adds."""
    offsets = [0]
    for s in sequences:
        offsets.append(offsets[-1] + len(s))

    def rows(tensor):
        per_token = tensor.reshape(offsets[-1], -1)
        picked = torch.cat([per_token[offsets[b] + first:offsets[b] + end] for b, first, end in requests])
        return picked.reshape(-1, *tensor.shape[1:]).clone()

    out = {name: [rows(t) for t in value] if isinstance(value, list) else rows(value) for name, value in record.items()}
    out[layer_diff.INPUT_IDS] = torch.tensor([tok for b, first, end in requests for tok in sequences[b][first:end]])
    out[layer_diff.POSITIONS] = torch.tensor([p for b, first, end in requests for p in range(first, end)])
    out[layer_diff.SEQ_LENS] = torch.tensor([end for _, _, end in requests])
    out["model"] = torch.zeros(1)  # the previous pass's top-level output (the dumper's quirk): never compared
    return out


def _write(tmp_path, passes, dump_dir="engine_dump"):
    """The passes as one scheduler process's files under tmp_path/dump_dir; returns that folder."""
    folder = tmp_path / dump_dir / "TP0_PP0_Rank0_pid42"
    folder.mkdir(parents=True)
    for n, tensors in enumerate(passes):
        torch.save(tensors, folder / f"Pass{n:05d}.pt")
    return str(tmp_path / dump_dir)


SEQUENCES = [[5, 6, 7, 8, 9], [1, 2, 3, 4, 10, 11, 12], [5, 6, 7, 8, 9]]  # the third repeats the first
PROMPT_LENS = [3, 4, 3]


def _rollout_passes(record, *, cached_prefix=True, perturb=None):
    """Sampling (prefill of the prompts, one decode step), then scoring with the prompt minus one token cached,
    requests in another order than the samples; `perturb(tensors)` edits the scoring pass."""
    prefill = _engine_pass(record, SEQUENCES, [(b, 0, n) for b, n in enumerate(PROMPT_LENS)])
    decode = _engine_pass(record, SEQUENCES, [(b, n, n + 1) for b, n in enumerate(PROMPT_LENS)])
    start = [n - 1 if cached_prefix else 0 for n in PROMPT_LENS]
    order = [1, 0, 2]
    scoring = _engine_pass(record, SEQUENCES, [(b, start[b], len(SEQUENCES[b])) for b in order])
    if perturb:
        perturb(scoring)
    return [prefill, decode, scoring]


def test_equal_dumps_say_no_difference(tmp_path):
    record = _record(SEQUENCES)
    result = layer_diff.diff(_write(tmp_path, _rollout_passes(record)), record, SEQUENCES)
    assert result["summary"].startswith("no difference")
    assert result["first_difference"] is None
    assert result["passes"] == [os.path.join("TP0_PP0_Rank0_pid42", "Pass00002.pt")]  # sampling passes left out
    assert result["tokens"] == sum(len(s) - n + 1 for s, n in zip(SEQUENCES, PROMPT_LENS))
    names = [t["name"] for t in result["tensors"]]
    assert names == [NAMES[0], NAMES[1], NAMES[2], NAMES[3], NAMES[4] + "[0]", NAMES[4] + "[1]",
                     NAMES[5] + "[0]", NAMES[5] + "[1]"]  # forward order, tuple outputs element by element
    assert all(t["differing"] == 0 and t["elements"] > 0 for t in result["tensors"])
    assert result["trainer_only"] == [] and result["engine_only"] == []


def test_a_perturbed_tensor_is_named_first(tmp_path):
    record = _record(SEQUENCES)

    def perturb(tensors):
        tensors[NAMES[3]][4, 1] += 1  # one element of the attention output; everything after differs too
        tensors[NAMES[4]][1][0, 0] += 1

    result = layer_diff.diff(_write(tmp_path, _rollout_passes(record, perturb=perturb)), record, SEQUENCES)
    assert result["first_difference"]["name"] == NAMES[3]
    assert "1 of" in result["first_difference"]["reason"]
    by_name = {t["name"]: t for t in result["tensors"]}
    assert by_name[NAMES[2]]["differing"] == 0  # the tensors before it are equal
    assert by_name[NAMES[3]]["differing"] == 1 and by_name[NAMES[3]]["max_abs_diff"] > 0
    assert by_name[NAMES[4] + "[1]"]["differing"] == 1
    assert result["summary"].startswith(f"first difference at {NAMES[3]}")


def test_a_shared_module_is_compared_at_its_last_call_only(tmp_path):
    """SGLang's layers share one rotary embedding: its dumped entry under every layer's name is the last layer's
    output, so only the last layer's entry is compared, and the others are listed as shared, not as differences."""
    rope = "self_attn.rotary_emb"
    record = _record(SEQUENCES)
    tokens = sum(len(s) for s in SEQUENCES)
    gen = torch.Generator().manual_seed(1)
    for layer in (0, 1):
        record[f"model.layers.{layer}.{rope}"] = [torch.randn(tokens, 8, generator=gen) for _ in range(2)]

    def as_the_dumper_records(tensors):  # every layer's entry holds layer 1's (the last) output
        tensors[f"model.layers.0.{rope}"] = [t.clone() for t in tensors[f"model.layers.1.{rope}"]]

    result = layer_diff.diff(_write(tmp_path, _rollout_passes(record, perturb=as_the_dumper_records)), record,
                             SEQUENCES)
    assert result["first_difference"] is None, result["summary"]
    assert result["shared"] == [f"model.layers.0.{rope}[0]", f"model.layers.0.{rope}[1]"]
    compared = {t["name"]: t for t in result["tensors"]}
    assert compared[f"model.layers.1.{rope}[0]"]["elements"] > 0 and f"model.layers.0.{rope}[0]" not in compared

    def wrong_last_layer(tensors):
        as_the_dumper_records(tensors)
        tensors[f"model.layers.1.{rope}"][0][0, 0] += 1

    result = layer_diff.diff(_write(tmp_path / "b", _rollout_passes(record, perturb=wrong_last_layer)), record,
                             SEQUENCES)
    assert result["first_difference"]["name"] == f"model.layers.1.{rope}[0]"


def test_a_dtype_change_with_equal_values_is_named(tmp_path):
    record = _record(SEQUENCES)

    def perturb(tensors):
        tensors[NAMES[1]] = tensors[NAMES[1]].double()  # same values, another dtype

    result = layer_diff.diff(_write(tmp_path, _rollout_passes(record, perturb=perturb)), record, SEQUENCES)
    assert result["first_difference"]["name"] == NAMES[1]
    assert "dtypes differ" in result["first_difference"]["reason"]
    assert {t["name"]: t for t in result["tensors"]}[NAMES[1]]["dtype_mismatch"] is True


def test_rows_are_aligned_to_their_samples(tmp_path):
    """The scoring requests come in another order than the samples, after a cached prefix, and two samples are the
    same tokens (their trainer rows differ here, so a request matched to the wrong one would differ everywhere): a
    change in one row of the engine's pass is found at that row's sample and position."""
    record = _record(SEQUENCES)
    sample, position = 0, 4
    # Scoring order 1, 0, 2, each after its prompt but one: sample 1's rows (positions 3..6) come first, then
    # sample 0's from position 2.
    row = (len(SEQUENCES[1]) - (PROMPT_LENS[1] - 1)) + position - (PROMPT_LENS[sample] - 1)

    def perturb(tensors):
        tensors[NAMES[0]][row, 0] += 1

    result = layer_diff.diff(_write(tmp_path, _rollout_passes(record, perturb=perturb)), record, SEQUENCES)
    first = result["tensors"][0]
    assert first["name"] == NAMES[0] and first["differing"] == 1
    assert first["first_differing_token"] == {"sample": 0, "position": 4}
    assert "first at sample 0 position 4" in result["first_difference"]["reason"]


def test_no_scoring_pass_is_said(tmp_path):
    record = _record(SEQUENCES)
    prefill_only = _rollout_passes(record)[:2]
    result = layer_diff.diff(_write(tmp_path, prefill_only), record, SEQUENCES)
    assert result["passes"] == [] and result["summary"].startswith("no pass of the teacher-forced scoring request")


def test_segments_refuse_unknown_tokens_and_broken_positions():
    tensors = {layer_diff.INPUT_IDS: torch.tensor([1, 2, 3]), layer_diff.POSITIONS: torch.tensor([0, 1, 2]),
               layer_diff.SEQ_LENS: torch.tensor([3])}
    assert layer_diff.segments(tensors, [[1, 2, 3, 4]]) == [(0, 3, 0, 0)]
    assert layer_diff.segments(tensors, [[1, 2, 4]]) is None  # no sample has these tokens
    tensors[layer_diff.POSITIONS] = torch.tensor([0, 2, 3])
    assert layer_diff.segments(tensors, [[1, 2, 3, 4]]) is None  # positions do not run 0 .. seq_len - 1


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _report_folder(tmp_path, perturb=None):
    """A check's report folder for `tiny` (bf16, as the check loads it for the on-policy trainer): rollout.json,
    report.json's settings, and an engine dump whose scoring pass is the stand-in forward's record, after a cached
    prefix."""
    cache = str(tmp_path / "cache")
    info = models.resolve_model("tiny", cache_dir=cache, seed=0, log=lambda m: None)
    samples = [rollout_lib.Sample(prompt_index=b, sample_index=0, prompt_ids=s[:n], completion_ids=s[n:],
                                  engine_logprobs=[-1.0] * (len(s) - n))
               for b, (s, n) in enumerate(zip(SEQUENCES, PROMPT_LENS))]
    rollout = rollout_lib.Rollout(model_name="tiny", model_fingerprint=info.fingerprint, engine="sglang",
                                  engine_layout="tp1", logprob_kind="temperature", temperature=1.0, top_p=1.0,
                                  max_new_tokens=4, seed=0, samples=samples)
    folder = tmp_path / "report"
    folder.mkdir()
    rollout_lib.save(rollout, str(folder / report.ROLLOUT_NAME))
    (folder / report.JSON_NAME).write_text(json.dumps({"settings": {"model": "tiny", "cache_dir": cache, "seed": 0}}))
    model = models.load_hf_model(info, dtype=torch.bfloat16, device=torch.device("cpu"))
    packed = rollout_lib.pack(rollout, rollout.longest)
    record = {}
    on_policy.model_outputs(model, packed.input_ids, [len(s) for s in SEQUENCES], record=record)
    scoring = _engine_pass(record, SEQUENCES, [(b, n - 1, len(SEQUENCES[b])) for b, n in enumerate(PROMPT_LENS)])
    if perturb:
        perturb(scoring)
    _write(folder, [scoring], dump_dir=os.path.join("engine_dump", "tp1"))
    return folder


def _run_main(folder):
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "sglang_checks.layer_diff_main", f"--report_dir={folder}",
                           "--kernels=torch"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_layer_diff_main_reruns_the_trainer_and_finds_no_difference(tmp_path):
    folder = _report_folder(tmp_path)
    proc = _run_main(folder)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "layer_diff_main: no difference" in proc.stdout
    result = json.loads((folder / "layer_diff_tp1.json").read_text())
    assert result["first_difference"] is None
    # embed, 2 layers (tuple outputs split), final norm; layer 0's rotary embedding (q, k) is the shared module's
    # entry, compared at the last layer only
    assert len(result["tensors"]) == 1 + 13 + 14 + 2 - 2
    assert result["shared"] == ["model.layers.0.self_attn.rotary_emb[0]", "model.layers.0.self_attn.rotary_emb[1]"]


def test_layer_diff_main_names_the_first_difference(tmp_path):
    name = "model.layers.1.mlp.act_fn"

    def perturb(tensors):
        tensors[name][0, 0] += 1

    proc = _run_main(_report_folder(tmp_path, perturb))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"layer_diff_main: first difference at {name}" in proc.stdout
    assert proc.stdout.splitlines()[-2].startswith("model.norm[1]")  # listed up to 3 tensors past the first


def test_layer_diff_main_without_a_dump_is_bad_input(tmp_path):
    proc = _run_main(tmp_path)
    assert proc.returncode == 2 and "no PassNNNNN.pt under" in proc.stderr


def test_layer_diff_main_says_the_report_folder_does_not_exist(tmp_path, monkeypatch, capsys):
    """A --report_dir that is not there is said to be that, in one line with exit 2, not as a dump missing under it.
    In this process (the program's own entry, as its __main__ runs it): a subprocess would add its start-up."""
    from ppo_ops.runtime import cli as runtime_cli
    from sglang_checks import layer_diff_main

    path = tmp_path / "nonexistent"
    monkeypatch.setattr(sys, "argv", ["layer_diff_main", f"--report_dir={path}", "--kernels=torch"])
    with pytest.raises(SystemExit) as exited:
        runtime_cli.run(layer_diff_main.main, program="layer_diff_main")
    assert exited.value.code == 2
    line = processes.only_line(capsys.readouterr().err)
    assert line == f"layer_diff_main: error: --report_dir={path}: the report folder does not exist", line
