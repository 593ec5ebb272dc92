"""The evaluation figure: what vLLM accepted per draft position, and how training went.

    plot_report(report, "run/train/metrics.jsonl", "run/eval/report.png")

Left: per-position acceptance rate measured in vLLM on the held-out prompts and on the other-kind
prompts (when 05 measured them), next to the offline prediction (04's replay of vLLM's rounds,
common.model.acceptance). Middle: training loss.
Right: per-step accuracy over training. Rendered with matplotlib's Agg backend (no display).
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


def plot_report(report: dict, metrics_path: str | Path, out_path: str | Path) -> Path:
    """Write the figure atomically to out_path (PNG) and return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = training_curves(metrics_path)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))

    # 1) per-position acceptance in vLLM (held-out, other-kind prompts) vs its offline prediction
    ax = axes[0]
    rates = report.get("per_position_acceptance") or []
    other = report.get("other_prompts") or {}
    offline = _offline_per_position(report)
    series = [(f"vLLM, held-out (AL {report['acceptance_length']:.2f})" if isinstance(report.get("acceptance_length"), (int, float))
               else "vLLM, held-out", rates, "tab:blue")]
    if other.get("per_position_acceptance"):
        series.append((f"vLLM, other-kind prompts (AL {other['acceptance_length']:.2f})", other["per_position_acceptance"], "tab:green"))
    if offline:
        kind = (report.get("offline") or {}).get("prediction", "offline")
        step = (report.get("offline") or {}).get("step")  # the draft's own step (05's offline_prediction)
        series.append((f"offline prediction ({kind}{'' if step is None else f' at step {step}'}, held-out split)",
                       offline, "tab:orange"))
    width = 0.8 / len(series)
    for j, (label, values, color) in enumerate(series):
        xs = [p - 0.4 + width * (j + 0.5) for p in range(len(values))]
        bars = ax.bar(xs, values, width=width, label=label, color=color, alpha=0.9 if j == 0 else 0.8)
        for bar, r in zip(bars, values):
            ax.text(bar.get_x() + bar.get_width() / 2, r + 0.01, f"{r:.2f}", ha="center", va="bottom", fontsize=7)
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

    fig.tight_layout()
    out_path = Path(out_path)
    with atomic_path(out_path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    return out_path
