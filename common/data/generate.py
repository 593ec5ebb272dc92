"""Stage 01b: regenerate the assistant turns with the target itself, then tokenize them.

Training an EAGLE-3 draft on the target's own outputs (not the dataset's answers) is what
makes the draft agree with the target at serving time. run_stage drives an OpenAI-compatible
server (vLLM) with many concurrent requests and turns the results into tokenized training
samples, in this order (each step's module says how):

  read the prompts, load the tokenizer     common.data.generate_files, common.data.generate_tokenize
  check the token-id source and the server common.data.generate_tokenize, common.data.generate_server
  answer the prompts not yet done          common.data.generate_requests (clients: common.serving.chat)
  account for the failed ones              common.data.generate_files (failed.jsonl rewritten)
  tokenize every finished conversation     common.data.generate_tokenize
  write data/generate_report.json          GenerateReport, below

Guarantees (docs/design.md#resume-rules):
- every prompt id ends in data/raw_responses.jsonl exactly once, or in data/failed.jsonl
  with a reason; a rerun skips the done ids and retries the failed ones;
- a line is appended once per id and only in one synchronous write, so a kill at any
  moment leaves at most a torn last line (cut off on the next start), never a duplicate;
- SIGINT/SIGTERM stop new requests, cancel the in-flight ones, flush, and exit 130;
- retries with exponential backoff and full jitter for timeouts, connection errors, 429,
  5xx and malformed responses; other 4xx fail at once (retrying cannot fix them);
- a rejected API key, no answer at all, or more failures than generate.max_failure_fraction
  stop the stage with one error line and no train.jsonl.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import signal
import sys
from collections import Counter
from dataclasses import asdict, dataclass, fields, is_dataclass
from pathlib import Path
from typing import Optional

from common.core.config import Config
from common.core.errors import ConfigError, PipelineError
from common.core.io import atomic_write_json
from common.core.run_folder import Layout, StageManifest, read_manifest
from common.data.generate_files import copy_dataset_answers, finalize_failed, has_answers, load_done, load_prompts
from common.data.generate_requests import RunSummary, answer_prompts
from common.data.generate_server import ServerCheck, check_server
from common.data.generate_tokenize import (
    TokenizeCounts,
    check_token_sources,
    leave_out_overlong,
    load_target_tokenizer,
    tokenize_outputs,
    tokenizer_path,
)
from common.target.loading import tokenizer_fingerprint

log = logging.getLogger("generate")


@dataclass
class GenerateReport:
    """data/generate_report.json, filled in step by step. A field stays None, and out of the file,
    until its step ran; the field order is the file's key order."""

    # read_prompts
    num_prompts: int
    duplicate_prompt_ids: int
    skipped_prompts: dict[str, int]  # prompt rows stage 01 would drop, by 01's reason
    # read_done
    duplicates_in_raw: Optional[int] = None
    done_before: Optional[int] = None  # prompts already answered when this run started
    dataset_answers: Optional[int] = None  # prompts that came with the source's answers (data.answers), copied this run
    # generate_missing: only when some prompt was left to answer
    base_url: Optional[str] = None
    concurrency: Optional[int] = None
    model: Optional[str] = None
    tokenizer_check: Optional[str] = None  # "match", or why it went unchecked
    this_run: Optional[RunSummary] = None
    # account_results
    num_done: Optional[int] = None
    num_failed: Optional[int] = None
    interrupted: Optional[bool] = None
    # the end: the samples written, or why the stage stopped
    tokenize: Optional[TokenizeCounts] = None
    complete: Optional[bool] = None
    error: Optional[str] = None

    def write(self, path: Path) -> None:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        atomic_write_json(path, {name: asdict(value) if is_dataclass(value) else value
                                 for name, value in values.items() if value is not None})

    def generation_line(self) -> str:
        """The summary line's part about this run's requests ("" when it sent none)."""
        return "" if self.this_run is None else self.this_run.line()


def run_stage(cfg: Config, overwrite: bool = False) -> int:
    """The whole stage; returns the exit code (0, or 130 when stopped by a signal)."""
    # Outside the event loop SIGTERM behaves like Ctrl-C: atomic writes finish or vanish.
    previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        return _run_stage(cfg, overwrite)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def _run_stage(cfg: Config, overwrite: bool) -> int:
    layout = Layout.of(cfg)
    check_answers_source(cfg, layout)  # first: a refused run (--overwrite too) leaves every file as it was
    prompts, report = read_prompts(layout)
    # Before any request: the tokenizer loads (an error here costs seconds, not a generation run).
    tokenizer = load_target_tokenizer(cfg)
    manifest = stage_manifest(cfg, layout, tokenizer)
    outputs = stage_outputs(layout)
    recorded = manifest.result.get("raw_responses_bytes")
    if not overwrite and manifest.is_complete(outputs):
        if recorded is None or raw_size(layout) == recorded:
            r = manifest.result
            print(f"01b_generate_synthetic: already complete ({r.get('num_done')} samples generated; train {r.get('train')}, "
                  f"eval {r.get('eval')}) in {layout.data}; use --overwrite to redo")
            manifest.record("already_complete")
            return 0
        # damaged or cut after it was complete (a disk error, a bad copy): re-read it, redo what is lost
        print(f"01b_generate_synthetic: {layout.raw_responses} has {raw_size(layout)} bytes, "
              f"{recorded} when 01b completed; checking it again and regenerating what is missing")
    # Rendered only now (every prompt through the chat template): a complete run above skips it.
    prompts = leave_out_unservable(cfg, tokenizer, prompts, report)
    server: Optional[ServerCheck] = None  # once the server passed check_server
    if overwrite:
        # Every refusal comes before the previous outputs go: a refused --overwrite leaves them as they were.
        check_token_sources(cfg, layout, tokenizer, prompts, {})
        to_send = [p for p in prompts if not has_answers(p)]
        server = check_server(cfg, to_send, tokenizer, overwrite=True) if to_send else None
        for p in layout.generate_outputs():
            p.unlink(missing_ok=True)
    manifest.begin(overwrite, outputs=outputs)  # "complete" here: raw_responses.jsonl was damaged (above)
    done, todo = read_done(layout, prompts, report)
    if not overwrite:  # with --overwrite, checked before the outputs were deleted
        check_token_sources(cfg, layout, tokenizer, prompts, done)
    interrupted = False
    if todo:
        server = server or check_server(cfg, todo, tokenizer)
        done, interrupted = generate_missing(cfg, layout, todo, server, report, manifest)
    still_failed = account_results(layout, prompts, done, report, interrupted)
    if interrupted:
        report.complete = False
        report.write(layout.generate_report)
        print(f"01b_generate_synthetic: interrupted: {report.generation_line()}{report.num_done}/{len(prompts)} done, "
              f"{len(still_failed)} failed; rerun the same command to resume", file=sys.stderr)
        return 130
    check_failure_share(cfg, layout, report, still_failed, manifest)
    tok = tokenize_outputs(cfg, layout, prompts, done, tokenizer)
    report.tokenize, report.complete = tok, not still_failed
    report.write(layout.generate_report)
    result = {"num_done": report.num_done, "num_failed": len(still_failed), "train": tok.train, "eval": tok.eval,
              "raw_responses_bytes": raw_size(layout)}
    # Complete only with no failures left: a rerun retries them (with a server).
    manifest.complete(result) if not still_failed else manifest.partial(result)
    copied = f" ({report.dataset_answers} with the dataset's answers)" if report.dataset_answers else ""
    control = (f"; {tok.answers_with_control_text} samples with chat-template control text in a dataset answer, "
               "tokenized as plain text" if tok.answers_with_control_text else "")
    print(f"01b_generate_synthetic: {report.generation_line()}{report.num_done}/{len(prompts)} done{copied}, {len(still_failed)} failed"
          f"{failed_advice(layout, still_failed)}; "
          f"tokenized train {tok.train}, eval {tok.eval}, {tok.tokens} tokens ({tok.loss_tokens} with loss), "
          f"{tok.truncated} truncated, skipped {tok.skipped or 0}{control}")
    return 0


# ----------------------------------------------------------------------------- the steps


def read_prompts(layout: Layout) -> tuple[list[dict], GenerateReport]:
    """The prompts to answer, and the report's first counts (duplicates, rows 01 would have dropped)."""
    skipped: Counter = Counter()
    prompts, dup_prompts = load_prompts(layout.prompts, skipped)
    if skipped:
        log.warning("%s: skipped %d prompt row(s) that stage 01 would drop (%s)", layout.prompts, sum(skipped.values()),
                    ", ".join(f"{k} {v}" for k, v in skipped.most_common()))
    return prompts, GenerateReport(num_prompts=len(prompts), duplicate_prompt_ids=dup_prompts, skipped_prompts=dict(skipped))


# What prompts.jsonl holds for each data.answers of 01's (common.data.prepare).
PROMPTS_HOLD = {"regenerate": "the user turns alone, no answers",
                "dataset": "the source's answers",
                "fill": "the source's answers where every kept user turn has one"}


def check_answers_source(cfg: Config, layout: Layout) -> None:
    """data.answers is the value 01 wrote prompts.jsonl with (its manifest's settings): prompts.jsonl holds the
    source's answers or none, by that value, so another value here would keep the dataset's answers as if
    regenerated, or ask a server for answers the prompts do not lack. Unchecked when 01 left no record (a
    prompts.jsonl written by hand)."""
    recorded = ((read_manifest(layout, "01_prepare_data") or {}).get("settings") or {}).get("data.answers")
    if recorded is None or recorded == cfg.data.answers:
        return
    raise ConfigError(f"data.answers={cfg.data.answers}, but 01_prepare_data.py wrote {layout.prompts} with "
                      f"data.answers={recorded} ({PROMPTS_HOLD.get(recorded, 'another selection')}); rerun "
                      f"01_prepare_data.py --overwrite with data.answers={cfg.data.answers}, or set "
                      f"data.answers={recorded}")


def stage_outputs(layout: Layout) -> list[Path]:
    return [layout.raw_responses, layout.train_jsonl, layout.eval_jsonl]


def raw_size(layout: Layout) -> int:
    return layout.raw_responses.stat().st_size if layout.raw_responses.exists() else 0


def leave_out_unservable(cfg: Config, tokenizer, prompts: list[dict], report: GenerateReport) -> list[dict]:
    """Leave out, before any request, the prompts the server would refuse (longer than its context);
    counted in the report's skipped_prompts and said in one line. A prompt with the dataset's answers is
    never sent: tokenize.max_seq_len alone bounds it."""
    skipped: Counter = Counter()
    servable = {id(p) for p in leave_out_overlong(cfg, tokenizer, [p for p in prompts if not has_answers(p)], skipped)}
    kept = [p for p in prompts if has_answers(p) or id(p) in servable]
    if skipped:
        print(f"01b_generate_synthetic: left out {sum(skipped.values())} of {len(prompts)} prompts the server cannot take "
              f"({', '.join(f'{k} {v}' for k, v in skipped.most_common())}; server.max_model_len="
              f"{cfg.server.max_model_len})", flush=True)
    report.skipped_prompts = dict(Counter(report.skipped_prompts) + skipped)
    report.num_prompts = len(kept)
    return kept


def check_before_server(cfg: Config) -> str:
    """Every check of 01b that needs no server (run_pipeline.py runs it before it starts vLLM): the prompts
    read, the tokenizer loads, the token-id source works, some prompt fits the context. Returns a status line."""
    layout = Layout.of(cfg)
    check_answers_source(cfg, layout)
    prompts, report = read_prompts(layout)
    tokenizer = load_target_tokenizer(cfg)
    if stage_manifest(cfg, layout, tokenizer).is_complete(stage_outputs(layout)):
        return f"01b complete ({len(prompts)} prompts)"
    prompts = leave_out_unservable(cfg, tokenizer, prompts, report)
    check_token_sources(cfg, layout, tokenizer, prompts, {})  # the rows already done: 01b checks them itself
    answered = sum(map(has_answers, prompts))
    with_answers = f" ({answered} with the dataset's answers)" if answered else ""
    return f"{len(prompts) - answered} prompts to serve{with_answers}, token ids from {cfg.tokenize.token_ids_from}: checked"


def stage_manifest(cfg: Config, layout: Layout, tokenizer) -> StageManifest:
    """01b's record (common.core.run_folder). Sampling settings must stay the same to resume: two
    generations are never mixed in one data set. New prompts are simply generated, and changed
    tokenization settings (or tokenizer) retokenize everything from the raw responses."""
    g, t = cfg.generate, cfg.tokenize
    template = getattr(tokenizer, "chat_template", None) or ""
    return StageManifest(
        layout, "01b_generate_synthetic",
        inputs=layout.named(layout.prompts),
        settings={
            "sampling": {"model": g.model, "max_tokens": g.max_tokens, "temperature": g.temperature, "top_p": g.top_p,
                         "enable_thinking": g.enable_thinking, "extra_body": g.extra_body},
            "tokenize": {"max_seq_len": t.max_seq_len, "overlong": t.overlong, "token_ids_from": t.token_ids_from,
                         "tokenizer": tokenizer_fingerprint(layout, tokenizer_path(cfg)),  # by content, not path
                         "chat_template_sha256": hashlib.sha256(str(template).encode()).hexdigest()},
            # which prompts the server takes (leave_out_unservable): a larger context answers the ones left out
            "context": {"max_model_len": cfg.server.max_model_len},
        },
        redo_on={layout.name(layout.prompts), "tokenize", "context"},
    )


def read_done(layout: Layout, prompts: list[dict], report: GenerateReport) -> tuple[dict[str, dict], list[dict]]:
    """(finished raw rows by id, prompts still to answer). The prompts that came with the dataset's answers
    are copied in as finished first."""
    prompt_ids = {p["id"] for p in prompts}
    done, dup_raw = load_done(layout.raw_responses)
    if dup_raw:
        log.warning("%s holds %d duplicate id(s); using the first row of each", layout.raw_responses, dup_raw)
    report.duplicates_in_raw = dup_raw
    report.done_before = sum(1 for pid in done if pid in prompt_ids)
    copied = copy_dataset_answers(layout.raw_responses, [p for p in prompts if p["id"] not in done])
    report.dataset_answers = len(copied)
    done.update((row["id"], row) for row in copied)
    return done, [p for p in prompts if p["id"] not in done]


def generate_missing(cfg: Config, layout: Layout, todo: list[dict], server: ServerCheck, report: GenerateReport,
                     manifest: StageManifest) -> tuple[dict[str, dict], bool]:
    """Answer the prompts in `todo` with the server check_server passed; returns (all finished rows,
    interrupted). A failure every request shares (a rejected API key) stops the run at once with
    one error line."""
    report.base_url, report.concurrency = cfg.generate.base_url, cfg.generate.concurrency
    generator, interrupted = asyncio.run(answer_prompts(cfg, layout, todo, server.model))
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)  # asyncio restored the default
    report.model, report.tokenizer_check = server.model, server.tokenizer_check
    report.this_run = generator.stats.summary(len(todo))
    if generator.fatal is not None:
        fail(layout, report, manifest, generator.fatal)
    done, _ = load_done(layout.raw_responses)
    return done, interrupted


def account_results(layout: Layout, prompts: list[dict], done: dict[str, dict], report: GenerateReport,
                    interrupted: bool) -> dict[str, dict]:
    """Rewrite failed.jsonl with the ids still not done; returns their failure records."""
    prompt_ids = {p["id"] for p in prompts}
    done_ids = {pid for pid in done if pid in prompt_ids}
    still_failed = finalize_failed(layout, prompt_ids, done_ids)
    report.num_done, report.num_failed, report.interrupted = len(done_ids), len(still_failed), interrupted
    return still_failed


def failed_advice(layout: Layout, still_failed: dict[str, dict]) -> str:
    """What to do about the failed prompts: a rerun retries them, which helps only for transient trouble."""
    if not still_failed:
        return ""
    final = sum(r.get("retryable") is False for r in still_failed.values())
    if not final:
        return f" (rerun to retry them; reasons in {layout.failed})"
    transient = len(still_failed) - final
    return (f" ({final} rejected as invalid or not encodable, which a rerun repeats: fix or remove those prompts"
            f"{f'; {transient} for transient reasons, which a rerun retries' if transient else ''}; reasons in {layout.failed})")


def check_failure_share(cfg: Config, layout: Layout, report: GenerateReport, still_failed: dict[str, dict],
                        manifest: StageManifest) -> None:
    """No sample at all, or more failures than generate.max_failure_fraction: an error, and no
    train.jsonl is written (later stages must not train on a broken generation)."""
    n, failed = report.num_prompts, len(still_failed)
    if not failed:
        return
    causes = Counter(str(r.get("status_code") or r.get("error_type") or "unknown") for r in still_failed.values())
    why = ", ".join(f"{cause} x{count}" for cause, count in causes.most_common(3))
    todo = f"reasons per id in {layout.failed}; fix the server or the prompts and rerun (finished samples are kept, failed ones retried)"
    limit = cfg.generate.max_failure_fraction
    if report.num_done == 0:
        fail(layout, report, manifest, f"no prompt got an answer: all {failed} of {n} failed every retry ({why}); {todo}")
    if failed / n > limit:
        fail(layout, report, manifest, f"{failed} of {n} prompts ({failed / n:.0%}) failed every retry, more than "
                                      f"generate.max_failure_fraction={limit:g} ({why}); {todo}")


def fail(layout: Layout, report: GenerateReport, manifest: StageManifest, message: str) -> None:
    """Record why the run failed in generate_report.json and the manifest, then stop with one line."""
    report.complete, report.error = False, message
    report.write(layout.generate_report)
    manifest.partial(manifest.result, outcome="failed")
    raise PipelineError(message)
