"""The SGLang engine: one `python -m sglang.launch_server` subprocess per engine layout, driven over HTTP.

Version facts (SGLang 0.5.17, the release the check is written against; 0.5.11-0.5.17 pin torch 2.11.0):
  - `python -m sglang.launch_server` still starts a server (0.5.17 prefers `sglang serve` and warns).
  - Piecewise (prefill) CUDA graphs are on by default and a known source of flaky results in such checks; 0.5.17
    turns them off with `--cuda-graph-backend-prefill disabled` (its `--disable-piecewise-cuda-graph` is a deprecated
    alias of that), which every launch passes. `--disable-cuda-graph` is likewise deprecated:
    --sglang_disable_cuda_graph passes `--cuda-graph-backend-decode disabled` as well.
  - `--enable-deterministic-inference` (batch-invariant kernels) and `--rl-on-policy-target fsdp` (true on-policy:
    sampler log-probs from log_softmax of bf16 logits / T, sampling from them; it implies deterministic inference).
  - `GET /server_info` (0.5.17; `/get_server_info` is its deprecated alias) reports `version`; it is recorded with
    the launch command and the start-up time in the report.
  - `--debug-tensor-dump-output-folder DIR` (--sglang_dump_tensors) saves every forward pass's module outputs under
    DIR/TP{tp}_PP{pp}_Rank{rank}_pid{pid}/PassNNNNN.pt (debug_utils/tensor_dump_forward_hook.py) and turns CUDA
    graphs and server warmup off (server_args.py); layer_diff.py reads it.
  - `POST /update_weights_from_disk {"model_path": ...}` reloads weights in a running server (the RL weight sync):
    the training steps load each step's weights with it, and the negative control `engine_layout_weights` gives
    one engine layout other weights. `POST /get_weights_by_name {"name", "truncate_size"}` answers a parameter's
    first truncate_size rows as nested lists (one per replica under data parallelism): the training steps' read-back.
  - An SGLang install without FA3 kernels and FlashInfer sampling kernels (such as SGLang 0.5.17 with sglang-kernel
    0.4.5 built on torch 2.11, the one of docs/gpu_runs.md) needs `--attention-backend triton --sampling-backend
    pytorch --disable-custom-all-reduce --mm-feature-transport cpu`: pass its interpreter as --sglang_python and
    --sglang_attention_backend=triton --sglang_sampling_backend=pytorch --sglang_disable_custom_all_reduce
    --sglang_mm_feature_transport=cpu.

Server: started on 127.0.0.1 at a free port (or --sglang_port, refused up front if taken) in a session of its own,
so its scheduler and detokenizer processes share its process group; its stdout and stderr go to a log file in the
report folder. Always launched with `--skip-tokenizer-init` (we send token ids). Start-up waits for `GET /health`
to answer 200 (503 while it loads); if the process exits first, or the wait times out, the error shows the tail of
its log. Shutdown (`close`, also on failure and Ctrl-C via the context manager, and at interpreter exit as a
backstop) sends SIGTERM to the whole group, then SIGKILL to whatever is left.

sglang itself is never imported here: the server runs in `--sglang_python` (default: this interpreter; SGLang pins
its own torch, so it often lives in an environment of its own), which is checked for the package before anything
starts.

Requests (SGLang's native API): `POST /generate` with `input_ids` (a list of id lists), `sampling_params`,
`return_logprob: true`, `logprob_start_len`. Responses are one object per input with `output_ids` and
`meta_info.output_token_logprobs` / `meta_info.input_token_logprobs`, lists of `[logprob, token_id, text_or_null]`;
the first input entry's logprob is null.
  - sampling: `logprob_start_len = -1` (output tokens only); the returned log-probs are of kind `temperature`
    (log softmax(logits / T) over the full vocabulary, before top-p: 0.5.17's sampler.py keeps the unfiltered
    probabilities for them; logprob_kinds.py), or `raw` under SGLANG_RETURN_ORIGINAL_LOGPROB=1
    (--sglang_logprob_kind says which).
  - teacher-forced scoring: prompt + completion as input, `max_new_tokens = 1` (the extra token is ignored),
    `logprob_start_len = len(prompt) - 1`; the last len(completion) input entries are the completion's log-probs
    (kind `raw`), and their token ids are checked against the completion.
"""

from __future__ import annotations

import atexit
import dataclasses
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Dict, List, Optional, Sequence, Tuple

from ppo_ops.runtime import ranks as runtime_ranks
from sglang_checks import logprob_kinds
from sglang_checks.engines import SamplingSettings
from sglang_checks.errors import CheckError
from sglang_checks.layouts import Layout
from sglang_checks.rollout import Sample

ALLOWED_DIMS = ("tp", "dp")
SGLANG_VERSION = "0.5.17"
INSTALL_HINT = (
    f"pip install 'sglang=={SGLANG_VERSION}' in an environment with NVIDIA GPUs and CUDA (it pins torch 2.11.0 and "
    f"pulls CUDA wheels), then pass that environment's interpreter as --sglang_python=/path/to/venv/bin/python")
RL_ON_POLICY_TARGETS = ("fsdp",)  # 0.5.17's choices for --rl-on-policy-target
LOG_TAIL_LINES = 40


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    python: str = sys.executable
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port
    dtype: str = "float32"
    seed: int = 0
    deterministic: bool = False
    rl_on_policy_target: Optional[str] = None  # one of RL_ON_POLICY_TARGETS; implies deterministic inference
    attention_backend: Optional[str] = None  # e.g. "triton" for an install without FA3 kernels
    sampling_backend: Optional[str] = None  # e.g. "pytorch" for an install without FlashInfer sampling kernels
    disable_custom_all_reduce: bool = False
    mm_feature_transport: Optional[str] = None  # "cpu" for an install without FA3 / FlashInfer sampling
    disable_cuda_graph: bool = False  # decode graphs too (piecewise prefill graphs are always off)
    skip_server_warmup: bool = False
    mem_fraction_static: Optional[float] = None
    extra_args: Tuple[str, ...] = ()
    start_timeout_s: float = 900.0
    request_timeout_s: float = 600.0
    log_dir: str = "."
    logprob_kind: str = logprob_kinds.TEMPERATURE
    tensor_dump_dir: Optional[str] = None  # --debug-tensor-dump-output-folder (None: no dump)
    extra_env: Tuple[Tuple[str, str], ...] = ()  # more environment variables for the server


def launch_command(model_path: str, layout: Layout, port: int, options: ServerOptions) -> List[str]:
    command = [
        options.python, "-m", "sglang.launch_server",
        "--model-path", model_path,
        "--host", options.host,
        "--port", str(port),
        "--tp-size", str(layout.tp),
        "--dp-size", str(layout.dp),
        "--dtype", options.dtype,
        "--random-seed", str(options.seed),
        "--skip-tokenizer-init",
        "--cuda-graph-backend-prefill", "disabled",  # piecewise CUDA graphs off (module docstring)
    ]
    if options.disable_cuda_graph:
        command += ["--cuda-graph-backend-decode", "disabled"]
    if options.skip_server_warmup:
        command.append("--skip-server-warmup")
    if options.deterministic:
        command.append("--enable-deterministic-inference")
    if options.rl_on_policy_target:
        command += ["--rl-on-policy-target", options.rl_on_policy_target]
    if options.attention_backend:
        command += ["--attention-backend", options.attention_backend]
    if options.sampling_backend:
        command += ["--sampling-backend", options.sampling_backend]
    if options.disable_custom_all_reduce:
        command.append("--disable-custom-all-reduce")
    if options.mm_feature_transport:
        command += ["--mm-feature-transport", options.mm_feature_transport]
    if options.mem_fraction_static is not None:
        command += ["--mem-fraction-static", str(options.mem_fraction_static)]
    if options.tensor_dump_dir:
        command += ["--debug-tensor-dump-output-folder", options.tensor_dump_dir]
    return command + list(options.extra_args)


def check_layout(layout: Layout, flag: str, gpus: int) -> None:
    if layout.cp != 1:
        raise CheckError(f"{flag}: SGLang engine layouts split by tp and dp only; got {layout.name!r}")
    if layout.world_size > gpus:
        raise CheckError(f"{flag}: engine layout {layout.name!r} needs {layout.world_size} GPUs, but {gpus} "
                         f"{'is' if gpus == 1 else 'are'} visible")


def check_installed(python: str) -> str:
    """The server's interpreter must have sglang; returns its version, or says exactly what to install."""
    probe = ("import importlib.metadata as m, importlib.util as u, sys\n"
             "if not u.find_spec('sglang'): sys.exit(3)\n"
             "try: print(m.version('sglang'))\n"
             "except m.PackageNotFoundError: print('unknown')")
    try:
        proc = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CheckError(f"--sglang_python={python}: cannot run it ({exc})") from exc
    if proc.returncode != 0:
        raise CheckError(f"--engine=sglang: the sglang package is not installed for {python}. {INSTALL_HINT}")
    return proc.stdout.strip() or "unknown"


def scripts_dir(python: str) -> str:
    """The folder of the interpreter's console scripts: the server's JIT builds (flashinfer) run tools installed
    there, such as ninja, which a caller's PATH need not hold (Bazel's test PATH is /bin:/usr/bin:/usr/local/bin)."""
    probe = "import sysconfig; print(sysconfig.get_path('scripts'))"
    try:
        proc = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CheckError(f"--sglang_python={python}: cannot run it ({exc})") from exc
    if proc.returncode != 0 or not proc.stdout.strip():
        raise CheckError(f"--sglang_python={python}: cannot ask it for its scripts folder: {proc.stderr.strip()}")
    return proc.stdout.strip()


def site_dir(python: str) -> str:
    """The folder the interpreter imports sglang from (its site-packages, or a bundle on its PYTHONPATH): the
    trainer appends it to sys.path to call SGLang's kernels in-process (on_policy.py)."""
    probe = ("import importlib.util as u, os\n"
             "print(os.path.dirname(os.path.dirname(os.path.abspath(u.find_spec('sglang').origin))))")
    try:
        proc = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CheckError(f"--sglang_python={python}: cannot run it ({exc})") from exc
    if proc.returncode != 0 or not proc.stdout.strip():
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        raise CheckError(f"--sglang_python={python}: cannot find the sglang package's folder ({tail[0]}). "
                         f"{INSTALL_HINT}")
    return proc.stdout.strip().splitlines()[-1]


def check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise CheckError(f"--sglang_port={port}: port {port} on {host} is in use; pick another or pass 0 "
                                 f"for a free one") from exc
            raise CheckError(f"--sglang_port={port}: cannot bind {host}:{port} ({exc})") from exc


def log_tail(path: str, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:]).rstrip()
    except OSError:
        return "(no log)"


_LIVE_SERVERS: Dict[int, "Server"] = {}


@atexit.register
def _close_all_servers() -> None:  # backstop: no server outlives the check
    for server in list(_LIVE_SERVERS.values()):
        server.close()


class ServerError(RuntimeError):
    """An HTTP error answer of the server: its status `code` and (the start of) its `body`."""

    def __init__(self, path: str, code: int, body: str):
        super().__init__(f"SGLang {path} answered HTTP {code}: {body}")
        self.code, self.body = code, body


# SGLang's answer (HTTP 400) to /get_weights_by_name when the served model class has no get_weights_by_name (Qwen3
# in SGLang 0.5.17: the model runner logs the AttributeError and the endpoint sees nothing).
UNREADABLE_WEIGHTS = "Get parameter by name failed"


class Server:
    """A server subprocess: start, wait for health, JSON requests, and a shutdown that always happens."""

    def __init__(self, command: Sequence[str], *, host: str, port: int, log_path: str, start_timeout_s: float,
                 request_timeout_s: float = 600.0, env: Optional[Dict[str, str]] = None):
        self.command = list(command)
        self.url = f"http://{host}:{port}"
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        self.request_timeout_s = request_timeout_s
        self.env = env
        self.process: Optional[subprocess.Popen] = None
        self.startup_s: Optional[float] = None  # launch to healthy

    def __enter__(self) -> "Server":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        started = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True, env=self.env)
        _LIVE_SERVERS[id(self)] = self
        self.wait_healthy()
        self.startup_s = time.monotonic() - started

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            code = self.process.poll()
            if code is not None:
                raise CheckError(f"the SGLang server exited with code {code} during start-up; last lines of its log "
                                 f"{self.log_path}:\n{log_tail(self.log_path)}")
            if self._health_ok():
                return
            if time.monotonic() > deadline:
                raise CheckError(f"the SGLang server was not healthy within {self.start_timeout_s:.0f} s; last "
                                 f"lines of its log {self.log_path}:\n{log_tail(self.log_path)}")
            time.sleep(0.5)

    def _health_ok(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, socket.timeout, OSError):
            return False

    def get(self, path: str):
        return self._request(urllib.request.Request(self.url + path, method="GET"), path)

    def post(self, path: str, payload: dict):
        request = urllib.request.Request(self.url + path, data=json.dumps(payload).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        return self._request(request, path)

    def _request(self, request, path: str):
        try:
            with urllib.request.urlopen(request, timeout=self.request_timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            body = exc.read().decode(errors="replace")[:2000]
            raise ServerError(path, exc.code, body) from exc
        except (urllib.error.URLError, OSError) as exc:
            alive = self.process is not None and self.process.poll() is None
            raise RuntimeError(f"SGLang {path} failed ({exc}); server {'running' if alive else 'exited'}; last "
                               f"lines of its log {self.log_path}:\n{log_tail(self.log_path)}") from exc

    def close(self, grace_s: float = 30.0) -> None:
        """SIGTERM to the server's process group, SIGKILL to what is left; safe to call twice."""
        _LIVE_SERVERS.pop(id(self), None)
        process, self.process = self.process, None
        if process is None:
            return
        _signal_group(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(process.pid, signal.SIGKILL)  # children that outlived the leader, or a leader that hung
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ------------------------------------------------------------------------------------------- request / response


def generation_request(prompts: List[List[int]], samples_per_prompt: int, settings: SamplingSettings,
                       deterministic: bool) -> dict:
    """One batched /generate request: every prompt repeated samples_per_prompt times, in prompt order."""
    params = {"temperature": settings.temperature, "top_p": settings.top_p, "top_k": -1,
              "max_new_tokens": settings.max_new_tokens, "ignore_eos": not settings.eos_token_id}
    if settings.eos_token_id:
        params["stop_token_ids"] = list(settings.eos_token_id)
    if deterministic:
        params["sampling_seed"] = settings.seed  # used by SGLang's deterministic sampling path
    ids = [list(p) for p in prompts for _ in range(samples_per_prompt)]
    return {"input_ids": ids, "sampling_params": params, "return_logprob": True, "logprob_start_len": -1}


def _as_list(response, expected: int, what: str) -> list:
    items = response if isinstance(response, list) else [response]
    if len(items) != expected:
        raise RuntimeError(f"SGLang {what}: expected {expected} responses, got {len(items)}")
    return items


def _logprob_entries(item: dict, key: str, index: int) -> list:
    try:
        entries = item["meta_info"][key]
    except (KeyError, TypeError) as exc:
        raise RuntimeError(f"SGLang response {index}: no meta_info.{key} (was return_logprob sent?)") from exc
    if not isinstance(entries, list) or any(not isinstance(e, (list, tuple)) or len(e) < 2 for e in entries):
        raise RuntimeError(f"SGLang response {index}: meta_info.{key} is not a list of [logprob, token_id, text]")
    return entries


def parse_generation_response(response, prompts: List[List[int]], samples_per_prompt: int) -> List[Sample]:
    items = _as_list(response, len(prompts) * samples_per_prompt, "/generate")
    samples = []
    for index, item in enumerate(items):
        entries = _logprob_entries(item, "output_token_logprobs", index)
        tokens = [int(e[1]) for e in entries]
        output_ids = item.get("output_ids")
        if output_ids is not None and list(output_ids) != tokens:
            raise RuntimeError(f"SGLang response {index}: output_ids and output_token_logprobs disagree")
        if any(e[0] is None for e in entries):
            raise RuntimeError(f"SGLang response {index}: an output token has no logprob")
        p_index, s_index = divmod(index, samples_per_prompt)
        samples.append(Sample(prompt_index=p_index, sample_index=s_index, prompt_ids=list(prompts[p_index]),
                              completion_ids=tokens, engine_logprobs=[float(e[0]) for e in entries]))
    return samples


def scoring_request(samples: List[Sample]) -> dict:
    return {"input_ids": [s.prompt_ids + s.completion_ids for s in samples],
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": [max(len(s.prompt_ids) - 1, 0) for s in samples]}


def parse_scoring_response(response, samples: List[Sample]) -> List[List[float]]:
    items = _as_list(response, len(samples), "/generate (scoring)")
    out = []
    for index, (item, sample) in enumerate(zip(items, samples)):
        entries = _logprob_entries(item, "input_token_logprobs", index)
        n = len(sample.completion_ids)
        tail = entries[len(entries) - n:] if n else []
        if len(tail) != n or [int(e[1]) for e in tail] != sample.completion_ids:
            raise RuntimeError(f"SGLang scoring response {index}: the last {n} input_token_logprobs are not the "
                               f"completion's tokens")
        if any(e[0] is None for e in tail):
            raise RuntimeError(f"SGLang scoring response {index}: a completion token has no logprob")
        out.append([float(e[0]) for e in tail])
    return out


def weights_by_name_request(name: str, rows: int) -> dict:
    """POST /get_weights_by_name: the parameter's first `rows` rows (its truncate_size)."""
    return {"name": name, "truncate_size": rows}


class SGLangEngine:
    name = "sglang"

    def __init__(self, model_path: str, layout: Layout, options: ServerOptions):
        self.layout = layout
        self.options = options
        self.sampled_logprob_kind = options.logprob_kind
        self.costs: Dict[str, float] = {}  # _add_cost
        port = options.port or runtime_ranks.free_port(options.host)
        if options.port:
            check_port_free(options.host, port)
        os.makedirs(options.log_dir, exist_ok=True)
        log_path = os.path.join(options.log_dir, f"sglang_{layout.name}.log")
        if os.path.exists(log_path):
            os.remove(log_path)
        env = dict(os.environ)
        env["PATH"] = os.pathsep.join(p for p in (scripts_dir(options.python), env.get("PATH", "")) if p)
        if options.logprob_kind == logprob_kinds.RAW:
            env["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"
        env.update(dict(options.extra_env))
        self.server = Server(launch_command(model_path, layout, port, options), host=options.host, port=port,
                             log_path=log_path, start_timeout_s=options.start_timeout_s,
                             request_timeout_s=options.request_timeout_s, env=env)

    def __enter__(self):
        self.server.__enter__()
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self.server.close()

    def info(self) -> dict:
        """What ran: the SGLang version the server reports, its launch command and how long it took to start."""
        version = "unknown"
        for path in ("/server_info", "/get_server_info"):  # 0.5.17; its deprecated alias (older releases)
            try:
                version = str(self.server.get(path).get("version", "unknown"))
                break
            except (RuntimeError, ValueError, AttributeError):  # no such endpoint, not JSON, not an object
                continue
        return {"engine": "sglang", "layout": self.layout.name, "version": version,
                "command": " ".join(self.server.command[1:]), "startup_s": self.server.startup_s, **self.costs}

    def load_weights(self, model_path: str) -> None:
        """Replaces the served weights (the RL weight sync); the cache of computed prefixes is flushed with them."""
        answer = self.server.post("/update_weights_from_disk", {"model_path": model_path, "flush_cache": True})
        if not isinstance(answer, dict) or not answer.get("success", False):
            raise RuntimeError(f"SGLang /update_weights_from_disk failed for {model_path}: {answer}")

    def weights_by_name(self, name: str, rows: int):
        """The first `rows` rows of the served parameter `name` (checkpoint naming), as nested lists of floats; a
        list of them, one per replica, under data parallelism (the training steps' read-back, train_steps.py).
        None when the served model class has no get_weights_by_name (SGLang then answers HTTP 400 with
        UNREADABLE_WEIGHTS; an older server, null)."""
        try:
            answer = self.server.post("/get_weights_by_name", weights_by_name_request(name, rows))
        except ServerError as exc:
            if exc.code == 400 and UNREADABLE_WEIGHTS in exc.body:
                return None
            raise
        if isinstance(answer, dict):  # an error object, not a parameter
            raise RuntimeError(f"SGLang /get_weights_by_name failed for {name}: {answer}")
        return answer

    def generate(self, prompts, samples_per_prompt, settings: SamplingSettings) -> List[Sample]:
        seeded = self.options.deterministic or bool(self.options.rl_on_policy_target)
        request = generation_request(prompts, samples_per_prompt, settings, seeded)
        started = time.monotonic()
        samples = parse_generation_response(self.server.post("/generate", request), prompts, samples_per_prompt)
        self._add_cost("generate", time.monotonic() - started, sum(len(s.completion_ids) for s in samples))
        return samples

    def score(self, samples: List[Sample]) -> List[List[float]]:
        started = time.monotonic()
        scores = parse_scoring_response(self.server.post("/generate", scoring_request(samples)), samples)
        self._add_cost("score", time.monotonic() - started, sum(len(s.prompt_ids) + len(s.completion_ids)
                                                               for s in samples))
        return scores

    def _add_cost(self, what: str, seconds: float, tokens: int) -> None:
        """What the report records of the engine's cost: wall time and tokens of its requests, and tokens / s
        (generate: completion tokens; score: prompt + completion tokens)."""
        self.costs[f"{what}_s"] = self.costs.get(f"{what}_s", 0.0) + seconds
        self.costs[f"{what}_tokens"] = self.costs.get(f"{what}_tokens", 0) + tokens
        self.costs[f"{what}_tokens_per_s"] = self.costs[f"{what}_tokens"] / max(self.costs[f"{what}_s"], 1e-9)
