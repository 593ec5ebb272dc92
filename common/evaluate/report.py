"""05's report: one draft's measurement put together, written, and read back as summary lines.

- `build_report`: per prompt set, vLLM's acceptance (common.evaluate.serve), the tokens/s with and
  without the draft and vLLM's step times behind their ratio (common.evaluate.steps), and whether the outputs are identical (at temperature 0 they must be: speculative
  decoding is lossless; mismatches are counted and shown, never hidden); 04's prediction for the draft
  (common.evaluate.draft) with its relative error, twice: on 04's eval split (every sample, every assistant turn:
  "offline") and on exactly the prompts 05 measured, first turn ("offline_on_measured_prompts": the like-with-like
  error); with evaluate.replay_served, the replay over the exact token ids vLLM served (the same text on both
  sides: it checks the replay itself). A long-context set's part has "buckets": acceptance per prompt length.
- `write_report`: the plot (common.evaluate.plots), then report.json; a warning per set whose greedy
  outputs differ.
- `summary_lines`: the held-out set's line (with the prediction), then one line per prompt set, + for a set
  with later turns a line for its turn 2, for a set with categories one listing them, and for a set the draft
  slows a line saying why (common.evaluate.steps.slowdown_line).

The held-out prompts' numbers are the report's top level; every other set's are under
report["prompt_sets"][name] (`set_part` reads either). A set's part keeps its turn-1 numbers at its top
level; "turn_2" and "categories" are beside them only where the set has later turns or categories.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from common.core.config import Config
from common.core.errors import DataError, PipelineError
from common.core.io import atomic_write_json, read_json, write_jsonl_atomic
from common.core.run_folder import HELD_OUT, OTHER, Layout
from common.evaluate.draft import CheckedDraft, draft_fingerprint, prediction_on_prompts
from common.evaluate.prompt_sets import PromptSet
from common.evaluate.serve import Baseline, DraftRun, SecondTurn, sampling_params
from common.evaluate.steps import slowdown_line, step_times

REPORT_VERSION = 1


@dataclass(frozen=True)
class ReportFiles:
    """Where one draft's measurement is written: eval/ for a plain run, eval/compare/ for each draft of --compare."""

    report: Path
    plot: Path
    outputs_of: Callable[[str], Path]  # a prompt set's outputs with and without the draft


# ----------------------------------------------------------------------------- outputs with and without the draft


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


# ----------------------------------------------------------------------------- building and writing the report


def speedup(with_draft: list[float], without_draft: list[float]) -> dict:
    """Tokens/s with the draft over without: the ratio of the medians, and the range the timed runs allow (slowest
    with over fastest without, fastest over slowest: the two servers' runs are not paired)."""
    if not min(without_draft, default=0):
        return {"speedup": None}
    ratio = statistics.median(with_draft) / statistics.median(without_draft)
    low, high = min(with_draft) / max(without_draft), max(with_draft) / min(without_draft)
    return {"speedup": round(ratio, 4), "speedup_range": [round(low, 4), round(high, 4)],
            "verdict": "faster" if low > 1 else "slower" if high < 1 else "within the runs' spread"}


def outputs_part(cfg: Config, with_draft: dict[str, dict], without_draft: dict[str, dict]) -> dict:
    """A turn's "outputs": how many agree with and without the draft, and where the first mismatches diverge."""
    comparison = compare_outputs(with_draft, without_draft)
    return {
        **comparison,
        "greedy": cfg.evaluate.temperature == 0.0,
        # At temperature 0 speculative decoding must not change the text.
        "all_identical": comparison["identical"] == comparison["compared"],
        "mismatch_examples": mismatch_examples(comparison["mismatched_ids"], with_draft, without_draft),
    }


def set_results(cfg: Config, prompts: list[dict], measured: DraftRun, baseline: Baseline, outputs_path: Path) -> dict:
    """One prompt set's part of the report: acceptance, throughput, outputs with vs without the draft (each prompt's
    both outputs written to outputs_path, its turn 2's beside them), + its turn 2 and its categories where it has them."""
    outputs = outputs_part(cfg, measured.run.outputs, baseline.run.outputs)
    turn_2 = turn_2_results(cfg, measured.turn_2, baseline.turn_2)
    write_outputs(outputs_path, prompts, measured, baseline, outputs, turn_2)
    ratio = speedup(measured.run.tokens_per_s_runs, baseline.run.tokens_per_s_runs)
    return {
        "num_prompts": len(prompts),
        **measured.acceptance,
        "throughput": {"with_draft": measured.run.throughput(), "without_draft": baseline.run.throughput(), **ratio},
        "step_times": step_times(measured.run.step_counters_runs, baseline.run.step_counters_runs,
                                 measured.acceptance["acceptance_length"], ratio["speedup"]),
        "outputs": outputs,
        **({"turn_2": turn_2} if turn_2 else {}),
        **({"categories": category_results(measured)} if measured.categories else {}),
    }


def bucket_results(prompt_set: PromptSet, measured: DraftRun) -> dict:
    """A long-context set's "buckets": {label: its bound, its prompts' lengths in tokens, and the acceptance of its
    window} (each bucket is a category of the set: common.evaluate.built_sets)."""
    out = {}
    for label, bound in prompt_set.buckets.items():
        lengths = [p["prompt_tokens"] for p in prompt_set.prompts if p.get("category") == label]
        numbers = measured.categories.get(label) or {}
        out[label] = {"max_prompt_tokens": bound, "prompt_tokens": [min(lengths), max(lengths)], "num_prompts": len(lengths),
                      "acceptance_length": numbers.get("acceptance_length"),
                      "per_position_acceptance": numbers.get("per_position_acceptance")}
    return out


def acceptance_by_set(report: dict) -> dict:
    """{set (and "SET turn 2"): acceptance length}, the held-out set first: the sets side by side."""
    out = {HELD_OUT: report.get("acceptance_length")}
    for name, part in measured_sets(report).items():
        out[name] = part.get("acceptance_length")
        if (part.get("turn_2") or {}).get("acceptance_length") is not None:
            out[f"{name} turn 2"] = part["turn_2"]["acceptance_length"]
    return out


def turn_2_results(cfg: Config, measured: Optional[DraftRun], baseline: Optional[SecondTurn]) -> Optional[dict]:
    """A set's "turn_2" (None for a set without later turns): its acceptance, its prompts and those left out (too
    long with the answer), and its outputs with vs without the draft; no acceptance when no prompt was left."""
    if baseline is None:
        return None
    left_out = {"left_out": baseline.left_out} if baseline.left_out else {}
    if measured is None:
        return {"num_prompts": 0, **left_out}
    return {"num_prompts": len(baseline.prompts), **measured.acceptance, **left_out,
            "outputs": outputs_part(cfg, measured.run.outputs, baseline.run.outputs)}


def category_results(measured: DraftRun) -> dict:
    """{category: {"turn_1": numbers of its window, "turn_2": those of its turn-2 window (where it has one)}}."""
    parts = {category: {"turn_1": numbers} for category, numbers in measured.categories.items()}
    for category, numbers in (measured.turn_2.categories if measured.turn_2 else {}).items():
        parts.setdefault(category, {})["turn_2"] = numbers
    return parts


def write_outputs(path: Path, prompts: list[dict], measured: DraftRun, baseline: Baseline, outputs: dict,
                  turn_2: Optional[dict]) -> None:
    """Each prompt's outputs with and without the draft; a prompt sent as turn 2 also has that conversation's."""
    second = {p["id"]: p["messages"] for p in (baseline.turn_2.prompts if baseline.turn_2 else [])}
    mismatched_2 = set(((turn_2 or {}).get("outputs") or {}).get("mismatched_ids", []))

    def row(p: dict) -> dict:
        pid = p["id"]
        out = {"id": pid, "messages": p["messages"], "with_draft": measured.run.outputs[pid],
               "without_draft": baseline.run.outputs.get(pid), "identical": pid not in outputs["mismatched_ids"]}
        if pid in second and measured.turn_2:
            out["turn_2"] = {"messages": second[pid], "with_draft": measured.turn_2.run.outputs[pid],
                             "without_draft": baseline.turn_2.run.outputs.get(pid), "identical": pid not in mismatched_2}
        return out

    write_jsonl_atomic(path, (row(p) for p in prompts))


def build_report(cfg: Config, layout: Layout, sets: dict[str, PromptSet], draft: CheckedDraft, key: dict,
                 measured: dict[str, DraftRun], baselines: dict[str, Baseline], files: ReportFiles) -> dict:
    """One draft's report.json: the held-out set's numbers at the top level, the other sets' under "prompt_sets"."""
    results = {name: set_results(cfg, s.prompts, measured[name], baselines[name], files.outputs_of(name))
               for name, s in sets.items()}
    for name, s in sets.items():
        if s.buckets:
            results[name]["buckets"] = bucket_results(s, measured[name])
    prompt_sets = {name: {**s.describe(), **results[name],
                          "files": {"outputs": str(files.outputs_of(name)), "baseline": str(layout.baseline_of(name))}}
                   for name, s in sets.items() if name != HELD_OUT}
    report = {
        "version": REPORT_VERSION,
        "complete": True,
        "key": key,
        "draft": str(draft.path),
        "draft_sha256": draft.sha256,
        "target": cfg.target.model,
        "sampling": sampling_params(cfg),
        **results[HELD_OUT],  # the held-out prompts: the headline numbers
        **({"rows_skipped": sets[HELD_OUT].rows_skipped} if sets[HELD_OUT].rows_skipped else {}),
        "offline": draft.offline.prediction,  # on 04's eval split, every assistant turn
        "offline_missing": draft.offline.missing,
        # on exactly the prompts measured above (first turn): what the prediction error compares
        "offline_on_measured_prompts": prediction_on_prompts(draft.offline, [p["id"] for p in sets[HELD_OUT].prompts],
                                                             cfg.evaluate.num_speculative_tokens)
        if draft.offline.prediction else None,
        "prompt_sets": prompt_sets,
        # the name of evaluate.other_prompts' section before evaluate.prompt_sets, kept: the same as prompt_sets.other
        "other_prompts": {"path": sets[OTHER].source, **prompt_sets[OTHER]} if OTHER in sets else None,
        "files": {"report": str(files.report), "plot": str(files.plot), "outputs": str(files.outputs_of(HELD_OUT)),
                  "baseline": str(layout.baseline)},
        "created": time.time(),
    }
    report["offline_prediction_error"] = prediction_error(report)  # on 04's eval split, as before
    report["prediction_error"] = {"on_measured_prompts": prediction_error(report, "offline_on_measured_prompts"),
                                  "on_eval_split": report["offline_prediction_error"]}
    report["acceptance_length_by_set"] = acceptance_by_set(report)
    buckets = {name: {label: b["acceptance_length"] for label, b in part["buckets"].items()}
               for name, part in prompt_sets.items() if "buckets" in part}
    if buckets:
        report["acceptance_length_by_bucket"] = buckets
    if cfg.evaluate.replay_served:
        report["replay_on_served"] = replay_on_served(cfg, draft.path, sets[HELD_OUT].prompts, measured[HELD_OUT])
    return report


def prediction_error(report: dict, prediction: str = "offline") -> Optional[float]:
    """(offline prediction - vLLM measured) / measured, for the held-out prompts; prediction: the report's "offline"
    (04's eval split) or "offline_on_measured_prompts" (the measured prompts themselves)."""
    predicted = (report.get(prediction) or {}).get("expected_acceptance_length")
    measured = report.get("acceptance_length")
    if isinstance(predicted, (int, float)) and isinstance(measured, (int, float)) and measured > 0:
        return (predicted - measured) / measured
    return None


def replay_on_served(cfg: Config, draft: Path, prompts: list[dict], measured: DraftRun) -> dict:
    """The replay over the very token sequences vLLM generated (evaluate.replay_served): with the same
    text on both sides, what is left between it and vLLM's counters is the replay's own error."""
    from common.evaluate.replay import replay_on_token_ids

    outputs = measured.run.outputs
    missing = [p["id"] for p in prompts if not outputs[p["id"]].get("completion_token_ids")
               or not outputs[p["id"]].get("prompt_token_ids")]
    if missing:
        raise PipelineError(f"vLLM returned no token ids for {len(missing)} prompt(s) (first: {missing[0]}); "
                            f"evaluate.replay_served needs vLLM >= 0.10 (return_token_ids), or set it to false")
    sequences = [(outputs[p["id"]]["prompt_token_ids"], outputs[p["id"]]["completion_token_ids"]) for p in prompts]
    result = replay_on_token_ids(cfg, draft, sequences, cfg.evaluate.num_speculative_tokens)
    measured_al = measured.acceptance["acceptance_length"]
    result["relative_error"] = (result["acceptance_length"] - measured_al) / measured_al
    return result


def write_report(layout: Layout, report: dict, files: ReportFiles) -> None:
    """The plot, then report.json."""
    from common.evaluate.plots import plot_report

    plot_report(report, layout.metrics, files.plot)
    atomic_write_json(files.report, report)
    warn_mismatches(report, files.report)


def warn_mismatches(report: dict, path: Path) -> None:
    """A warning per prompt set (and turn 2) whose greedy outputs differ with and without the draft."""
    for name, part in ((HELD_OUT, report), *measured_sets(report).items()):
        for what, o in ((name, part["outputs"]), (f"{name} turn 2", (part.get("turn_2") or {}).get("outputs"))):
            if o and o["greedy"] and o["identical"] != o["compared"]:
                print(f"05_evaluate: WARNING: at temperature 0, {len(o['mismatched_ids'])} of {o['compared']} outputs ({what} "
                      f"prompts, draft {report['draft']}) differ with and without the draft (see 'mismatch_examples' in {path})",
                      file=sys.stderr)


# ----------------------------------------------------------------------------- reading a report back


def report_measures(cfg: Config, report: dict, draft_dir: Path) -> bool:
    """Whether a 05 report measured the draft now in draft_dir: the same weights, whatever its path."""
    try:
        return report.get("draft_sha256") == draft_fingerprint(draft_dir, Layout.of(cfg))
    except PipelineError:  # no draft there (any more)
        return False


def read_back(path: Path, lines: Callable[[dict], list[str]]) -> list[str]:
    """The summary lines (`lines`: summary_lines, compare.compare_lines) of a report 05 wrote at path. A file this
    version did not write (an earlier version's, another program's, a hand edit) is one DataError, not a traceback."""
    doc = read_json(path)
    try:
        return lines(doc)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise DataError(f"{path} was made by an earlier version of this pipeline or another program ({type(e).__name__}: "
                        f"{e}); rerun 05_evaluate.py with --overwrite") from None


def measured_sets(report: dict) -> dict[str, dict]:
    """The report's prompt sets besides the held-out one."""
    return report["prompt_sets"]


def set_part(report: dict, name: str) -> dict:
    """One prompt set's measurement in a report (the held-out set's is the top level)."""
    return report if name == HELD_OUT else report["prompt_sets"][name]


def set_summary(part: dict) -> str:
    """One prompt set's numbers: acceptance length, per-position acceptance, tokens/s speedup, identical outputs."""
    per_pos = "/".join(f"{r:.2f}" for r in part["per_position_acceptance"])
    line = f"acceptance length {part['acceptance_length']:.2f} (k={part['num_speculative_tokens']}) | per-position {per_pos}"
    tp = part.get("throughput") or {}  # turn 2 is not timed
    if tp.get("speedup") is not None:
        runs = f"{len(tp['with_draft']['tokens_per_s_runs'])}+{len(tp['without_draft']['tokens_per_s_runs'])} runs"
        low, high = tp["speedup_range"]
        # An iteration with the draft costs at least a target step and yields acceptance_length tokens, so tokens/s
        # cannot gain more than that: a ratio above it, at the low end of the runs, is the machine's noise.
        note = (": the draft slows serving" if tp["verdict"] == "slower" else
                ": more than the acceptance length allows, so the timing is noise (a busy machine?): raise "
                "evaluate.throughput_repeats" if low > part["acceptance_length"] else "")
        line += f" | {tp['speedup']:.2f}x tokens/s ({low:.2f}-{high:.2f} over {runs}{note})"
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
        line += " on 04's eval split"
        mine = report.get("offline_on_measured_prompts") or {}
        if isinstance(mine.get("expected_acceptance_length"), (int, float)):
            error = prediction_error(report, "offline_on_measured_prompts")
            line += (f", {mine['expected_acceptance_length']:.2f}{'' if error is None else f' ({100 * error:+.1f}%)'} "
                     f"on these prompts' first turn")
    elif report.get("offline_missing"):
        line += f" | no offline prediction for this draft ({report['offline_missing']})"
    served = report.get("replay_on_served")
    if served:
        line += f" | replay on the served outputs {served['acceptance_length']:.2f} ({100 * served['relative_error']:+.1f}%)"
    lines = [line] + why_lines("held-out prompts", report)
    for name, part in measured_sets(report).items():
        skipped = sum((part.get("rows_skipped") or {}).values())
        lines.append(f"prompt set {name} ({part['num_prompts']} prompts{f', {skipped} rows skipped' if skipped else ''}): "
                     f"{set_summary(part)}")
        lines += why_lines(f"prompt set {name}", part) + turn_2_lines(name, part.get("turn_2")) + category_lines(name, part.get("categories"))
    return lines


def why_lines(what: str, part: dict) -> list[str]:
    """Why the draft slows serving on a set (none where it does not, or where vLLM's step times were not read)."""
    line = slowdown_line(part)
    return [f"{what}: {line}"] if line else []


def turn_2_lines(name: str, turn_2: Optional[dict]) -> list[str]:
    """A set's turn-2 line (none for a set without later turns)."""
    if not turn_2:
        return []
    left = turn_2.get("left_out") or {}
    left_out = f", {sum(left.values())} left out: {', '.join(f'{k} {v}' for k, v in left.items())}" if left else ""
    if not turn_2["num_prompts"]:
        return [f"prompt set {name} turn 2 (no prompt{left_out}): not measured"]
    return [f"prompt set {name} turn 2 ({turn_2['num_prompts']} prompts{left_out}): {set_summary(turn_2)}"]


def category_lines(name: str, categories: Optional[dict]) -> list[str]:
    """One line listing a set's categories with their acceptance lengths (turn 1 / turn 2)."""
    if not categories:
        return []

    def al(part: Optional[dict]) -> str:
        value = (part or {}).get("acceptance_length")
        return "-" if value is None else f"{value:.2f}"

    with_turn_2 = any("turn_2" in c for c in categories.values())
    listed = ", ".join(f"{category} {al(c.get('turn_1'))}" + (f"/{al(c.get('turn_2'))}" if with_turn_2 else "")
                       for category, c in categories.items())
    return [f"prompt set {name} per category, acceptance length{' turn 1/turn 2' if with_turn_2 else ''}: {listed}"]


def print_lines(lines: list[str], before: str, after: str) -> None:
    """05's summary: the first line with `before` and `after` around it, then one line per prompt set."""
    print(f"05_evaluate: {before}{lines[0]}{after}")
    for line in lines[1:]:
        print(f"05_evaluate: {line}")
