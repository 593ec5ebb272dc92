"""run_pipeline.py's closing summary reports a vLLM measurement only for the draft now in train/final
(`run_pipeline --stop-after 04_train` after training a new draft must not print the previous draft's
"measured in vLLM" line). The summary is the same code whatever stage the run stops after, so the test
stops after 01_prepare_data (seconds, no server) on a run folder whose eval/report.json measured other
weights than train/final's, then on one whose report measured the very weights in train/final.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO, stage_env, write_yaml


def report_of(weights: bytes) -> dict:
    """What format_summary reads of a 05 report, for a draft with these weights."""
    runs = {"tokens_per_s_runs": [10.0, 10.0, 10.0]}
    return {"draft_sha256": hashlib.sha256(weights).hexdigest(), "acceptance_length": 2.5, "num_speculative_tokens": 3,
            "per_position_acceptance": [0.8, 0.5, 0.2],
            "throughput": {"speedup": 1.7, "speedup_range": [1.6, 1.8], "verdict": "faster", "with_draft": runs,
                           "without_draft": runs},
            "step_times": {"measured": False}, "outputs": {"identical": 4, "compared": 4}, "prompt_sets": {}}


def run_pipeline_until_01(tmp_path: Path) -> subprocess.CompletedProcess:
    (tmp_path / "target").mkdir(exist_ok=True)
    cfg = write_yaml(tmp_path / "run.yaml", {"run_dir": str(tmp_path / "run"), "target": {"model": str(tmp_path / "target")},
                                             "data": {"source": str(REPO / "data" / "sample_prompts.jsonl"), "max_samples": 20}})
    return subprocess.run([sys.executable, str(REPO / "run_pipeline.py"), "--config", str(cfg), "--stop-after", "01_prepare_data"],
                          cwd=REPO, env=stage_env(), capture_output=True, text=True, timeout=300)


def test_summary_reports_a_measurement_only_of_the_draft_now_in_train_final(tmp_path):
    run = tmp_path / "run"
    final = run / "train" / "final"
    final.mkdir(parents=True)
    (final / "model.safetensors").write_bytes(b"the new draft, trained after the last 05")
    (run / "eval").mkdir()
    (run / "eval" / "report.json").write_text(json.dumps(report_of(b"the previous draft")))

    res = run_pipeline_until_01(tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "pipeline stopped after 01_prepare_data" in res.stdout
    assert "measured in vLLM" not in res.stdout
    assert f"{run / 'eval' / 'report.json'} did not measure the draft now in {final}" in res.stdout

    # The report of the very weights in train/final (at whatever path 05 was given them) is reported.
    (run / "eval" / "report.json").write_text(json.dumps(report_of((final / "model.safetensors").read_bytes())))
    res = run_pipeline_until_01(tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "measured in vLLM: acceptance length 2.50 (k=3) | per-position 0.80/0.50/0.20 | 1.70x tokens/s" in res.stdout
    assert "did not measure" not in res.stdout
