"""The evaluation figures: what vLLM accepted per draft position, and how training went.

    plot_report(report, "run/train/metrics.jsonl", "run/eval/report.png")
    plot_compare(comparison, "run/eval/compare/report.png")          # 05 --compare

plot_report, top left: per-position acceptance rate measured in vLLM, one group of bars per prompt set
(the held-out prompts, then evaluate.other_prompts and evaluate.prompt_sets, each set's turn 2 after it), next to the offline
prediction (04's replay of vLLM's rounds, common.model.acceptance). Top right: output tokens/s per set
with and without the draft. Middle: acceptance length per prompt set (and turn 2), with 04's prediction on the
measured prompts and on its eval split; acceptance length per context-length bucket of each long-context set.
Bottom: training loss, and per-step accuracy over training.
plot_compare: acceptance length per set for both drafts, their per-position acceptance, and their
tokens/s speedups. Rendered with matplotlib's Agg backend (no display).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from common.core.io import atomic_path, iter_jsonl


def training_curves(metrics_path: str | Path) -> dict:
    """train/metrics.jsonl -> {"train"|"eval": {"loss": [(step, v)], "acc": {i: [(step, v)]}}}.

    04_train.py writes {"type": "train"|"eval", "step", "loss", "step_acc": [...]} rows. A missing
    file gives empty curves; a torn last line (training still running) is ignored.
    """
    curves = {s: {"loss": [], "acc": {}} for s in ("train", "eval")}
    path = Path(metrics_path)
    if not path.is_file():
        return curves
    for row in iter_jsonl(path, tolerate_torn_tail=True, strict=False):
        split, step = row.get("type"), row.get("step")
        if split not in curves or not isinstance(step, (int, float)):
            continue
        if isinstance(row.get("loss"), (int, float)):
            curves[split]["loss"].append((step, float(row["loss"])))
        for i, value in enumerate(row.get("step_acc") or []):
            curves[split]["acc"].setdefault(i, []).append((step, float(value)))
    return curves


def _offline_per_position(report: dict) -> Optional[list[float]]:
    expected = (report.get("offline") or {}).get("expected_per_position")
    return [float(a) for a in expected] if expected else None


def _prompt_sets(report: dict) -> dict[str, dict]:
    """The report's prompt sets besides the held-out one."""
    return report["prompt_sets"]


def _bars(ax, series: list[tuple[str, list[float], str]], fmt: str = "{:.2f}") -> None:
    """Grouped bars: series of (label, values, color), one bar per value, the values written on top."""
    width = 0.8 / max(1, len(series))
    for j, (label, values, color) in enumerate(series):
        xs = [p - 0.4 + width * (j + 0.5) for p in range(len(values))]
        bars = ax.bar(xs, values, width=width, label=label, color=color, alpha=0.9 if j == 0 else 0.8)
        for bar, r in zip(bars, values):
            ax.text(bar.get_x() + bar.get_width() / 2, r, fmt.format(r), ha="center", va="bottom", fontsize=7)


def _color(i: int) -> str:
    return f"C{i % 10}"


def _save(fig, out_path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out_path = Path(out_path)
    with atomic_path(out_path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    return out_path


def plot_report(report: dict, metrics_path: str | Path, out_path: str | Path) -> Path:
    """Write the figure atomically to out_path (PNG) and return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = training_curves(metrics_path)
    fig, grid = plt.subplots(3, 2, figsize=(14, 12.6))
    axes = [grid[0][0], grid[2][0], grid[2][1], grid[0][1]]
    acceptance_per_set(grid[1][0], report)
    acceptance_per_bucket(grid[1][1], report)

    # 1) per-position acceptance in vLLM, one group per prompt set, vs the offline prediction
    ax = axes[0]
    rates = report.get("per_position_acceptance") or []
    offline = _offline_per_position(report)
    series = [(f"vLLM, held-out (AL {report['acceptance_length']:.2f})" if isinstance(report.get("acceptance_length"), (int, float))
               else "vLLM, held-out", rates, _color(0))]
    turns = [(label, p) for name, part in _prompt_sets(report).items()
             for label, p in ((name, part), (f"{name} turn 2", part.get("turn_2") or {}))]
    for i, (name, part) in enumerate(turns, start=2):
        if part.get("per_position_acceptance"):
            series.append((f"vLLM, {name} (AL {part['acceptance_length']:.2f})", part["per_position_acceptance"], _color(i)))
    if offline:
        kind = (report.get("offline") or {}).get("prediction", "offline")
        step = (report.get("offline") or {}).get("step")  # the draft's own step (05's offline_prediction)
        series.append((f"offline prediction ({kind}{'' if step is None else f' at step {step}'}, held-out split)",
                       offline, _color(1)))
    _bars(ax, series)
    ax.set_xticks(range(max(len(v) for _, v, _ in series) if any(v for _, v, _ in series) else 0))
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    al = report.get("acceptance_length")
    title = f"acceptance length {al:.2f} (k={report.get('num_speculative_tokens')})" if isinstance(al, (int, float)) else "acceptance"
    offline_al = (report.get("offline") or {}).get("expected_acceptance_length")
    if isinstance(offline_al, (int, float)):
        title += f", predicted {offline_al:.2f}"
    ax.set_title(title)
    ax.legend(fontsize=8)

    # 4) tokens/s per prompt set, with and without the draft
    ax = axes[3]
    parts = {"held-out": report, **_prompt_sets(report)}
    parts = {name: part["throughput"] for name, part in parts.items() if isinstance(part.get("throughput"), dict)}
    if parts:
        _bars(ax, [(side.replace("_", " "), [(tp.get(side) or {}).get("tokens_per_s") or 0.0 for tp in parts.values()], _color(c))
                   for side, c in (("with_draft", 0), ("without_draft", 7))], "{:.1f}")
        ax.set_xticks(range(len(parts)), [f"{name}\n{tp['speedup']:.2f}x" if tp.get("speedup") else name
                                          for name, tp in parts.items()], fontsize=8)
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no throughput in the report", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylabel("output tokens/s")
    ax.set_title("tokens/s per prompt set (speedup under the name)")

    # 2) loss
    ax = axes[1]
    for split, style in (("train", "-"), ("eval", "o--")):
        pts = curves[split]["loss"]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{split} loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("training loss")
    if curves["train"]["loss"] or curves["eval"]["loss"]:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no train/metrics.jsonl", ha="center", va="center", transform=ax.transAxes)

    # 3) per-step accuracy
    ax = axes[2]
    cmap = plt.get_cmap("viridis")
    any_acc = False
    for split, style in (("train", "-"), ("eval", "o--")):
        accs = curves[split]["acc"]
        for i in sorted(accs):
            pts = accs[i]
            color = cmap(i / max(1, len(accs) - 1) * 0.9)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, label=f"{split} acc step {i}")
            any_acc = True
    ax.set_xlabel("step")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1.05)
    ax.set_title("per-step accuracy (teacher-forced)")
    if any_acc:
        ax.legend(fontsize=7, ncol=2)
    else:
        ax.text(0.5, 0.5, "no accuracy in train/metrics.jsonl", ha="center", va="center", transform=ax.transAxes)
    return _save(fig, out_path)


def acceptance_per_set(ax, report: dict) -> None:
    """Acceptance length per prompt set (each set's turn 2 after it), and 04's predictions for the held-out prompts."""
    by_set = {name: al for name, al in (report.get("acceptance_length_by_set") or {}).items() if isinstance(al, (int, float))}
    _bars(ax, [("measured in vLLM", list(by_set.values()), _color(0))])
    for what, key, style in (("04's prediction on these prompts", "offline_on_measured_prompts", "-"),
                             ("04's prediction on its eval split", "offline", ":")):
        predicted = (report.get(key) or {}).get("expected_acceptance_length")
        if isinstance(predicted, (int, float)):
            ax.axhline(predicted, color=_color(1), linestyle=style, linewidth=1, label=f"{what} ({predicted:.2f})")
    ax.set_xticks(range(len(by_set)), [n.replace(" turn 2", "\nturn 2") for n in by_set], fontsize=8)
    ax.set_ylabel("acceptance length")
    ax.set_title("acceptance length per prompt set")
    ax.legend(fontsize=8)


def acceptance_per_bucket(ax, report: dict) -> None:
    """Acceptance length per context-length bucket, one line per long-context set (x: the bucket's longest prompt)."""
    sets = {name: part["buckets"] for name, part in _prompt_sets(report).items() if part.get("buckets")}
    if not sets:
        ax.text(0.5, 0.5, "no long-context prompt set", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    for i, (name, buckets) in enumerate(sets.items()):
        points = [(b["prompt_tokens"][1], b["acceptance_length"]) for b in buckets.values() if b["acceptance_length"] is not None]
        ax.plot([x for x, _ in points], [y for _, y in points], "o-", color=_color(i + 2), label=name)
        for x, y in points:
            ax.text(x, y, f"{y:.2f}", ha="center", va="bottom", fontsize=7)
    held_out = report.get("acceptance_length")
    if isinstance(held_out, (int, float)):
        ax.axhline(held_out, color=_color(0), linestyle="--", linewidth=1, label=f"held-out ({held_out:.2f})")
    ax.set_xscale("log", base=2)
    ticks = sorted({b["max_prompt_tokens"] for buckets in sets.values() for b in buckets.values()})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("prompt length in tokens (each bucket's longest prompt; ticks: the buckets' bounds)")
    ax.set_ylabel("acceptance length")
    ax.set_title("acceptance length per context length")
    ax.legend(fontsize=8)


def plot_compare(comparison: dict, out_path: str | Path) -> Path:
    """05 --compare's figure (eval/compare/report.png): the two drafts on every prompt set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(comparison["drafts"])
    names = list(comparison["acceptance_length"])
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))

    ax = axes[0]
    _bars(ax, [(f"{label}: {'/'.join(Path(comparison['drafts'][label]).parts[-3:])}",
                [comparison["acceptance_length"][n][label] for n in names], _color(i)) for i, label in enumerate(labels)])
    ax.set_xticks(range(len(names)), [f"{n}\nb - a {comparison['acceptance_length'][n]['b_minus_a']:+.2f}" for n in names], fontsize=8)
    ax.set_ylabel("acceptance length")
    ax.set_title(f"acceptance length per prompt set (k={comparison['num_speculative_tokens']})")
    ax.legend(fontsize=8)

    ax = axes[1]
    for j, n in enumerate(names):
        for i, label in enumerate(labels):
            rates = comparison["per_position_acceptance"][n][label]
            ax.plot(range(len(rates)), rates, "o-" if i == 0 else "s--", color=_color(j + 2), label=f"{n}, {label}")
    ax.set_xticks(range(comparison["num_speculative_tokens"]))
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    ax.set_title("per-position acceptance (a solid, b dashed)")
    ax.legend(fontsize=7, ncol=2)

    ax = axes[2]
    _bars(ax, [(label, [comparison["speedup"][n][label] or 0.0 for n in names], _color(i)) for i, label in enumerate(labels)], "{:.2f}x")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_ylabel("tokens/s with the draft / target alone")
    ax.set_title("speedup per prompt set")
    ax.legend(fontsize=8)
    return _save(fig, out_path)
