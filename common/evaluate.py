"""Stage 05: measure the trained draft where it will be used, in vLLM.

How (the same counter-delta method as `vllm bench serve` and speculators' evaluate.py):
1. serve the target with the draft (speculative_config method eagle3, k draft tokens),
   send the held-out prompts (eval split of data/prompts.jsonl, chat template applied by
   the server), and scrape /metrics before and after. From the counter deltas:
       acceptance length      = 1 + accepted / drafts          (counts the bonus token)
       per-position rate[i]   = accepted_per_pos[i] / drafts
       draft acceptance rate  = accepted / draft_tokens
2. serve the target alone and send the same prompts with the same sampling: the output
   tokens/s without the draft, and the reference outputs. At temperature 0 the outputs must
   be identical with and without the draft (speculative decoding is lossless); mismatches are
   counted and listed in the report, never hidden.

The target-alone run ("baseline") is cached in eval/baseline.json under a key of everything it
depends on, so run_pipeline.py can take it on the generation server it already has running
(`05_evaluate.py --baseline-only --base-url URL`) and this stage starts one server instead of two.

Outputs under run_dir/eval/: report.json (atomic), report.png, outputs.jsonl (both outputs per
prompt), baseline.json.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from common.config import Config, api_key_from_env
from common.errors import DataError, PipelineError
from common.io import atomic_write_json, file_sha256, iter_jsonl, read_json, write_jsonl_atomic


REPORT_VERSION = 1


# ----------------------------------------------------------------------------- acceptance from counters


def acceptance_metrics(delta: dict, num_speculative_tokens: int) -> dict:
    """The report's acceptance numbers from a counter delta (common.vllm_server.metrics_delta).

    acceptance length = 1 + accepted / drafts; per-position rate[i] = accepted_per_pos[i] / drafts
    for i < k (positions vLLM never reported count as 0); draft acceptance rate = accepted / draft tokens.
    """
    drafts = delta["num_drafts"]
    if drafts <= 0:
        raise PipelineError(
            "vLLM recorded no speculative drafts during the evaluation (spec_decode_num_drafts did not move); "
            "check that the server runs with the draft (speculative_config) and that the prompts produced output"
        )
    if min(drafts, delta["num_draft_tokens"], delta["num_accepted_tokens"], *delta["num_accepted_tokens_per_pos"].values()) < 0:
        raise PipelineError("vLLM's spec-decode counters went down between two scrapes (did the server restart?); rerun 05_evaluate.py")
    per_pos = [float(delta["num_accepted_tokens_per_pos"].get(i, 0.0)) for i in range(num_speculative_tokens)]
    return {
        "acceptance_length": 1.0 + delta["num_accepted_tokens"] / drafts,
        "per_position_acceptance": [v / drafts for v in per_pos],
        "draft_acceptance_rate": delta["num_accepted_tokens"] / delta["num_draft_tokens"] if delta["num_draft_tokens"] else 0.0,
        "num_speculative_tokens": num_speculative_tokens,
        "counters": {
            "num_drafts": int(round(drafts)),
            "num_draft_tokens": int(round(delta["num_draft_tokens"])),
            "num_accepted_tokens": int(round(delta["num_accepted_tokens"])),
            "num_accepted_tokens_per_pos": [int(round(v)) for v in per_pos],
        },
    }


# ----------------------------------------------------------------------------- prompts and requests


def load_eval_prompts(cfg: Config) -> list[dict]:
    """The first evaluate.num_prompts prompts of the eval split, cut to their first user turn.

    Multi-turn prompts carry only user turns (01_prepare_data drops the assistant ones), so
    the first turn is the only one that can be sent without the target's own answers.
    """
    path = cfg.run_path / "data" / "prompts.jsonl"
    if not path.is_file():
        raise DataError(f"prompts file not found: {path}; run 01_prepare_data.py with the same config first")
    prompts = []
    for row in iter_jsonl(path):
        if row.get("split") != "eval":
            continue
        messages = []
        for m in row.get("messages") or []:
            if m.get("role") == "assistant":
                continue
            messages.append({"role": m["role"], "content": m["content"]})
            if m.get("role") == "user":
                break
        if messages and messages[-1]["role"] == "user":
            prompts.append({"id": row["id"], "messages": messages})
        if len(prompts) >= cfg.evaluate.num_prompts:
            break
    if not prompts:
        raise DataError(
            f"{path} has no eval-split prompts; set data.eval_fraction > 0 and rerun 01_prepare_data.py --overwrite"
        )
    return prompts


def _sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def draft_fingerprint(draft_dir: Path) -> str:
    """sha256 over the draft's weights files (model.safetensors, or every *.safetensors in order)."""
    files = [draft_dir / "model.safetensors"] if (draft_dir / "model.safetensors").is_file() else sorted(draft_dir.glob("*.safetensors"))
    if not files:
        raise PipelineError(f"no model.safetensors in the draft directory {draft_dir}; run 04_train.py first (it writes train/final/)")
    if len(files) == 1:
        return file_sha256(files[0])
    return _sha256_json([[f.name, file_sha256(f)] for f in files])


def sampling_params(cfg: Config) -> dict:
    e = cfg.evaluate
    return {"temperature": e.temperature, "max_tokens": e.max_tokens, "concurrency": e.concurrency,
            "enable_thinking": cfg.generate.enable_thinking}


def baseline_key(cfg: Config, prompts: list[dict]) -> dict:
    """Everything the target-alone run depends on (target, prompts, sampling, server settings)."""
    target_cfg = Path(cfg.target.model) / "config.json"
    return {
        "target": cfg.target.model,
        "target_config_sha256": file_sha256(target_cfg) if target_cfg.is_file() else None,
        "target_dtype": cfg.target.dtype,
        "prompts_sha256": _sha256_json([[p["id"], p["messages"]] for p in prompts]),
        "sampling": sampling_params(cfg),
        "server": asdict(cfg.server) | {"port": None},
    }


def report_key(cfg: Config, prompts: list[dict], draft_dir: Path, draft_sha: str) -> dict:
    return baseline_key(cfg, prompts) | {
        "draft": str(draft_dir),
        "draft_sha256": draft_sha,
        "num_speculative_tokens": cfg.evaluate.num_speculative_tokens,
    }


def make_client(cfg: Config, base_url: str):
    from openai import OpenAI

    for name in ("httpx", "httpx2"):  # one INFO line per request otherwise
        logging.getLogger(name).setLevel(logging.WARNING)

    # openai-python defaults to a 600 s timeout and 2 silent retries: set both explicitly.
    return OpenAI(base_url=base_url, api_key=api_key_from_env(cfg), timeout=cfg.generate.timeout_s, max_retries=2)


def served_model(client) -> str:
    models = [m.id for m in client.models.list().data]
    if not models:
        raise PipelineError("the vLLM server lists no models")
    return models[0]


def _chat(cfg: Config, client, model: str, messages: list[dict], max_tokens: int) -> dict:
    from common.generate import parse_completion

    extra_body = {}
    if cfg.generate.enable_thinking is not None:
        extra_body["chat_template_kwargs"] = {"enable_thinking": cfg.generate.enable_thinking}
    t0 = time.monotonic()
    resp = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=cfg.evaluate.temperature,
        extra_body=extra_body or None,
    )
    out = parse_completion(resp)
    out["latency_s"] = round(time.monotonic() - t0, 3)
    return out


def warm_up(cfg: Config, base_url: str, prompts: list[dict]) -> None:
    """One short request, so that the timed run does not pay for first-request setup.

    Call it before the first /metrics scrape: its drafts must not count.
    """
    client = make_client(cfg, base_url)
    _chat(cfg, client, cfg.generate.model or served_model(client), prompts[0]["messages"], 8)


def run_prompts(cfg: Config, base_url: str, prompts: list[dict], desc: str = "eval") -> dict:
    """Send every prompt (cfg.evaluate sampling, evaluate.concurrency in flight), timed.

    Returns {"model", "outputs": {id: {"reasoning", "content", "finish_reason", "usage", "latency_s"}},
    "wall_s", "output_tokens", "tokens_per_s"}.
    """
    import openai
    from tqdm import tqdm

    client = make_client(cfg, base_url)
    model = cfg.generate.model or served_model(client)
    outputs: dict[str, dict] = {}
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=cfg.evaluate.concurrency) as pool:
        futures = {pool.submit(_chat, cfg, client, model, p["messages"], cfg.evaluate.max_tokens): p["id"] for p in prompts}
        for fut in tqdm(as_completed(futures), total=len(futures), desc=desc, mininterval=1.0):
            try:
                outputs[futures[fut]] = fut.result()
            except openai.OpenAIError as e:
                raise PipelineError(
                    f"request for prompt {futures[fut]} to {base_url} failed ({type(e).__name__}: {' '.join(str(e).split())[:200]}); "
                    "see the vLLM server log under run_dir/logs/"
                ) from None
    wall = time.monotonic() - t0
    tokens = sum(int(o["usage"].get("completion_tokens", 0)) for o in outputs.values())
    return {
        "model": model,
        "outputs": {p["id"]: outputs[p["id"]] for p in prompts},
        "wall_s": round(wall, 3),
        "output_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 2) if wall > 0 else 0.0,
    }


def compare_outputs(with_draft: dict[str, dict], without_draft: dict[str, dict]) -> dict:
    """Count prompts whose outputs (reasoning + content + finish reason) agree exactly."""
    ids = [pid for pid in with_draft if pid in without_draft]
    mismatched = []
    for pid in ids:
        a, b = with_draft[pid], without_draft[pid]
        if (a.get("reasoning"), a.get("content")) != (b.get("reasoning"), b.get("content")):
            mismatched.append(pid)
    return {"compared": len(ids), "identical": len(ids) - len(mismatched), "mismatched_ids": mismatched}


def _first_difference(a: str, b: str) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def mismatch_examples(ids: list[str], with_draft: dict, without_draft: dict, limit: int = 5) -> list[dict]:
    """Where the first few mismatching outputs diverge, with some context."""
    examples = []
    for pid in ids[:limit]:
        a = (with_draft[pid].get("reasoning") or "") + "\n----\n" + (with_draft[pid].get("content") or "")
        b = (without_draft[pid].get("reasoning") or "") + "\n----\n" + (without_draft[pid].get("content") or "")
        i = _first_difference(a, b)
        examples.append({"id": pid, "first_difference_at_char": i,
                         "with_draft": a[max(0, i - 40): i + 80], "without_draft": b[max(0, i - 40): i + 80]})
    return examples


# ----------------------------------------------------------------------------- servers


def speculative_config(cfg: Config, draft_dir: Path) -> dict:
    return {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": cfg.evaluate.num_speculative_tokens}


def target_server(cfg: Config, speculative: Optional[dict] = None, log_path: Optional[Path] = None):
    """A VllmServer for cfg.target.model with the cfg.server settings (tensor parallel etc.).

    The target runs in target.dtype (float32 for the tiny default), the dtype 02 extracts the
    training features in, unless server.extra_args already sets --dtype.
    """
    from common.vllm_server import VllmServer

    extra = list(cfg.server.extra_args)
    if not any(a == "--dtype" or a.startswith("--dtype=") for a in extra):
        extra += ["--dtype", cfg.target.dtype]
    return VllmServer.from_config(cfg, speculative_config=speculative, log_path=log_path, extra_args=extra)


# ----------------------------------------------------------------------------- the stage


@dataclass
class EvalPaths:
    dir: Path
    report: Path
    plot: Path
    outputs: Path
    baseline: Path
    logs: Path

    @classmethod
    def of(cls, cfg: Config) -> "EvalPaths":
        d = cfg.run_path / "eval"
        return cls(d, d / "report.json", d / "report.png", d / "outputs.jsonl", d / "baseline.json", cfg.run_path / "logs")


def cached_baseline(cfg: Config, prompts: Optional[list[dict]] = None) -> Optional[dict]:
    """eval/baseline.json if it was measured with the current key, else None."""
    path = EvalPaths.of(cfg).baseline
    if not path.is_file():
        return None
    try:
        baseline = read_json(path)
    except DataError:
        return None
    prompts = prompts if prompts is not None else load_eval_prompts(cfg)
    return baseline if baseline.get("key") == baseline_key(cfg, prompts) else None


def measure_baseline(cfg: Config, base_url: str, prompts: list[dict]) -> dict:
    """Run the prompts on a server of the target alone and cache the result."""
    warm_up(cfg, base_url, prompts)
    run = run_prompts(cfg, base_url, prompts, desc="target alone")
    baseline = {"key": baseline_key(cfg, prompts), "created": time.time(), **run}
    atomic_write_json(EvalPaths.of(cfg).baseline, baseline)
    return baseline


def read_offline_report(cfg: Config) -> Optional[dict]:
    """The offline (teacher-forced) numbers 04_train.py wrote to train/eval_report.json.

    expected_acceptance_length is its tau at k = evaluate.num_speculative_tokens:
    1 + sum_{j=1..k} prod_{i<j} step_acc[i] (computed here if 04 did not report that k), and
    expected_per_position[i] = prod_{j<=i} step_acc[j].
    """
    path = cfg.run_path / "train" / "eval_report.json"
    if not path.is_file():
        return None
    try:
        rep = read_json(path)
    except DataError:
        return None
    k = cfg.evaluate.num_speculative_tokens
    acc = [float(a) for a in rep.get("step_acc") or []]
    # Draft position i is accepted only if positions 0..i are: expected rate = prod_{j<=i} acc_j,
    # the offline counterpart of vLLM's per-position rate.
    per_pos, prod = [], 1.0
    for a in acc[:k]:
        prod *= a
        per_pos.append(prod)
    tau = (rep.get("tau") or {}).get(str(k))
    if tau is None and len(per_pos) == k:
        tau = 1.0 + sum(per_pos)
    return {"path": str(path), "step": rep.get("step"), "loss": rep.get("loss"), "step_acc": acc,
            "expected_per_position": per_pos, "expected_acceptance_length": tau}


def format_summary(report: dict) -> str:
    per_pos = "/".join(f"{r:.2f}" for r in report["per_position_acceptance"])
    line = f"acceptance length {report['acceptance_length']:.2f} (k={report['num_speculative_tokens']}) | per-position {per_pos}"
    speedup = report["throughput"].get("speedup")
    if speedup is not None:
        line += f" | {speedup:.2f}x tokens/s"
    o = report["outputs"]
    line += f" | {o['identical']}/{o['compared']} outputs identical"
    offline = (report.get("offline") or {}).get("expected_acceptance_length")
    if isinstance(offline, (int, float)):
        line += f" | offline estimate {offline:.2f}"
    return line


def run_stage(cfg: Config, draft_dir: Optional[str] = None, overwrite: bool = False,
              baseline_only: bool = False, base_url: Optional[str] = None) -> int:
    paths = EvalPaths.of(cfg)
    prompts = load_eval_prompts(cfg)

    if baseline_only:
        # run_pipeline.py: measure the target alone on the server it already runs for 01b.
        if not base_url:
            raise PipelineError("--baseline-only needs --base-url of a running vLLM server of the target alone")
        if not overwrite and cached_baseline(cfg, prompts) is not None:
            print(f"05_evaluate: baseline already complete ({paths.baseline}); use --overwrite to redo")
            return 0
        b = measure_baseline(cfg, base_url, prompts)
        print(f"05_evaluate: baseline (target alone) {len(prompts)} prompts, {b['output_tokens']} tokens in {b['wall_s']:.1f}s "
              f"({b['tokens_per_s']:.1f} tok/s) -> {paths.baseline}")
        return 0

    draft = Path(draft_dir) if draft_dir else cfg.run_path / "train" / "final"
    if not (draft / "config.json").is_file():
        raise PipelineError(f"no trained draft at {draft} (config.json missing); run 04_train.py first or pass --draft DIR")
    draft_sha = draft_fingerprint(draft)
    key = report_key(cfg, prompts, draft, draft_sha)

    if overwrite:
        for p in (paths.report, paths.plot, paths.outputs, paths.baseline):
            p.unlink(missing_ok=True)
    elif paths.report.is_file():
        try:
            old = read_json(paths.report)
        except DataError:
            old = {}
        if old.get("complete") and old.get("key") == key:
            print(f"05_evaluate: already complete ({paths.report}): {format_summary(old)}; use --overwrite to redo")
            return 0

    k = cfg.evaluate.num_speculative_tokens
    # 1) target + draft
    from common.vllm_server import metrics_delta, scrape_metrics, spec_decode_metrics

    with target_server(cfg, speculative_config(cfg, draft), log_path=paths.logs / "vllm_eval_draft.log") as server:
        warm_up(cfg, server.base_url, prompts)
        before = spec_decode_metrics(scrape_metrics(server.base_url))
        with_draft = run_prompts(cfg, server.base_url, prompts, desc=f"target + draft (k={k})")
        after = spec_decode_metrics(scrape_metrics(server.base_url))
    acceptance = acceptance_metrics(metrics_delta(after, before), k)

    # 2) target alone (cached when run_pipeline measured it on the generation server)
    baseline = cached_baseline(cfg, prompts)
    if baseline is None:
        if base_url:
            baseline = measure_baseline(cfg, base_url, prompts)
        else:
            with target_server(cfg, None, log_path=paths.logs / "vllm_eval_target.log") as server:
                baseline = measure_baseline(cfg, server.base_url, prompts)

    comparison = compare_outputs(with_draft["outputs"], baseline["outputs"])
    greedy = cfg.evaluate.temperature == 0.0
    write_jsonl_atomic(paths.outputs, (
        {"id": p["id"], "messages": p["messages"], "with_draft": with_draft["outputs"][p["id"]],
         "without_draft": baseline["outputs"].get(p["id"]), "identical": p["id"] not in comparison["mismatched_ids"]}
        for p in prompts
    ))

    tps_with, tps_without = with_draft["tokens_per_s"], baseline["tokens_per_s"]
    report = {
        "version": REPORT_VERSION,
        "complete": True,
        "key": key,
        "draft": str(draft),
        "draft_sha256": draft_sha,
        "target": cfg.target.model,
        "num_prompts": len(prompts),
        "sampling": sampling_params(cfg),
        **acceptance,
        "offline": read_offline_report(cfg),
        "throughput": {
            "with_draft": {k_: with_draft[k_] for k_ in ("output_tokens", "wall_s", "tokens_per_s")},
            "without_draft": {k_: baseline[k_] for k_ in ("output_tokens", "wall_s", "tokens_per_s")},
            "speedup": round(tps_with / tps_without, 4) if tps_without else None,
        },
        "outputs": {
            **comparison,
            "greedy": greedy,
            # At temperature 0 speculative decoding must not change the text.
            "all_identical": comparison["identical"] == comparison["compared"],
            "mismatch_examples": mismatch_examples(comparison["mismatched_ids"], with_draft["outputs"], baseline["outputs"]),
        },
        "files": {"report": str(paths.report), "plot": str(paths.plot), "outputs": str(paths.outputs),
                  "baseline": str(paths.baseline)},
        "created": time.time(),
    }

    from common.plots import plot_report

    plot_report(report, cfg.run_path / "train" / "metrics.jsonl", paths.plot)
    atomic_write_json(paths.report, report)
    if greedy and comparison["identical"] != comparison["compared"]:
        print(f"05_evaluate: WARNING: at temperature 0, {len(comparison['mismatched_ids'])} of {comparison['compared']} outputs "
              f"differ with and without the draft (see 'mismatch_examples' in {paths.report})", file=sys.stderr)
    print(f"05_evaluate: {format_summary(report)} -> {paths.report}")
    return 0
