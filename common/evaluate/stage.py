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

Each prompt set is measured between its own pair of scrapes: the held-out prompts (the headline
numbers, at the top level of the report), and every set of evaluate.prompt_sets and
evaluate.other_prompts (the set named "other"): benchmark prompts, or prompts of another kind than
the training data (report["prompt_sets"][name]; common.evaluate.prompt_sets reads them). One summary
line per set.

The offline prediction (report["offline"]) is 04's replay of vLLM's rounds over the eval split
(common.model.acceptance), with its relative error against the measured acceptance length. With
evaluate.replay_served, report["replay_on_served"] replays the rounds over the exact token ids vLLM
served for the held-out prompts: the same text on both sides, so it checks the replay itself.

The target-alone run ("baseline") is cached per set in eval/baseline.json (eval/baseline-NAME.json)
under a key of everything it depends on, so run_pipeline.py can take it on the generation server it
already has running (`05_evaluate.py --baseline-only --base-url URL`) and this stage starts one
server instead of two.

`--compare DIR_A DIR_B` measures two drafts with the same server settings on the same prompts (every
set; one server per draft, the target-alone baselines shared) and writes them side by side under
eval/compare/: report.json ({"acceptance_length": {set: {"a", "b", "b_minus_a"}}, "reports": {"a", "b"}:
each draft's report as a plain run writes it}), report.png and the outputs. eval/report.json is left as is.

Requests go through common.serving.chat, 01b's client and request body: generate.extra_body and
generate.enable_thinking reach 05's requests as they reach 01b's.

Outputs under run_dir/eval/: report.json (atomic), report.png, outputs.jsonl and outputs-NAME.jsonl
(both outputs per prompt), baseline.json, baseline-NAME.json; eval/compare/ (--compare).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from common.core.config import Config
from common.core.errors import DataError, PipelineError
from common.core.io import atomic_write_json, file_sha256, iter_jsonl, read_json, write_jsonl_atomic
from common.core.run_folder import HELD_OUT, OTHER, Layout, StageManifest, content_fingerprint
from common.evaluate.prompt_sets import PromptSet, load_prompt_set, load_prompt_sets
from common.serving.chat import chat_request, make_client, parse_completion, served_model


REPORT_VERSION = 1


# ----------------------------------------------------------------------------- acceptance from counters


def acceptance_metrics(delta: dict, num_speculative_tokens: int) -> dict:
    """The report's acceptance numbers from a counter delta (common.serving.vllm_server.metrics_delta).

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


# ----------------------------------------------------------------------------- drafts, keys and requests


def _sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def prompts_sha256(prompts: list[dict]) -> str:
    return _sha256_json([[p["id"], p["messages"]] for p in prompts])


def draft_fingerprint(draft_dir: Path, layout: Optional[Layout] = None) -> str:
    """sha256 over the draft's weights files (model.safetensors, or every *.safetensors in order).
    With the run's layout, each file's hash is cached in its stages/hashes.json (a Kimi-sized draft is GBs)."""
    from common.model.export import WEIGHTS_NAME  # imports torch: only when needed

    draft_dir = Path(draft_dir)
    files = [draft_dir / WEIGHTS_NAME] if (draft_dir / WEIGHTS_NAME).is_file() else sorted(draft_dir.glob("*.safetensors"))
    if not files:
        raise PipelineError(f"no model.safetensors in the draft directory {draft_dir}; run 04_train.py first (it writes train/final/)")
    sha = file_sha256 if layout is None else (lambda f: content_fingerprint(layout, f))
    if len(files) == 1:
        return sha(files[0])
    return _sha256_json([[f.name, sha(f)] for f in files])


def report_measures(cfg: Config, report: dict, draft_dir: Path) -> bool:
    """Whether a 05 report measured the draft now in draft_dir: the same weights, whatever its path."""
    try:
        return report.get("draft_sha256") == draft_fingerprint(draft_dir, Layout.of(cfg))
    except PipelineError:  # no draft there (any more)
        return False


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
        "prompts_sha256": prompts_sha256(prompts),
        "sampling": sampling_params(cfg),
        "server": asdict(cfg.server) | {"port": None},
        # Every request carries generate.extra_body (common.serving.chat); keys made without one stay valid.
        **({"extra_body": cfg.generate.extra_body} if cfg.generate.extra_body else {}),
    }


def report_key(cfg: Config, sets: dict[str, PromptSet], draft_dir: Path, draft_sha: str, foreign_draft: bool = False) -> dict:
    named = {name: prompts_sha256(s.prompts) for name, s in sets.items() if name not in (HELD_OUT, OTHER)}
    return baseline_key(cfg, sets[HELD_OUT].prompts) | {
        "draft": str(draft_dir),
        "draft_sha256": draft_sha,
        "num_speculative_tokens": cfg.evaluate.num_speculative_tokens,
        "other_prompts_sha256": prompts_sha256(sets[OTHER].prompts) if OTHER in sets else None,
        "replay_served": cfg.evaluate.replay_served,
        # reported without this run's prediction; keys made before the flag (or evaluate.prompt_sets) stay valid
        **({"foreign_draft": True} if foreign_draft else {}),
        **({"prompt_sets_sha256": named} if named else {}),
    }


def eval_client(cfg: Config, base_url: str):
    """A blocking client of common.serving.chat for evaluate.concurrency threads, with openai-python's
    2 retries (a timed measurement has no retry accounting of its own)."""
    for name in ("httpx", "httpx2"):  # one INFO line per request otherwise
        logging.getLogger(name).setLevel(logging.WARNING)
    return make_client(cfg.generate, base_url, connections=cfg.evaluate.concurrency, blocking=True, max_retries=2)


def _chat(cfg: Config, client, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One request of common.serving.chat's: evaluate.temperature, generate.extra_body and
    enable_thinking, and (evaluate.replay_served) the exact token ids the replay on the served outputs needs."""
    t0 = time.monotonic()
    resp = client.chat.completions.create(**chat_request(
        cfg.generate, model, messages, max_tokens=max_tokens, temperature=cfg.evaluate.temperature,
        return_token_ids=cfg.evaluate.replay_served))
    out = parse_completion(resp)
    out["latency_s"] = round(time.monotonic() - t0, 3)
    return out


def warm_up(cfg: Config, base_url: str, prompts: list[dict]) -> None:
    """One short request, so that the timed run does not pay for first-request setup.

    Call it before the first /metrics scrape: its drafts must not count.
    """
    import openai

    client = eval_client(cfg, base_url)
    try:
        _chat(cfg, client, cfg.generate.model or served_model(client), prompts[0]["messages"], 8)
    except openai.OpenAIError as e:  # the engine died on its first request (out of memory, a bad draft, ...)
        raise PipelineError(f"the vLLM server at {base_url} failed its warm-up request ({type(e).__name__}: "
                            f"{' '.join(str(e).split())[:200]}); it may have died: see its log under run_dir/logs/") from None


def run_prompts(cfg: Config, base_url: str, prompts: list[dict], desc: str = "eval") -> dict:
    """Send every prompt (cfg.evaluate sampling, evaluate.concurrency in flight), timed.

    Returns {"model", "outputs": {id: {"reasoning", "content", "finish_reason", "usage", "latency_s"}},
    "wall_s", "output_tokens", "tokens_per_s"}.
    """
    import openai
    from tqdm import tqdm

    client = eval_client(cfg, base_url)
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
    training features in, unless server.extra_args already sets --dtype; on CPU a float32 MLA
    target gets the attention backend that runs it (cpu_attention_backend).
    """
    from common.serving.vllm_server import VllmServer, cpu_attention_backend

    extra = list(cfg.server.extra_args)
    given = lambda flag: any(a == flag or a.startswith(flag + "=") for a in extra)  # noqa: E731
    if not given("--dtype"):
        extra += ["--dtype", cfg.target.dtype]
    backend = cpu_attention_backend(cfg.target.model, cfg.target.dtype)
    if backend and not given("--attention-backend"):
        extra += ["--attention-backend", backend]
    return VllmServer.from_config(cfg, speculative_config=speculative, log_path=log_path, extra_args=extra)


# ----------------------------------------------------------------------------- the stage


def cached_baseline(cfg: Config, prompts: Optional[list[dict]] = None, prompt_set: str = HELD_OUT) -> Optional[dict]:
    """The target-alone run of a prompt set (eval/baseline.json, eval/baseline-NAME.json) if it was
    measured with the current key, else None."""
    path = Layout.of(cfg).baseline_of(prompt_set)
    if not path.is_file():
        return None
    try:
        baseline = read_json(path)
    except DataError:
        return None
    if prompts is None:
        prompts = load_prompt_set(cfg, prompt_set).prompts
    return baseline if prompts and baseline.get("key") == baseline_key(cfg, prompts) else None


def missing_baselines(cfg: Config) -> list[str]:
    """The prompt sets whose target-alone run is not cached yet."""
    return [name for name, s in load_prompt_sets(cfg).items() if cached_baseline(cfg, s.prompts, name) is None]


def measure_baseline(cfg: Config, base_url: str, prompts: list[dict], prompt_set: str = HELD_OUT) -> dict:
    """Run the prompts on a server of the target alone and cache the result."""
    warm_up(cfg, base_url, prompts)
    run = run_prompts(cfg, base_url, prompts, desc="target alone" + ("" if prompt_set == HELD_OUT else f" ({prompt_set})"))
    baseline = {"key": baseline_key(cfg, prompts), "created": time.time(), **run}
    atomic_write_json(Layout.of(cfg).baseline_of(prompt_set), baseline)
    return baseline


def run_aux_layer_ids(cfg: Config) -> tuple[Optional[list[int]], str]:
    """The aux layer ids this run's draft reads, and where they come from: what 02 extracted
    (hidden/index.json), else target.aux_layer_ids when set, else (None, "")."""
    index = Layout.of(cfg).hidden_index
    if index.is_file():
        doc = read_json(index)
        ids = doc.get("aux_layer_ids") if isinstance(doc, dict) else None
        if isinstance(ids, list):
            return [int(i) for i in ids], str(index)
    if cfg.target.aux_layer_ids:
        return list(cfg.target.aux_layer_ids), "target.aux_layer_ids"
    return None, ""


def check_draft(cfg: Config, draft: Path, foreign_draft: bool) -> None:
    """The draft's config.json read and checked by us before vLLM sees it (a truncated file is one error
    line, not vLLM's traceback), and its aux layer ids against this run's: vLLM captures the layers the
    draft's config names, so a draft trained on other layers is another run's, and this run's
    prediction says nothing about it."""
    from common.model.export import read_draft_config

    ids = read_draft_config(draft).aux_layer_ids
    run_ids, source = run_aux_layer_ids(cfg)
    if run_ids is not None and ids != run_ids and not foreign_draft:
        raise DataError(
            f"the draft {draft} reads the target's aux layers {ids} (eagle_aux_hidden_state_layer_ids in its config.json) "
            f"but this run extracted {run_ids} ({source}): it is not this run's draft; evaluate this run's train/final "
            f"(drop --draft), or pass --foreign-draft to measure it anyway (reported without this run's offline prediction)")


def eval_at_step(layout: Layout, step: int) -> tuple[Optional[dict], Path]:
    """04's eval at `step` and the file it is in: train/eval_report.json when it is that step's (the
    latest eval), else the eval line of train/metrics.jsonl (04 logs every eval there, in full)."""
    try:
        latest = read_json(layout.train_eval_report) if layout.train_eval_report.is_file() else None
    except DataError:
        latest = None
    if isinstance(latest, dict) and latest.get("step") == step:
        return latest, layout.train_eval_report
    if not layout.metrics.is_file():
        return None, layout.metrics
    found = None
    for row in iter_jsonl(layout.metrics, tolerate_torn_tail=True, strict=False):
        if row.get("type") == "eval" and row.get("step") == step:
            found = row  # the last one: a resumed run logs the steps after its checkpoint again
    return found, layout.metrics


def offline_prediction(cfg: Config, draft: Path, draft_sha: str) -> tuple[Optional[dict], Optional[str]]:
    """04's offline prediction for this very draft, or (None, why there is none).

    The draft is found among this run's exports by its weights (train/final, train/best, at any path),
    its step read from that export (training_summary.json, best.json), and the prediction is 04's eval
    at that step: `--draft RUN/train/best` is compared with the best checkpoint's prediction, never the
    final draft's.
    """
    layout = Layout.of(cfg)
    exports = layout.export_records
    same = [d for d in exports if d.resolve() == draft.resolve()]  # the very files: nothing to compare

    def same_weights(d: Path) -> bool:
        try:
            return draft_fingerprint(d, layout) == draft_sha
        except PipelineError:  # no export there
            return False

    export = same[0] if same else next((d for d in exports if same_weights(d)), None)
    if export is None:
        return None, f"{draft} has other weights than this run's train/final and train/best: 04 predicted nothing for it"
    try:
        record = read_json(export / exports[export])
    except DataError as e:
        return None, f"cannot tell which step {export} is ({e})"
    step = record.get("step") if isinstance(record, dict) else None
    if not isinstance(step, int):
        return None, f"{export / exports[export]} records no step: cannot tell which eval predicts it"
    rep, path = eval_at_step(layout, step)
    if rep is None:
        return None, f"04 logged no eval at step {step}, the step of {export} ({path})"
    return offline_report(cfg, rep, path, export), None


def offline_report(cfg: Config, rep: dict, path: Path, export: Path) -> dict:
    """The offline prediction of vLLM's numbers from 04's eval at the draft's step.

    At k = evaluate.num_speculative_tokens: expected_acceptance_length and expected_per_position
    are the replay of vLLM's rounds (common.model.acceptance) when 04 reported it ("prediction": "replay"),
    else the product formula 1 + sum_j prod_{i<=j} step_acc[i]; "product_formula" always has the latter.
    """
    from common.model.acceptance import product_formula, product_per_position

    k = cfg.evaluate.num_speculative_tokens
    acc = [float(a) for a in rep.get("step_acc") or []]
    tau = (rep.get("tau") or {}).get(str(k))
    if tau is None and len(acc) >= k:
        tau = product_formula(acc, k)
    product = {"acceptance_length": tau, "per_position": product_per_position(acc, k)}
    replay = (rep.get("replay") or {}).get(str(k))
    out = {"path": str(path), "draft": str(export), "step": rep.get("step"), "loss": rep.get("loss"), "step_acc": acc,
           "product_formula": product}
    if replay:
        return out | {"prediction": "replay", "expected_acceptance_length": replay["acceptance_length"],
                      "expected_per_position": replay["per_position"], "replay_rounds": replay["rounds"]}
    return out | {"prediction": "product formula", "expected_acceptance_length": tau,
                  "expected_per_position": product["per_position"]}


def prediction_error(report: dict) -> Optional[float]:
    """(offline prediction - vLLM measured) / measured, for the held-out prompts."""
    predicted = (report.get("offline") or {}).get("expected_acceptance_length")
    measured = report.get("acceptance_length")
    if isinstance(predicted, (int, float)) and isinstance(measured, (int, float)) and measured > 0:
        return (predicted - measured) / measured
    return None


def measured_sets(report: dict) -> dict[str, dict]:
    """The report's prompt sets besides the held-out one (a report written before evaluate.prompt_sets: its other_prompts)."""
    if "prompt_sets" in report:
        return report["prompt_sets"] or {}
    return {OTHER: report["other_prompts"]} if report.get("other_prompts") else {}


def set_summary(part: dict) -> str:
    """One prompt set's numbers: acceptance length, per-position acceptance, tokens/s speedup, identical outputs."""
    per_pos = "/".join(f"{r:.2f}" for r in part["per_position_acceptance"])
    line = f"acceptance length {part['acceptance_length']:.2f} (k={part['num_speculative_tokens']}) | per-position {per_pos}"
    speedup = part["throughput"].get("speedup")
    if speedup is not None:
        line += f" | {speedup:.2f}x tokens/s"
    o = part["outputs"]
    return line + f" | {o['identical']}/{o['compared']} outputs identical"


def summary_lines(report: dict) -> list[str]:
    """The held-out set's line (with the offline prediction), then one line per prompt set."""
    line = set_summary(report)
    offline = report.get("offline") or {}
    if isinstance(offline.get("expected_acceptance_length"), (int, float)):
        line += f" | offline {offline.get('prediction', 'estimate')} {offline['expected_acceptance_length']:.2f}"
        error = prediction_error(report)
        if error is not None:
            line += f" ({100 * error:+.1f}%)"
    elif report.get("offline_missing"):
        line += f" | no offline prediction for this draft ({report['offline_missing']})"
    served = report.get("replay_on_served")
    if served:
        line += f" | replay on the served outputs {served['acceptance_length']:.2f} ({100 * served['relative_error']:+.1f}%)"
    lines = [line]
    for name, part in measured_sets(report).items():
        skipped = sum((part.get("rows_skipped") or {}).values())
        lines.append(f"prompt set {name} ({part['num_prompts']} prompts{f', {skipped} rows skipped' if skipped else ''}): "
                     f"{set_summary(part)}")
    return lines


def _set_results(cfg: Config, prompts: list[dict], with_draft: dict, acceptance: dict, baseline: dict,
                 outputs_path: Path) -> dict:
    """One prompt set's part of the report: acceptance, throughput, outputs with vs without the draft."""
    comparison = compare_outputs(with_draft["outputs"], baseline["outputs"])
    write_jsonl_atomic(outputs_path, (
        {"id": p["id"], "messages": p["messages"], "with_draft": with_draft["outputs"][p["id"]],
         "without_draft": baseline["outputs"].get(p["id"]), "identical": p["id"] not in comparison["mismatched_ids"]}
        for p in prompts
    ))
    tps_with, tps_without = with_draft["tokens_per_s"], baseline["tokens_per_s"]
    return {
        "num_prompts": len(prompts),
        **acceptance,
        "throughput": {
            "with_draft": {k_: with_draft[k_] for k_ in ("output_tokens", "wall_s", "tokens_per_s")},
            "without_draft": {k_: baseline[k_] for k_ in ("output_tokens", "wall_s", "tokens_per_s")},
            "speedup": round(tps_with / tps_without, 4) if tps_without else None,
        },
        "outputs": {
            **comparison,
            "greedy": cfg.evaluate.temperature == 0.0,
            # At temperature 0 speculative decoding must not change the text.
            "all_identical": comparison["identical"] == comparison["compared"],
            "mismatch_examples": mismatch_examples(comparison["mismatched_ids"], with_draft["outputs"], baseline["outputs"]),
        },
    }


def replay_on_served(cfg: Config, draft: Path, prompts: list[dict], outputs: dict, measured: dict) -> dict:
    """The replay over the very token sequences vLLM generated (evaluate.replay_served): with the same
    text on both sides, what is left between it and vLLM's counters is the replay's own error."""
    from common.evaluate.replay import replay_on_token_ids

    missing = [p["id"] for p in prompts if not outputs[p["id"]].get("completion_token_ids")
               or not outputs[p["id"]].get("prompt_token_ids")]
    if missing:
        raise PipelineError(f"vLLM returned no token ids for {len(missing)} prompt(s) (first: {missing[0]}); "
                            f"evaluate.replay_served needs vLLM >= 0.10 (return_token_ids), or set it to false")
    sequences = [(outputs[p["id"]]["prompt_token_ids"], outputs[p["id"]]["completion_token_ids"]) for p in prompts]
    result = replay_on_token_ids(cfg, draft, sequences, cfg.evaluate.num_speculative_tokens)
    result["relative_error"] = (result["acceptance_length"] - measured["acceptance_length"]) / measured["acceptance_length"]
    return result


def run_stage(cfg: Config, draft_dir: Optional[str] = None, overwrite: bool = False, baseline_only: bool = False,
              base_url: Optional[str] = None, foreign_draft: bool = False, compare: Optional[list[str]] = None) -> int:
    layout = Layout.of(cfg)
    sets = load_prompt_sets(cfg)
    if baseline_only:
        return run_baseline_only(cfg, layout, sets, base_url, overwrite)
    if compare:
        return run_compare(cfg, layout, sets, compare, overwrite, base_url, foreign_draft)
    # Every check comes before --overwrite deletes the previous eval/ outputs: a refusal loses nothing.
    draft, draft_sha, offline = checked_draft(cfg, layout, draft_dir, foreign_draft)
    key = report_key(cfg, sets, draft, draft_sha, foreign_draft)
    if overwrite:
        for p in layout.evaluate_outputs(sets):
            p.unlink(missing_ok=True)
    manifest = stage_manifest(cfg, key)
    if manifest.begin(overwrite, outputs=[layout.eval_report]) == "complete":
        manifest.record("already_complete")
        print_lines(summary_lines(read_json(layout.eval_report)), f"already complete ({layout.eval_report}): ", "; use --overwrite to redo")
        return 0
    with_draft, acceptance = measure_with_draft(cfg, layout, sets, draft)
    baselines = measure_or_reuse_baselines(cfg, layout, sets, base_url)
    files = ReportFiles(layout.eval_report, layout.eval_plot, layout.eval_outputs_of)
    report = build_report(cfg, layout, sets, draft, draft_sha, key, with_draft, acceptance, baselines, offline, files)
    write_report(layout, report, files)
    manifest.complete({"acceptance_length": report.get("acceptance_length")})
    print_lines(summary_lines(report), "", f" -> {layout.eval_report}")
    return 0


def print_lines(lines: list[str], before: str, after: str) -> None:
    """05's summary: the first line with `before` and `after` around it, then one line per prompt set."""
    print(f"05_evaluate: {before}{lines[0]}{after}")
    for line in lines[1:]:
        print(f"05_evaluate: {line}")


def run_baseline_only(cfg: Config, layout: Layout, sets: dict[str, PromptSet], base_url: Optional[str], overwrite: bool) -> int:
    """run_pipeline.py: measure the target alone on the server it already runs for 01b."""
    if not base_url:
        raise PipelineError("--baseline-only needs --base-url of a running vLLM server of the target alone")
    todo = [name for name in sets if overwrite or cached_baseline(cfg, sets[name].prompts, name) is None]
    record = StageManifest(layout, "05_baseline").record  # what run_pipeline reports
    if not todo:
        print(f"05_evaluate: baseline already complete ({layout.baseline}); use --overwrite to redo")
        record("already_complete")
        return 0
    for name in todo:
        b = measure_baseline(cfg, base_url, sets[name].prompts, name)
        print(f"05_evaluate: baseline (target alone, {name} prompts) {len(sets[name].prompts)} prompts, {b['output_tokens']} "
              f"tokens in {b['wall_s']:.1f}s ({b['tokens_per_s']:.1f} tok/s)")
    record("done")
    return 0


def find_draft(cfg: Config, draft_dir: Optional[str]) -> Path:
    draft = Path(draft_dir) if draft_dir else Layout.of(cfg).final
    from common.model.export import CONFIG_NAME

    if not (draft / CONFIG_NAME).is_file():
        raise PipelineError(f"no trained draft at {draft} (config.json missing); run 04_train.py first or pass --draft DIR")
    return draft


def checked_draft(cfg: Config, layout: Layout, draft_dir: Optional[str], foreign_draft: bool
                  ) -> tuple[Path, str, tuple[Optional[dict], Optional[str]]]:
    """The draft to measure (checked: check_draft), the fingerprint of its weights, and 04's prediction for it
    (offline_prediction; none for --foreign-draft)."""
    draft = find_draft(cfg, draft_dir)
    check_draft(cfg, draft, foreign_draft)
    draft_sha = draft_fingerprint(draft, layout)
    offline = (None, "--foreign-draft: not this run's draft") if foreign_draft else offline_prediction(cfg, draft, draft_sha)
    return draft, draft_sha, offline


def measure_with_draft(cfg: Config, layout: Layout, sets: dict[str, PromptSet], draft: Path,
                       log_name: str = "vllm_eval_draft") -> tuple[dict, dict]:
    """Target + draft: each prompt set between its own pair of /metrics scrapes. Returns (runs, acceptance) per set."""
    from common.serving.vllm_server import metrics_delta, scrape_metrics, spec_decode_metrics

    k = cfg.evaluate.num_speculative_tokens
    with_draft, acceptance = {}, {}
    with target_server(cfg, speculative_config(cfg, draft), log_path=layout.log(log_name)) as server:
        warm_up(cfg, server.base_url, sets[HELD_OUT].prompts)
        for name, prompt_set in sets.items():
            before = spec_decode_metrics(scrape_metrics(server.base_url))
            with_draft[name] = run_prompts(cfg, server.base_url, prompt_set.prompts, desc=f"target + draft (k={k}, {name})")
            after = spec_decode_metrics(scrape_metrics(server.base_url))
            acceptance[name] = acceptance_metrics(metrics_delta(after, before), k)
    return with_draft, acceptance


def measure_or_reuse_baselines(cfg: Config, layout: Layout, sets: dict[str, PromptSet], base_url: Optional[str]) -> dict:
    """Target alone, per set: cached when run_pipeline measured it on the generation server."""
    baselines = {name: cached_baseline(cfg, prompt_set.prompts, name) for name, prompt_set in sets.items()}
    if any(b is None for b in baselines.values()):
        with (contextlib.nullcontext(None) if base_url else
              target_server(cfg, None, log_path=layout.log("vllm_eval_target"))) as server:
            for name, b in baselines.items():
                if b is None:
                    baselines[name] = measure_baseline(cfg, base_url or server.base_url, sets[name].prompts, name)
    return baselines


@dataclass(frozen=True)
class ReportFiles:
    """Where one draft's measurement is written: eval/ for a plain run, eval/compare/ for each draft of --compare."""

    report: Path
    plot: Path
    outputs_of: Callable[[str], Path]  # a prompt set's outputs with and without the draft


def build_report(cfg: Config, layout: Layout, sets: dict[str, PromptSet], draft: Path, draft_sha: str, key: dict,
                 with_draft: dict, acceptance: dict, baselines: dict, offline: tuple[Optional[dict], Optional[str]],
                 files: ReportFiles) -> dict:
    """offline: (04's prediction for this draft, or None and why there is none: offline_prediction)."""
    results = {name: _set_results(cfg, s.prompts, with_draft[name], acceptance[name], baselines[name], files.outputs_of(name))
               for name, s in sets.items()}
    prompt_sets = {name: {**s.describe(), **results[name],
                          "files": {"outputs": str(files.outputs_of(name)), "baseline": str(layout.baseline_of(name))}}
                   for name, s in sets.items() if name != HELD_OUT}
    report = {
        "version": REPORT_VERSION,
        "complete": True,
        "key": key,
        "draft": str(draft),
        "draft_sha256": draft_sha,
        "target": cfg.target.model,
        "sampling": sampling_params(cfg),
        **results[HELD_OUT],  # the held-out prompts: the headline numbers
        "offline": offline[0],
        "offline_missing": offline[1],
        "prompt_sets": prompt_sets,
        # the name of evaluate.other_prompts' section before evaluate.prompt_sets, kept: the same as prompt_sets.other
        "other_prompts": {"path": sets[OTHER].source, **prompt_sets[OTHER]} if OTHER in sets else None,
        "files": {"report": str(files.report), "plot": str(files.plot), "outputs": str(files.outputs_of(HELD_OUT)),
                  "baseline": str(layout.baseline)},
        "created": time.time(),
    }
    report["offline_prediction_error"] = prediction_error(report)
    if cfg.evaluate.replay_served:
        report["replay_on_served"] = replay_on_served(cfg, draft, sets[HELD_OUT].prompts, with_draft[HELD_OUT]["outputs"],
                                                      acceptance[HELD_OUT])
    return report


def write_report(layout: Layout, report: dict, files: ReportFiles) -> None:
    """The plot, then report.json."""
    from common.evaluate.plots import plot_report

    plot_report(report, layout.metrics, files.plot)
    atomic_write_json(files.report, report)
    warn_mismatches(report, files.report)


def warn_mismatches(report: dict, path: Path) -> None:
    """A warning per prompt set whose greedy outputs differ with and without the draft."""
    for name, part in ((HELD_OUT, report), *measured_sets(report).items()):
        o = part["outputs"]
        if o["greedy"] and o["identical"] != o["compared"]:
            print(f"05_evaluate: WARNING: at temperature 0, {len(o['mismatched_ids'])} of {o['compared']} outputs ({name} "
                  f"prompts, draft {report['draft']}) differ with and without the draft (see 'mismatch_examples' in {path})",
                  file=sys.stderr)


def stage_manifest(cfg: Config, key: dict, stage: str = "05_evaluate"):
    """05's record (common.core.run_folder): everything the measurement depends on (report_key). A
    measurement is replaced whole, so any change means "measure again", not an error: also an entry only
    one of the two keys has (extra_body, foreign_draft)."""
    manifest = StageManifest(Layout.of(cfg), stage, settings=key)
    manifest.redo_on = set(key) | set((manifest.previous or {}).get("settings") or {})
    return manifest


# ----------------------------------------------------------------------------- --compare DIR_A DIR_B


COMPARED = ("a", "b")  # the two drafts of --compare, in the order given


def compare_files(layout: Layout) -> dict[str, ReportFiles]:
    """eval/compare/: one report.json and report.png for both drafts, outputs-a-SET.jsonl and outputs-b-SET.jsonl."""
    return {label: ReportFiles(layout.compare_report, layout.compare_plot, lambda name, label=label: layout.compare_outputs_of(label, name))
            for label in COMPARED}


def run_compare(cfg: Config, layout: Layout, sets: dict[str, PromptSet], dirs: list[str], overwrite: bool,
                base_url: Optional[str], foreign_draft: bool) -> int:
    """Two drafts with the same server settings on the same prompts (every set), side by side in eval/compare/."""
    drafts = {label: checked_draft(cfg, layout, d, foreign_draft) for label, d in zip(COMPARED, dirs)}
    keys = {label: report_key(cfg, sets, draft, sha, foreign_draft) for label, (draft, sha, _) in drafts.items()}
    files = compare_files(layout)
    path = files["a"].report
    if overwrite:  # after every check: a refusal loses nothing
        for p in [path, files["a"].plot, *(f.outputs_of(n) for f in files.values() for n in sets), *map(layout.baseline_of, sets)]:
            p.unlink(missing_ok=True)
    manifest = stage_manifest(cfg, keys, "05_compare")
    if manifest.begin(overwrite, outputs=[path]) == "complete":
        manifest.record("already_complete")
        print_lines(compare_lines(read_json(path)), f"already complete ({path}): ", "; use --overwrite to redo")
        return 0
    measured = {label: measure_with_draft(cfg, layout, sets, draft, f"vllm_compare_{label}") for label, (draft, _, _) in drafts.items()}
    baselines = measure_or_reuse_baselines(cfg, layout, sets, base_url)
    reports = {label: build_report(cfg, layout, sets, draft, sha, keys[label], *measured[label], baselines, offline, files[label])
               for label, (draft, sha, offline) in drafts.items()}
    comparison = compare_report(cfg, sets, reports, keys, files)
    from common.evaluate.plots import plot_compare

    plot_compare(comparison, files["a"].plot)
    atomic_write_json(path, comparison)
    for report in reports.values():
        warn_mismatches(report, path)
    manifest.complete({"acceptance_length": {label: r["acceptance_length"] for label, r in reports.items()}})
    print_lines(compare_lines(comparison), "", f" -> {path}")
    return 0


def set_part(report: dict, name: str) -> dict:
    """One prompt set's measurement in a report (the held-out set's is the top level)."""
    return report if name == HELD_OUT else report["prompt_sets"][name]


def compare_report(cfg: Config, sets: dict[str, PromptSet], reports: dict[str, dict], keys: dict, files: dict[str, ReportFiles]) -> dict:
    """Both drafts' reports, and per set their acceptance lengths and tokens/s speedups side by side."""
    def side_by_side(field: str) -> dict:
        return {name: {label: set_part(r, name)[field] for label, r in reports.items()} for name in sets}

    acceptance = side_by_side("acceptance_length")
    for name, values in acceptance.items():
        values["b_minus_a"] = values["b"] - values["a"]
    return {
        "version": REPORT_VERSION,
        "complete": True,
        "key": keys,
        "target": cfg.target.model,
        "sampling": sampling_params(cfg),
        "server": asdict(cfg.server) | {"port": None},  # one setting for both drafts' servers
        "num_speculative_tokens": cfg.evaluate.num_speculative_tokens,
        "drafts": {label: r["draft"] for label, r in reports.items()},
        "prompt_sets": {name: {"num_prompts": len(s.prompts), "prompts_sha256": prompts_sha256(s.prompts), **s.describe()}
                        for name, s in sets.items()},
        "acceptance_length": acceptance,
        "per_position_acceptance": side_by_side("per_position_acceptance"),
        "speedup": {name: {label: set_part(r, name)["throughput"]["speedup"] for label, r in reports.items()} for name in sets},
        "reports": reports,
        "files": {"report": str(files["a"].report), "plot": str(files["a"].plot),
                  "outputs": {label: {name: str(f.outputs_of(name)) for name in sets} for label, f in files.items()}},
        "created": time.time(),
    }


def compare_lines(comparison: dict) -> list[str]:
    """A line naming both drafts and their offline predictions, then one line per prompt set: a, b and b - a."""
    def offline(report: dict) -> str:
        predicted = (report.get("offline") or {}).get("expected_acceptance_length")
        return f"offline prediction {predicted:.2f}" if isinstance(predicted, (int, float)) else "no offline prediction"

    reports = comparison["reports"]
    lines = ["compare (k={}): {}".format(comparison["num_speculative_tokens"], "; ".join(
        f"{label} = {r['draft']} ({offline(r)})" for label, r in reports.items()))]
    for name, al in comparison["acceptance_length"].items():
        speedup = comparison["speedup"][name]
        tps = ", ".join(f"{label} {speedup[label]:.2f}x" for label in COMPARED if speedup[label] is not None)
        lines.append(f"{name} ({comparison['prompt_sets'][name]['num_prompts']} prompts): acceptance length a {al['a']:.2f} | "
                     f"b {al['b']:.2f} | b - a {al['b_minus_a']:+.2f}" + (f" | tokens/s vs the target alone: {tps}" if tps else ""))
    return lines
