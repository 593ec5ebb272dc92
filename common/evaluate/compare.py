"""05 --compare DIR_A DIR_B: two drafts measured with the same server settings on the same prompts.

Every prompt set, one server per draft, the target-alone baselines shared with a plain run (and cached
the same way). Written side by side under eval/compare/: report.json ({"acceptance_length": {set: {"a",
"b", "b_minus_a"}}, "turn_2_acceptance_length" alike for the sets with a turn 2, "speedup" and "cost_ratio" (an
iteration with the draft over a target step, common.evaluate.steps) {set: {"a", "b"}}, "reports": {"a", "b"}: each
draft's report as a plain run writes it}), report.png and each draft's outputs; eval/report.json is left as it is.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Optional

from common.core.config import Config
from common.core.io import atomic_write_json
from common.core.run_folder import Layout
from common.evaluate import serve
from common.evaluate.draft import checked_draft
from common.evaluate.prompt_sets import PromptSet, load_prompt_sets
from common.evaluate.report import (REPORT_VERSION, ReportFiles, build_report, print_lines, read_back, set_part,
                                    warn_mismatches)
from common.evaluate.stage import (baselines_before_draft, measure_or_reuse_baselines, prompts_sha256, report_key,
                                   stage_manifest, turn_2_prompts)

COMPARED = ("a", "b")  # the two drafts of --compare, in the order given


def compare_files(layout: Layout) -> dict[str, ReportFiles]:
    """eval/compare/: one report.json and report.png for both drafts, outputs-a-SET.jsonl and outputs-b-SET.jsonl."""
    return {label: ReportFiles(layout.compare_report, layout.compare_plot, lambda name, label=label: layout.compare_outputs_of(label, name))
            for label in COMPARED}


def run_compare(cfg: Config, dirs: list[str], overwrite: bool = False, base_url: Optional[str] = None,
                foreign_draft: bool = False) -> int:
    """Two drafts with the same server settings on the same prompts (every set), side by side in eval/compare/."""
    layout = Layout.of(cfg)
    sets = load_prompt_sets(cfg)
    # Every check comes before --overwrite deletes the previous outputs: a refusal loses nothing.
    drafts = {label: checked_draft(cfg, layout, d, foreign_draft) for label, d in zip(COMPARED, dirs)}
    keys = {label: report_key(cfg, sets, d.sha256, foreign_draft) for label, d in drafts.items()}
    files = compare_files(layout)
    path = files["a"].report
    if overwrite:
        for p in [path, files["a"].plot, *(f.outputs_of(n) for f in files.values() for n in sets), *map(layout.baseline_of, sets)]:
            p.unlink(missing_ok=True)
    manifest = stage_manifest(cfg, keys, "05_compare")
    if manifest.begin(overwrite, outputs=[path]) == "complete":
        manifest.record("already_complete")
        print_lines(read_back(path, compare_lines), f"already complete ({path}): ", "; use --overwrite to redo")
        return 0
    known = baselines_before_draft(cfg, layout, sets, base_url)  # both drafts' turn 2 sends the target-alone answers
    measured = {label: serve.measure_with_draft(cfg, layout, sets, d.path, f"vllm_compare_{label}", second_turns=turn_2_prompts(known))
                for label, d in drafts.items()}
    baselines = measure_or_reuse_baselines(cfg, layout, sets, base_url, known)
    reports = {label: build_report(cfg, layout, sets, d, keys[label], measured[label], baselines, files[label])
               for label, d in drafts.items()}
    comparison = compare_report(cfg, sets, reports, keys, files)
    from common.evaluate.plots import plot_compare

    plot_compare(comparison, files["a"].plot)
    atomic_write_json(path, comparison)
    for report in reports.values():
        warn_mismatches(report, path)
    manifest.complete({"acceptance_length": {label: r["acceptance_length"] for label, r in reports.items()}})
    print_lines(compare_lines(comparison), "", f" -> {path}")
    return 0


def compare_report(cfg: Config, sets: dict[str, PromptSet], reports: dict[str, dict], keys: dict, files: dict[str, ReportFiles]) -> dict:
    """Both drafts' reports, and per set their acceptance lengths and tokens/s speedups side by side."""
    def side_by_side(field: str) -> dict:
        return {name: {label: set_part(r, name)[field] for label, r in reports.items()} for name in sets}

    acceptance = with_difference(side_by_side("acceptance_length"))
    turn_2 = with_difference({name: {label: set_part(r, name)["turn_2"].get("acceptance_length") for label, r in reports.items()}
                              for name in sets if "turn_2" in set_part(reports["a"], name)})
    return {
        "version": REPORT_VERSION,
        "complete": True,
        "key": keys,
        "target": cfg.target.model,
        "sampling": serve.sampling_params(cfg),
        "server": asdict(cfg.server) | {"port": None},  # one setting for both drafts' servers
        "num_speculative_tokens": cfg.evaluate.num_speculative_tokens,
        "drafts": {label: r["draft"] for label, r in reports.items()},
        "prompt_sets": {name: {"num_prompts": len(s.prompts), "prompts_sha256": prompts_sha256(s.prompts), **s.describe()}
                        for name, s in sets.items()},
        "acceptance_length": acceptance,
        **({"turn_2_acceptance_length": turn_2} if turn_2 else {}),
        "per_position_acceptance": side_by_side("per_position_acceptance"),
        "speedup": {name: {label: set_part(r, name)["throughput"]["speedup"] for label, r in reports.items()} for name in sets},
        "cost_ratio": {name: {label: set_part(r, name)["step_times"].get("cost_ratio") for label, r in reports.items()}
                       for name in sets},
        "reports": reports,
        "files": {"report": str(files["a"].report), "plot": str(files["a"].plot),
                  "outputs": {label: {name: str(f.outputs_of(name)) for name in sets} for label, f in files.items()}},
        "created": time.time(),
    }


def with_difference(side_by_side: dict[str, dict]) -> dict[str, dict]:
    """{set: {"a", "b"}} + "b_minus_a" (None where a side has no number: a turn 2 with no prompt left)."""
    for values in side_by_side.values():
        values["b_minus_a"] = None if None in (values["a"], values["b"]) else values["b"] - values["a"]
    return side_by_side


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
        cost = comparison["cost_ratio"][name]  # None for a draft whose step times were not measured
        costs = ", ".join(f"{label} {cost[label]:.2f}x" for label in COMPARED if cost[label] is not None)
        lines.append(f"{name} ({comparison['prompt_sets'][name]['num_prompts']} prompts): acceptance length a {al['a']:.2f} | "
                     f"b {al['b']:.2f} | b - a {al['b_minus_a']:+.2f}" + (f" | tokens/s vs the target alone: {tps}" if tps else "")
                     + (f" | an iteration with the draft costs {costs} a target step" if costs else ""))
        turn_2 = (comparison.get("turn_2_acceptance_length") or {}).get(name)
        if turn_2 and turn_2["b_minus_a"] is not None:
            num = set_part(comparison["reports"]["a"], name)["turn_2"]["num_prompts"]
            lines.append(f"{name} turn 2 ({num} prompts): acceptance length a {turn_2['a']:.2f} | b {turn_2['b']:.2f} | "
                         f"b - a {turn_2['b_minus_a']:+.2f}")
    return lines
