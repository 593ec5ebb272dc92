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

Each prompt set is measured between its own scrapes: the held-out prompts (the headline
numbers, at the top level of the report), and every set of evaluate.prompt_sets and
evaluate.other_prompts (the set named "other"): benchmark prompts, or prompts of another kind than
the training data (report["prompt_sets"][name]; common.evaluate.prompt_sets reads them). One summary
line per set.

MT-bench the way it is meant to be run: a set whose rows have later turns also measures turn 2, the
first turn, the target's own answer to it and the second user turn. The answer is the target-alone run's,
for both servers, so that both get the same conversations at any temperature (at temperature 0 the draft's
server answers the same: speculative decoding is lossless). So the target-alone run of such a set comes
first when it is not cached (its turn-2 prompts are recorded in its cache), and the draft's server sends
those. Acceptance per category needs a window of its own: a set is sent category by category, a pair of
scrapes around each, and the set's numbers are the sum of its categories' deltas.

The offline prediction (report["offline"]) is 04's replay of vLLM's rounds over the eval split
(common.model.acceptance), with its relative error against the measured acceptance length. With
evaluate.replay_served, report["replay_on_served"] replays the rounds over the exact token ids vLLM
served for the held-out prompts: the same text on both sides, so it checks the replay itself.

This module owns the run: what a measurement depends on (`report_key`, `baseline_key`), the
target-alone baselines, the stage's record, and `run_stage`. The parts it runs:
    common.evaluate.serve    the servers, the timed requests, acceptance from the counters
    common.evaluate.draft    which draft, checked, and 04's prediction for it
    common.evaluate.report   report.json, report.png, outputs, the summary lines
    common.evaluate.compare  --compare DIR_A DIR_B (eval/compare/; eval/report.json is left as is)

The target-alone run ("baseline"), with its turn 2, is cached per set in eval/baseline.json
(eval/baseline-NAME.json) under a key of everything it depends on, so run_pipeline.py can take it on
the generation server it already has running (`05_evaluate.py --baseline-only --base-url URL`) and
this stage starts one server instead of two.

Outputs under run_dir/eval/: report.json (atomic), report.png, outputs.jsonl and outputs-NAME.jsonl
(both outputs per prompt), baseline.json, baseline-NAME.json; eval/compare/ (--compare).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from dataclasses import asdict
from typing import Any, Optional

from common.core.config import Config
from common.core.errors import DataError, PipelineError
from common.core.io import atomic_write_json, read_json
from common.core.run_folder import HELD_OUT, OTHER, Layout, StageManifest
from common.evaluate import serve
from common.evaluate.draft import checked_draft
from common.evaluate.prompt_sets import (PromptSet, context_check, has_later_turns, load_prompt_set, load_prompt_sets,
                                         say_left_out, second_turn_prompts)
from common.evaluate.report import ReportFiles, build_report, print_lines, read_back, summary_lines, write_report
from common.evaluate.serve import Baseline, PromptRun, SecondTurn


# ----------------------------------------------------------------------------- what a measurement depends on


def _sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def prompts_sha256(prompts: list[dict]) -> str:
    """What is sent: ids, first turns, and the later turns, categories and chat templates (a prompt without any: its
    id and first turn, hashed as before they were)."""
    def extra(p: dict) -> list:
        kept = {k: p[k] for k in ("later_turns", "category", "chat_template") if k in p}
        return [kept] if kept else []

    return _sha256_json([[p["id"], p["messages"], *extra(p)] for p in prompts])


def baseline_key(cfg: Config, prompts: list[dict]) -> dict:
    """Everything the target-alone run depends on (target, prompts, sampling, server settings). The target and the
    draft (report_key) by content: a run folder or target moved elsewhere is measured already."""
    from common.target.loading import target_fingerprint

    return {
        "target_sha256": target_fingerprint(Layout.of(cfg), cfg.target.model) or cfg.target.model,  # a hub id: itself
        "target_dtype": cfg.target.dtype,
        "prompts_sha256": prompts_sha256(prompts),
        "sampling": serve.sampling_params(cfg),
        "throughput_repeats": cfg.evaluate.throughput_repeats,
        "server": asdict(cfg.server) | {"port": None},
        # Every request carries generate.extra_body (common.serving.chat); in the key only when set.
        **({"extra_body": cfg.generate.extra_body} if cfg.generate.extra_body else {}),
    }


def report_key(cfg: Config, sets: dict[str, PromptSet], draft_sha: str, foreign_draft: bool = False) -> dict:
    """Everything a draft's report depends on: the baseline's key, the draft (its weights) and every prompt set."""
    named = {name: prompts_sha256(s.prompts) for name, s in sets.items() if name not in (HELD_OUT, OTHER)}
    return baseline_key(cfg, sets[HELD_OUT].prompts) | {
        "draft_sha256": draft_sha,
        "num_speculative_tokens": cfg.evaluate.num_speculative_tokens,
        "other_prompts_sha256": prompts_sha256(sets[OTHER].prompts) if OTHER in sets else None,
        "replay_served": cfg.evaluate.replay_served,
        # reported without this run's prediction; each in the key only when set (a plain run's key has neither)
        **({"foreign_draft": True} if foreign_draft else {}),
        **({"prompt_sets_sha256": named} if named else {}),
    }


def stage_manifest(cfg: Config, key: dict, stage: str = "05_evaluate") -> StageManifest:
    """05's record (common.core.run_folder): everything the measurement depends on (report_key). A
    measurement is replaced whole, so any change means "measure again", not an error: also an entry only
    one of the two keys has (extra_body, foreign_draft)."""
    manifest = StageManifest(Layout.of(cfg), stage, settings=key)
    manifest.redo_on = set(key) | set((manifest.previous or {}).get("settings") or {})
    return manifest


# ----------------------------------------------------------------------------- the target alone


def cached_baseline(cfg: Config, prompts: Optional[list[dict]] = None, prompt_set: str = HELD_OUT) -> Optional[Baseline]:
    """The target-alone run of a prompt set (eval/baseline.json, eval/baseline-NAME.json) if it was
    measured with the current key (and, for a set with later turns, with its turn 2), else None."""
    path = Layout.of(cfg).baseline_of(prompt_set)
    if not path.is_file():
        return None
    try:
        doc = read_json(path)
    except DataError:
        return None
    if prompts is None:
        prompts = load_prompt_set(cfg, prompt_set).prompts
    if not prompts or not isinstance(doc, dict) or doc.get("key") != baseline_key(cfg, prompts):
        return None
    try:
        baseline = Baseline.from_json(doc)
    except (KeyError, TypeError):  # a file with the key but not the run: measured again
        return None
    return None if has_later_turns(prompts) and baseline.turn_2 is None else baseline


def cached_baselines(cfg: Config, sets: dict[str, PromptSet]) -> dict[str, Baseline]:
    return {name: b for name, s in sets.items() if (b := cached_baseline(cfg, s.prompts, name)) is not None}


def missing_baselines(cfg: Config, sets: Optional[dict[str, PromptSet]] = None) -> list[str]:
    """The prompt sets whose target-alone run is not cached yet (of `sets`, when the caller has read them)."""
    sets = load_prompt_sets(cfg) if sets is None else sets
    return [name for name in sets if name not in cached_baselines(cfg, sets)]


def save_baseline(cfg: Config, prompt_set: str, prompts: list[dict], baseline: Baseline) -> None:
    atomic_write_json(Layout.of(cfg).baseline_of(prompt_set),
                      {"key": baseline_key(cfg, prompts), "created": time.time(), **baseline.to_json()})


def measure_baseline(cfg: Config, base_url: str, prompts: list[dict], prompt_set: str = HELD_OUT,
                     check=None) -> Baseline:
    """Run the prompts on a server of the target alone: turn 1, timed (with its step counters where the server's
    /metrics answers: one read tells), then turn 2 where the set has later turns (its prompts counted with `check`,
    a prompt_sets.ContextCheck: one tokenizer load for every set)."""
    serve.warm_up(cfg, base_url, prompts)
    desc = "target alone" + ("" if prompt_set == HELD_OUT else f" ({prompt_set})")
    scrape = (lambda: serve.scrape_or_none(base_url)) if serve.scrape_or_none(base_url) is not None else None
    run = serve.repeat_timing(cfg, base_url, prompts, serve.send_set(cfg, base_url, prompts, desc, scrape)[0], desc, scrape)
    if not has_later_turns(prompts):
        return Baseline(run, None)
    return Baseline(run, target_alone_turn_2(cfg, base_url, prompts, run, desc, check or context_check(cfg)))


def target_alone_turn_2(cfg: Config, base_url: str, prompts: list[dict], turn_1: PromptRun, desc: str,
                        check) -> SecondTurn:
    """Turn 2 built from the target's own turn-1 answers (their content: what a chat client sends back), and run."""
    answers = {pid: o.get("content") for pid, o in turn_1.outputs.items()}
    prompts_2, left_out = second_turn_prompts(prompts, answers, check)
    return SecondTurn(prompts_2, left_out, serve.send_set(cfg, base_url, prompts_2, f"{desc}, turn 2")[0] if prompts_2 else None)


def measure_baselines(cfg: Config, layout: Layout, sets: dict[str, PromptSet], base_url: Optional[str],
                      save: bool = True) -> dict[str, Baseline]:
    """The target alone on these sets, on the server at base_url or one started here; cached unless not `save`."""
    if not sets:
        return {}
    measured = {}
    check = context_check(cfg) if any(has_later_turns(s.prompts) for s in sets.values()) else None
    with (contextlib.nullcontext(None) if base_url else
          serve.target_server(cfg, None, log_path=layout.log("vllm_eval_target"))) as server:
        for name, prompt_set in sets.items():
            measured[name] = measure_baseline(cfg, base_url or server.base_url, prompt_set.prompts, name, check)
            if save:
                save_baseline(cfg, name, prompt_set.prompts, measured[name])
    return measured


def baselines_before_draft(cfg: Config, layout: Layout, sets: dict[str, PromptSet], base_url: Optional[str],
                           overwrite: bool = False) -> dict[str, Baseline]:
    """The target-alone runs known before the draft's server starts: the cached ones (none with --overwrite) and,
    when a set with later turns has none (the draft's turn 2 sends the prompts its turn 2 built), every missing
    one, measured now on one server. With --overwrite they are not cached yet: start_over writes them once the
    previous outputs are gone."""
    known = {} if overwrite else cached_baselines(cfg, sets)
    if all(name in known for name, s in sets.items() if has_later_turns(s.prompts)):
        return known
    return known | measure_baselines(cfg, layout, {n: s for n, s in sets.items() if n not in known}, base_url, save=not overwrite)


def turn_2_prompts(baselines: dict[str, Baseline]) -> dict[str, list[dict]]:
    """{set: the turn-2 prompts its target-alone run built}: what the draft's server sends as turn 2."""
    return {name: b.turn_2.prompts for name, b in baselines.items() if b.turn_2 and b.turn_2.prompts}


def measure_or_reuse_baselines(cfg: Config, layout: Layout, sets: dict[str, PromptSet], base_url: Optional[str],
                               known: Optional[dict[str, Baseline]] = None) -> dict[str, Baseline]:
    """Target alone, per set: `known` (baselines_before_draft's), cached (run_pipeline measured it on the
    generation server), or measured now."""
    known = dict(known or {})
    known |= cached_baselines(cfg, {n: s for n, s in sets.items() if n not in known})
    known |= measure_baselines(cfg, layout, {n: s for n, s in sets.items() if n not in known}, base_url)
    return {name: known[name] for name in sets}


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
    for name, b in measure_baselines(cfg, layout, {name: sets[name] for name in todo}, base_url).items():
        print(f"05_evaluate: baseline (target alone, {name} prompts) {len(sets[name].prompts)} prompts, {b.run.output_tokens} "
              f"tokens in {b.run.wall_s:.1f}s ({b.run.tokens_per_s:.1f} tok/s){turn_2_note(b.turn_2)}")
    record("done")
    return 0


def turn_2_note(turn_2: Optional[SecondTurn]) -> str:
    if turn_2 is None:
        return ""
    left = sum(turn_2.left_out.values())
    return (f"; turn 2: {len(turn_2.prompts)} prompts{f' ({left} left out: too long with the answer)' if left else ''}"
            + (f", {turn_2.run.output_tokens} tokens" if turn_2.run else ""))


# ----------------------------------------------------------------------------- the stage


def run_stage(cfg: Config, draft_dir: Optional[str] = None, overwrite: bool = False, baseline_only: bool = False,
              base_url: Optional[str] = None, foreign_draft: bool = False) -> int:
    """05_evaluate.py (--compare is common.evaluate.compare.run_compare)."""
    layout = Layout.of(cfg)
    sets = load_prompt_sets(cfg)
    say_left_out(sets)
    if baseline_only:
        return run_baseline_only(cfg, layout, sets, base_url, overwrite)
    # Every check comes before --overwrite deletes the previous eval/ outputs: a refusal loses nothing.
    draft = checked_draft(cfg, layout, draft_dir, foreign_draft)
    key = report_key(cfg, sets, draft.sha256, foreign_draft)
    manifest = stage_manifest(cfg, key)
    if not overwrite and manifest.begin(False, outputs=[layout.eval_report]) == "complete":
        manifest.record("already_complete")
        print_lines(read_back(layout.eval_report, summary_lines), f"already complete ({layout.eval_report}): ", "; use --overwrite to redo")
        return 0

    known = baselines_before_draft(cfg, layout, sets, base_url, overwrite)

    def start_over() -> None:
        # --overwrite: only once vLLM runs with the draft and answered its warm-up, so that what can only fail
        # there (vLLM's start, the draft's load, the first request) fails before the previous outputs go.
        for p in layout.evaluate_outputs(sets):
            p.unlink(missing_ok=True)
        for name, b in known.items():  # measured for turn 2 before the draft, not cached yet
            save_baseline(cfg, name, sets[name].prompts, b)
        manifest.begin(True, outputs=[layout.eval_report])

    measured = serve.measure_with_draft(cfg, layout, sets, draft.path, on_ready=start_over if overwrite else lambda: None,
                                        second_turns=turn_2_prompts(known))
    baselines = measure_or_reuse_baselines(cfg, layout, sets, base_url, known)
    files = ReportFiles(layout.eval_report, layout.eval_plot, layout.eval_outputs_of)
    report = build_report(cfg, layout, sets, draft, key, measured, baselines, files)
    write_report(layout, report, files)
    manifest.complete({"acceptance_length": report.get("acceptance_length")})
    print_lines(summary_lines(report), "", f" -> {layout.eval_report}")
    return 0
