"""Stage 02's vLLM backend (extract.backend: vllm): the serving engine runs the target, we keep its states.

vLLM's speculative method "extract_hidden_states" switches on the target's EAGLE-3 aux outputs for
the ids we ask for and stores them per prompt token in a cache-only KV layer; our KV connector
(common/extract/vllm_connector.py) writes them to one temp file per finished request. Here:

- ids = aux_layer_ids + [N]: id k is the residual stream after k decoder layers (the convention of
  the hf backend and of vLLM's EAGLE-3), and id N is the state after the last layer, BEFORE the final
  norm. final_hidden = the target's final RMSNorm applied to it (weight and eps read from the
  checkpoint, computed in fp32, then cast to extract.dtype): exactly what the lm_head reads.
- one request per sample: prompt_token_ids = the sample's input_ids, max_tokens 1 (the prefill
  is the work; the one sampled token is discarded), prefix caching off (a cached prefix would skip
  the forward pass and leave its rows out of the cache-only layer).
- a shard's samples go to the engine together; finished requests are read as they come (their
  files are loaded and deleted at once), so the temp directory never holds more than one shard.
- parallelism: extract.tensor_parallel_size and extract.enable_expert_parallel go to vLLM as they are;
  extract.data_parallel_size > 1 runs one engine per torchrun process (vLLM's offline data parallel),
  each on its own shards like the hf backend's torchrun mode; the engines step together (MoE expert
  parallel needs every rank in each forward), so a rank without a shard in a round sends a dummy
  one-token request.

See docs/design.md, "Hidden-state extraction through vLLM".
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import multiprocessing
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator

from common.core.errors import ConfigError, PipelineError
from common.serving.vllm_server import cpu_attention_backend, cpu_thread_binding
from common.serving.vllm_version import check_vllm_version

log = logging.getLogger("extract")

CONNECTOR_MODULE = "common.extract.vllm_connector"
CONNECTOR_CLASS = "HiddenStatesConnector"
FILE_TIMEOUT_S = 600.0  # a finished request's file must appear within this (the write is one small file)


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def resolve_backend(cfg) -> str:
    """extract.backend with auto resolved: vllm where it is installed, else hf."""
    backend = cfg.extract.backend
    if backend == "auto":
        backend = "vllm" if vllm_installed() else "hf"
    elif backend == "vllm" and not vllm_installed():
        raise ConfigError("extract.backend is 'vllm' but vLLM is not installed in this environment; "
                          "install it (scripts/setup.sh) or use --set extract.backend=hf")
    if backend == "vllm":
        check_vllm_version()  # its internals (the connector, the aux capture) change between releases
    return backend


def check_vllm_target(cfg, info) -> None:
    """What the vllm backend cannot capture, as a one-line error before any engine starts."""
    # DeepSeek-V2/V3 stacks (also Kimi-K2.x) compute aux = hidden + residual before layer idx, and the
    # residual is None before layer 0 (deepseek_v2.py), so id 0 fails inside vLLM.
    if 0 in info.aux_layer_ids and any(s in info.model_type for s in ("deepseek", "kimi")):
        raise ConfigError(f"target.aux_layer_ids {info.aux_layer_ids} includes 0, which vLLM's {info.model_type} stack "
                          f"cannot capture (no residual before layer 0); use ids >= 1, or --set extract.backend=hf")


def max_model_len(cfg, info) -> int:
    """The engine's max_model_len: a prompt of L tokens plus the one sampled token, room for the longest
    sample 01b can produce (tokenize.max_seq_len), within the target's max_position_embeddings."""
    max_pos = getattr(info.text_config, "max_position_embeddings", None)
    return min(int(max_pos) if max_pos else 1 << 30, cfg.tokenize.max_seq_len + 1)


def check_prompt_lengths(limit: int, lengths: Iterable[tuple[str, int]]) -> None:
    """Refuse a sample the engine cannot take ((sample id, tokens) pairs; limit: max_model_len - 1): 02 checks
    every sample when it plans (before --overwrite deletes anything), and each shard again before its requests."""
    for sample_id, n in lengths:
        if n > limit:
            raise ConfigError(f"sample '{sample_id}' has {n} tokens; the vllm backend runs at most {limit} "
                              f"(tokenize.max_seq_len); raise tokenize.max_seq_len")


NUDGE_S = 0.2  # interruptible(): how often a stopping main thread is nudged


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Ctrl-C stops the block even where vLLM swallows the KeyboardInterrupt: its engine start catches it
    in a zmq socket's context manager (vllm.utils.network_utils.zmq_socket_ctx) and then waits for the engine
    to be ready (minutes for a large target; issue 25, case 17). Once a stop signal came, the main thread is
    nudged with SIGUSR2 every NUDGE_S, whose handler raises KeyboardInterrupt again, until one gets out of
    the block. common.core.cli's relay (SIGUSR2 nudge, exit after a grace) stays in force around it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stopping, done = threading.Event(), threading.Event()
    main = threading.main_thread().ident

    def on_stop(signum, frame):
        stopping.set()
        raise KeyboardInterrupt

    def on_nudge(signum, frame):
        if stopping.is_set():
            raise KeyboardInterrupt

    def nudge() -> None:
        while not done.wait(NUDGE_S):
            if stopping.is_set():
                signal.pthread_kill(main, signal.SIGUSR2)

    previous = {sig: signal.signal(sig, handler) for sig, handler in ((signal.SIGINT, on_stop), (signal.SIGUSR2, on_nudge))}
    nudger = threading.Thread(target=nudge, name="interrupt-nudger", daemon=True)
    nudger.start()
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        done.set()



def kill_process_trees(pids: Iterable[int]) -> None:
    """SIGKILL these processes and their descendants: an interrupted engine start is abandoned, and vLLM's
    engine core finishes loading the target before it obeys the SIGTERM that vLLM and Python's exit send it
    (minutes for a large target), while the exit waits for it."""
    import psutil

    for pid in pids:
        try:
            root = psutil.Process(pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for proc in tree:
            try:
                proc.kill()
            except psutil.Error:
                pass


def rms_norm(x, weight, eps: float, out_dtype):
    """The final RMSNorm of Llama/Qwen3/DeepSeek-V3 (x * rsqrt(mean(x^2) + eps) * w), in fp32."""
    import torch

    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (x * weight.float()).to(out_dtype)


class VllmExtractor:
    """One vLLM engine on the target; `extract(samples)` returns per-sample {"aux", "final"} on CPU."""

    def __init__(self, cfg, info, out_dtype, requests_dir: Path, dp_rank: int = 0, dp_size: int = 1):
        """requests_dir: where the KV connector writes each finished request's states (Layout.vllm_requests)."""
        import torch

        from common.target.loading import load_target_tensors

        self.info = info
        self.out_dtype = out_dtype
        self.n_aux = len(info.aux_layer_ids)
        self.ids = list(info.aux_layer_ids) + [info.num_layers]
        self.dp_size = dp_size
        # The connector's per-request files, each removed as soon as it is read.
        self.requests_dir = requests_dir
        shutil.rmtree(requests_dir, ignore_errors=True)  # left by a killed run
        requests_dir.mkdir(parents=True)
        norm = load_target_tensors(cfg.target.model, kinds=("final_norm",))["final_norm"]
        self.norm_weight = norm.to(torch.float32)
        self.norm_eps = float(getattr(info.text_config, "rms_norm_eps", 1e-6))
        self.max_model_len = max_model_len(cfg, info)
        on_gpu = torch.cuda.is_available()
        if dp_size > 1:  # vLLM's offline data parallel: one engine per process, told its rank by env
            os.environ.update(VLLM_DP_RANK=str(dp_rank), VLLM_DP_RANK_LOCAL=str(dp_rank), VLLM_DP_SIZE=str(dp_size),
                              VLLM_DP_MASTER_IP=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                              VLLM_DP_MASTER_PORT=str(int(os.environ.get("MASTER_PORT", "29500")) + 1))
        if not on_gpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of host memory for the KV cache
            binding = cpu_thread_binding(cfg.extract.tensor_parallel_size)
            if binding:
                os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", binding)
        # The engine core must run in its own process: it writes a request's file one step after the
        # request finished, when our client loop may no longer be stepping it.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        from vllm import LLM

        log.info("starting vLLM on %s (ids %s, TP %d, DP %d, EP %s)", cfg.target.model, self.ids,
                 cfg.extract.tensor_parallel_size, dp_size, cfg.extract.enable_expert_parallel)
        before = {p.pid for p in multiprocessing.active_children()}
        try:
            with interruptible():  # Ctrl-C stops the start itself
                self.llm = LLM(
                    model=cfg.target.model,
                    dtype=cfg.target.dtype,
                    trust_remote_code=cfg.target.trust_remote_code,
                    skip_tokenizer_init=True,  # token ids in, states out
                    tensor_parallel_size=cfg.extract.tensor_parallel_size,
                    enable_expert_parallel=cfg.extract.enable_expert_parallel,
                    speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": self.ids}}},
                    kv_transfer_config={"kv_connector": CONNECTOR_CLASS, "kv_connector_module_path": CONNECTOR_MODULE,
                                        "kv_role": "kv_producer",
                                        "kv_connector_extra_config": {"shared_storage_path": str(requests_dir)}},
                    enable_prefix_caching=False,
                    language_model_only=True,  # text only: a multimodal target (Kimi-K2.5) loads no vision tower
                    max_model_len=self.max_model_len,
                    # without chunked prefill (the CPU default) a whole prompt must fit one step
                    max_num_batched_tokens=max(cfg.extract.batch_max_tokens, self.max_model_len),
                    gpu_memory_utilization=cfg.extract.gpu_memory_utilization or (0.9 if on_gpu else 0.3),
                    enforce_eager=not on_gpu,  # CPU: compiling costs minutes and gains little for prefill
                    attention_backend=cpu_attention_backend(cfg.target.model, cfg.target.dtype),
                    seed=0,
                )
        except Exception as e:
            shutil.rmtree(requests_dir, ignore_errors=True)
            raise PipelineError(f"vLLM could not start on target.model '{cfg.target.model}': {type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''}; see the log above, or use --set extract.backend=hf") from e
        except BaseException:  # interrupted: nothing of this start stays
            kill_process_trees(p.pid for p in multiprocessing.active_children() if p.pid not in before)
            shutil.rmtree(requests_dir, ignore_errors=True)
            raise
        self._next_id = 0

    def _params(self):
        from vllm import SamplingParams

        return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    def _load(self, path: str, num_tokens: int, sample_id: str) -> dict:
        from safetensors.torch import load_file

        states = load_file(path)["hidden_states"]  # [T, n_ids, H] in target.dtype
        os.unlink(path)
        if tuple(states.shape) != (num_tokens, len(self.ids), self.info.hidden_size):
            raise PipelineError(f"vLLM returned hidden states of shape {tuple(states.shape)} for sample '{sample_id}' "
                                f"({num_tokens} tokens, {len(self.ids)} ids, hidden {self.info.hidden_size})")
        aux = states[:, : self.n_aux].reshape(num_tokens, self.n_aux * self.info.hidden_size).to(self.out_dtype)
        final = rms_norm(states[:, self.n_aux], self.norm_weight, self.norm_eps, self.out_dtype)
        return {"aux": aux, "final": final}

    def extract(self, samples: list[dict], on_tokens: Callable[[int], None] = lambda n: None) -> list[dict]:
        """The states of every sample (in the given order), each {"aux": [T, n_aux*H], "final": [T, H]}."""
        from vllm.inputs import TokensPrompt

        engine = self.llm.llm_engine
        params = self._params()
        by_request: dict[str, int] = {}
        check_prompt_lengths(self.max_model_len - 1, ((s["id"], len(s["input_ids"])) for s in samples))
        for i, s in enumerate(samples):
            request_id = f"x{self._next_id}"
            self._next_id += 1
            by_request[request_id] = i
            engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(s["input_ids"])), params)
        results: list[dict | None] = [None] * len(samples)
        files: dict[int, str] = {}  # finished requests whose file we wait for

        def read_ready() -> None:
            for i, path in list(files.items()):
                if os.path.exists(path):
                    n = len(samples[i]["input_ids"])
                    results[i] = self._load(path, n, samples[i]["id"])
                    del files[i]
                    on_tokens(n)

        # One has_unfinished_requests per step, as LLM.generate does: with data parallel it is a
        # collective that every rank must call equally often.
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    params_out = out.kv_transfer_params or {}
                    if "hidden_states_path" not in params_out:
                        raise PipelineError(f"vLLM finished request {out.request_id} without hidden states "
                                            f"(kv_transfer_params {params_out}); is the KV connector loaded?")
                    files[by_request[out.request_id]] = params_out["hidden_states_path"]
            read_ready()
        # The engine core writes the last files in the steps after their requests finished.
        deadline = time.monotonic() + FILE_TIMEOUT_S
        while files:
            read_ready()
            if files and time.monotonic() > deadline:
                raise PipelineError(f"vLLM did not write the hidden states of {len(files)} finished requests within "
                                    f"{FILE_TIMEOUT_S:.0f} s (e.g. {next(iter(files.values()))}); see the engine log above")
            time.sleep(0.002)
        missing = [samples[i]["id"] for i, r in enumerate(results) if r is None]
        if missing:
            raise PipelineError(f"vLLM returned no hidden states for samples {missing[:5]}")
        return results  # type: ignore[return-value]

    def idle_round(self) -> None:
        """A dummy one-token request: data-parallel engines step together, so an idle rank joins in."""
        self.extract([{"id": "dp-idle", "input_ids": [0]}])

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 - best effort; the process exit stops it anyway
                pass
            self.llm = None
        shutil.rmtree(self.requests_dir, ignore_errors=True)
