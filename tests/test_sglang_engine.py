"""The SGLang engine on CPU, without sglang: launch command, request and response layout (SGLang 0.5.17's
/generate API), and the server life cycle against a fake server on loopback.

The fake server is this file run as a script (`python test_sglang_engine.py --fake-server MODE --port N ...`): a
stdlib HTTP server that answers /health and /generate in SGLang's layout, starts a child process the way SGLang starts
its scheduler (to check the whole process group is shut down), and can instead die during start-up, never become
healthy, or ignore SIGTERM. A wrapper script standing in for `--sglang_python` runs it for `-m sglang.launch_server`.
Runtime: ~15 s (each fake server is a Python start-up).
"""

import json
import os
import socket
import stat
import subprocess
import sys
import time


# ----------------------------------------------------------------------------------- the fake server (stdlib only)
# It comes before the test imports so that running this file as the fake server starts fast (no torch import).


def _fake_server_main(argv):
    """Stdlib-only stand-in for `python -m sglang.launch_server` (see the module docstring)."""
    import argparse
    import http.server
    import signal

    if "-c" in argv:  # the engine's probes: run them here (check_installed's finds no sglang: pretend it is there)
        code = argv[argv.index("-c") + 1]
        if "sysconfig" in code:
            exec(code)
        sys.exit(0)
    parser = argparse.ArgumentParser()
    parser.add_argument("--fake-server")
    parser.add_argument("--state")
    parser.add_argument("--port", type=int)
    args, rest = parser.parse_known_args(argv)
    with open(os.path.join(args.state, "fake_argv.json"), "w") as f:
        json.dump(rest, f)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.path.join(args.state, "fake_pids.txt"), "w") as f:
        f.write(f"{os.getpid()} {child.pid}\n")
    print("loading weights (fake)", flush=True)
    if args.fake_server == "die":
        print("RuntimeError: CUDA out of memory (fake)", flush=True)
        sys.exit(3)
    if args.fake_server == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    health_polls = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, code, body=None):
            data = json.dumps(body).encode() if body is not None else b""
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/server_info":
                self._send(200, {"version": "0.5.17-fake"})
                return
            health_polls.append(1)
            starting = args.fake_server == "hang" or len(health_polls) < 3
            self._send(503 if starting else 200)

        def do_POST(self):
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/update_weights_from_disk":
                with open(os.path.join(args.state, "fake_weights.txt"), "w") as f:
                    f.write(request["model_path"])
                self._send(200, {"success": True, "message": "ok"})
                return
            out = []
            for n, ids in enumerate(request["input_ids"]):
                if request["logprob_start_len"] == -1:
                    new = [3 + k for k in range(request["sampling_params"]["max_new_tokens"])]
                    out.append({"text": "", "output_ids": new, "meta_info": {
                        "output_token_logprobs": [[-0.5 * (k + 1), t, None] for k, t in enumerate(new)]}})
                else:
                    start = request["logprob_start_len"][n]
                    entries = [[None if i == 0 else -0.01 * i, t, None] for i, t in enumerate(ids) if i >= start]
                    out.append({"text": "", "output_ids": [0], "meta_info": {"input_token_logprobs": entries}})
            self._send(200, out)

    http.server.ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    _fake_server_main(sys.argv[1:])
    sys.exit(0)

# Below the fake server on purpose: run as the fake server (one start per test), this file stops above, before these
# imports pull in torch through sglang_checks and add seconds to every start-up.
import pytest  # noqa: E402

from ppo_ops.runtime import ranks as runtime_ranks  # noqa: E402
from sglang_checks.engines import SamplingSettings, sglang_engine  # noqa: E402
from sglang_checks.errors import CheckError  # noqa: E402
from sglang_checks.layouts import Layout  # noqa: E402
from sglang_checks.rollout import Sample  # noqa: E402

THIS_FILE = os.path.abspath(__file__)
REPO_ROOT = os.path.dirname(os.path.dirname(THIS_FILE))
SETTINGS = SamplingSettings(temperature=0.8, top_p=0.95, max_new_tokens=3, seed=5, eos_token_id=[7])


# ------------------------------------------------------------------------------------------------ pure functions


# 0.5.17 spells --disable-piecewise-cuda-graph (a deprecated alias there) as:
PIECEWISE_OFF = ["--cuda-graph-backend-prefill", "disabled"]


def test_launch_command_always_disables_piecewise_cuda_graph():
    options = sglang_engine.ServerOptions(python="/venv/bin/python", dtype="bfloat16", seed=3, deterministic=True,
                                          mem_fraction_static=0.6, extra_args=("--log-level", "debug"))
    command = sglang_engine.launch_command("/models/q", Layout("tp2dp2", tp=2, dp=2), 31000, options)
    assert command == [
        "/venv/bin/python", "-m", "sglang.launch_server", "--model-path", "/models/q", "--host", "127.0.0.1",
        "--port", "31000", "--tp-size", "2", "--dp-size", "2", "--dtype", "bfloat16", "--random-seed", "3",
        "--skip-tokenizer-init", *PIECEWISE_OFF, "--enable-deterministic-inference",
        "--mem-fraction-static", "0.6", "--log-level", "debug"]
    plain = sglang_engine.launch_command("/m", Layout("tp1"), 1, sglang_engine.ServerOptions())
    assert plain[-2:] == PIECEWISE_OFF and "--enable-deterministic-inference" not in plain


def test_launch_command_for_an_install_without_fa3_and_with_on_policy_options():
    options = sglang_engine.ServerOptions(
        python="/tmp/sgl_python", dtype="bfloat16", rl_on_policy_target="fsdp", attention_backend="triton",
        sampling_backend="pytorch", disable_custom_all_reduce=True, mm_feature_transport="cpu",
        disable_cuda_graph=True, skip_server_warmup=True)
    command = sglang_engine.launch_command("/m", Layout("dp2", dp=2), 30000, options)
    tail = command[command.index("--skip-tokenizer-init") + 1:]
    assert tail == [*PIECEWISE_OFF, "--cuda-graph-backend-decode", "disabled", "--skip-server-warmup",
                    "--rl-on-policy-target", "fsdp", "--attention-backend", "triton", "--sampling-backend", "pytorch",
                    "--disable-custom-all-reduce", "--mm-feature-transport", "cpu"]
    assert command[command.index("--tp-size") + 1] == "1" and command[command.index("--dp-size") + 1] == "2"


def test_generation_request_layout():
    request = sglang_engine.generation_request([[1, 2], [3]], 2, SETTINGS, deterministic=False)
    assert request == {
        "input_ids": [[1, 2], [1, 2], [3], [3]],
        "sampling_params": {"temperature": 0.8, "top_p": 0.95, "top_k": -1, "max_new_tokens": 3,
                            "ignore_eos": False, "stop_token_ids": [7]},
        "return_logprob": True, "logprob_start_len": -1}
    no_eos = SamplingSettings(temperature=1.0, top_p=1.0, max_new_tokens=3, seed=5, eos_token_id=None)
    seeded = sglang_engine.generation_request([[1]], 1, no_eos, deterministic=True)
    assert seeded["sampling_params"]["ignore_eos"] is True and seeded["sampling_params"]["sampling_seed"] == 5


def _gen_item(tokens, logprobs):
    return {"text": "", "output_ids": tokens,
            "meta_info": {"output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, tokens)]}}


def test_parse_generation_response():
    response = [_gen_item([5, 6], [-0.5, -1.5]), _gen_item([9], [-0.25])]
    samples = sglang_engine.parse_generation_response(response, [[1, 2]], 2)
    assert [(s.prompt_index, s.sample_index, s.prompt_ids, s.completion_ids, s.engine_logprobs) for s in samples] == [
        (0, 0, [1, 2], [5, 6], [-0.5, -1.5]), (0, 1, [1, 2], [9], [-0.25])]


@pytest.mark.parametrize("response, message", [
    ([_gen_item([5], [-0.5])], "expected 2 responses, got 1"),
    ([{"output_ids": [5]}, _gen_item([5], [-0.5])], "no meta_info.output_token_logprobs"),
    ([dict(_gen_item([5], [-0.5]), output_ids=[6]), _gen_item([5], [-0.5])], "disagree"),
    ([_gen_item([5], [None]), _gen_item([5], [-0.5])], "has no logprob"),
    ([{"meta_info": {"output_token_logprobs": [[-0.5]]}}, _gen_item([5], [-0.5])], "not a list of"),
])
def test_malformed_generation_response_is_an_error(response, message):
    with pytest.raises(RuntimeError, match=message):
        sglang_engine.parse_generation_response(response, [[1]], 2)


def test_scoring_request_and_response():
    samples = [Sample(0, 0, [1, 2, 3], [4, 5], [-1.0, -2.0]), Sample(1, 0, [8], [9], [-3.0])]
    request = sglang_engine.scoring_request(samples)
    assert request["input_ids"] == [[1, 2, 3, 4, 5], [8, 9]]
    assert request["logprob_start_len"] == [2, 0] and request["return_logprob"] is True
    # From logprob_start_len on: one entry per input token; the very first input token's logprob is None.
    response = [{"meta_info": {"input_token_logprobs": [[-0.3, 3, None], [-0.4, 4, None], [-0.5, 5, None]]}},
                {"meta_info": {"input_token_logprobs": [[None, 8, None], [-0.9, 9, None]]}}]
    assert sglang_engine.parse_scoring_response(response, samples) == [[-0.4, -0.5], [-0.9]]
    shifted = [{"meta_info": {"input_token_logprobs": [[-0.3, 3, None], [-0.4, 5, None], [-0.5, 4, None]]}},
               response[1]]
    with pytest.raises(RuntimeError, match="not the completion's tokens"):
        sglang_engine.parse_scoring_response(shifted, samples)


def test_engine_layouts_need_their_gpus():
    with pytest.raises(CheckError, match="'tp2' needs 2 GPUs, but 1 is visible"):
        sglang_engine.check_layout(Layout("tp2", tp=2), "--engine_layouts", gpus=1)
    with pytest.raises(CheckError, match="tp and dp only"):
        sglang_engine.check_layout(Layout("cp2", cp=2), "--engine_layouts", gpus=8)


@pytest.mark.skipif(__import__("importlib").util.find_spec("sglang") is not None,
                    reason="sglang is installed here, so its absence cannot be tested")
def test_missing_sglang_names_the_package_and_version():
    with pytest.raises(CheckError, match=r"not installed for .*pip install 'sglang==0\.5\.17'.*--sglang_python"):
        sglang_engine.check_installed(sys.executable)


def test_port_in_use_is_refused_before_anything_starts(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(CheckError, match=f"port {port} on 127.0.0.1 is in use"):
            sglang_engine.check_port_free("127.0.0.1", port)
        options = sglang_engine.ServerOptions(python=_fake_python(tmp_path, "ok"), port=port, log_dir=str(tmp_path))
        with pytest.raises(CheckError, match="is in use"):
            sglang_engine.SGLangEngine("/m", Layout("tp1"), options)
    assert not (tmp_path / "fake_pids.txt").exists()  # no server was started


# ------------------------------------------------------------------------------------------- fake server runs


def _fake_python(tmp_path, mode):
    """An executable standing in for --sglang_python: runs this file's fake server in `mode`."""
    path = tmp_path / f"python_{mode}"
    path.write_text(f"#!/bin/sh\nexec {sys.executable} {THIS_FILE} --fake-server {mode} --state {tmp_path} \"$@\"\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _server(tmp_path, mode, **kw):
    port = runtime_ranks.free_port()
    command = [sys.executable, THIS_FILE, "--fake-server", mode, "--state", str(tmp_path), "--port", str(port)]
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    return sglang_engine.Server(command, host="127.0.0.1", port=port, log_path=str(tmp_path / "server.log"),
                                start_timeout_s=kw.pop("start_timeout_s", 60), env=env, **kw)


def _pids(tmp_path):
    with open(tmp_path / "fake_pids.txt") as f:
        return [int(p) for p in f.read().split()]


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # a zombie is dead
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or between the open and the read
        return False


def _all_gone(pids, within_s=10.0):
    deadline = time.monotonic() + within_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(_alive(p) for p in pids)


def test_server_serves_requests_and_shutdown_stops_its_whole_group(tmp_path):
    with _server(tmp_path, "ok") as server:
        pids = _pids(tmp_path)
        assert len(pids) == 2 and all(_alive(p) for p in pids)  # the server and its "scheduler" child
        response = server.post("/generate", sglang_engine.generation_request([[1, 2]], 1, SETTINGS, False))
    assert _all_gone(pids)
    assert response[0]["output_ids"] == [3, 4, 5]


def test_engine_end_to_end_through_a_fake_sglang_python(tmp_path):
    fake = _fake_python(tmp_path, "ok")
    sglang_engine.check_installed(fake)  # the probe asks the given interpreter, not this one
    options = sglang_engine.ServerOptions(python=fake, log_dir=str(tmp_path), start_timeout_s=60)
    with sglang_engine.SGLangEngine("/models/qwen", Layout("tp1"), options) as engine:
        samples = engine.generate([[1, 2], [3]], 2, SETTINGS)
        scores = engine.score(samples)
        info = engine.info()
        engine.load_weights("/models/other")
        pids = _pids(tmp_path)
    assert _all_gone(pids)
    assert [s.completion_ids for s in samples] == [[3, 4, 5], [3, 4, 5], [3, 4, 5], [3, 4, 5]]
    assert samples[0].engine_logprobs == [-0.5, -1.0, -1.5]
    assert scores[0] == pytest.approx([-0.02, -0.03, -0.04])  # the fake scores input position i as -0.01 * i
    argv = json.loads((tmp_path / "fake_argv.json").read_text())
    assert argv[:3] == ["-m", "sglang.launch_server", "--model-path"] and "--cuda-graph-backend-prefill" in argv
    assert (tmp_path / "sglang_tp1.log").exists()
    assert info["version"] == "0.5.17-fake" and info["startup_s"] > 0 and "--skip-tokenizer-init" in info["command"]
    assert (tmp_path / "fake_weights.txt").read_text() == "/models/other"  # /update_weights_from_disk reached it


def test_server_dying_during_start_up_shows_its_log_tail(tmp_path):
    with pytest.raises(CheckError, match=r"(?s)exited with code 3 during start-up.*CUDA out of memory \(fake\)"):
        with _server(tmp_path, "die"):
            pass
    assert _all_gone(_pids(tmp_path))


def test_server_never_healthy_times_out_with_its_log_tail(tmp_path):
    with pytest.raises(CheckError, match=r"(?s)not healthy within 4 s.*loading weights \(fake\)"):
        with _server(tmp_path, "hang", start_timeout_s=4):
            pass
    assert _all_gone(_pids(tmp_path))


def test_ctrl_c_while_waiting_shuts_the_server_down(tmp_path, monkeypatch):
    def interrupted_health_check(server):  # Ctrl-C once the server (and its child) run, before it is healthy
        if (tmp_path / "fake_pids.txt").exists():
            raise KeyboardInterrupt
        return False

    monkeypatch.setattr(sglang_engine.Server, "_health_ok", interrupted_health_check)
    with pytest.raises(KeyboardInterrupt):
        with _server(tmp_path, "hang"):
            pass
    assert _all_gone(_pids(tmp_path))


def test_server_ignoring_sigterm_is_killed(tmp_path):
    server = _server(tmp_path, "stubborn")
    server.start()
    pids = _pids(tmp_path)
    server.close(grace_s=1.0)
    assert _all_gone(pids)


def test_the_server_gets_its_interpreters_scripts_on_path():
    # The server JIT-builds kernels with tools of its own environment (ninja): they must be on its PATH even where the
    # caller's PATH is minimal (Bazel tests get /bin:/usr/bin:/usr/local/bin).
    import sysconfig

    assert sglang_engine.scripts_dir(sys.executable) == sysconfig.get_path("scripts")
