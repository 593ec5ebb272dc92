"""05 beside a running 04 (common.core.run_folder.refuse_read_while_written): 05 refuses to start when a draft it
would measure lies under train/, which 04 replaces (its export) or deletes (--overwrite); a 05 already running
makes 04 --overwrite refuse instead. Both before vLLM starts, so no server here."""

from __future__ import annotations

import signal

from common.core.run_folder import Layout
from common.core.stage_lock import refuse_read_while_written
from common.evaluate import stage as evaluate
from tests.evaluate.test_evaluate import cli_config, eval_files, run_env, write_draft  # noqa: F401 (run_env: a fixture)
from tests.helpers import error_line, hold_lock, run_stage


def files_under(path) -> dict:
    return {p: p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_05_refuses_to_read_train_while_04_runs_and_04_overwrite_refuses_under_05(run_env, tmp_path):
    assert evaluate.run_stage(run_env.cfg) == 0  # a measured run: eval/ has outputs that a refused --overwrite keeps
    run, cfg = run_env.run, cli_config(run_env)
    best = write_draft(run / "train" / "best", b"fake weights v0", best_json={"step": 20})
    outside = write_draft(tmp_path / "published", b"someone else's weights")
    train_before, eval_before = files_under(run / "train"), eval_files(run)
    holder = hold_lock(run, "04_train")
    try:
        for args, read in [((), run_env.final), (("--draft", str(best)), best),
                           (("--compare", str(outside), str(run_env.final)), run_env.final)]:
            res = run_stage("05_evaluate.py", cfg, *args, "--overwrite", timeout=120)
            error_line(res, f"05_evaluate would read {read}, which 04_train is writing: 04_train is running on {run} "
                            f"(pid {holder.pid}); wait for it to finish")
            assert "vllm" not in res.stderr.lower(), args
        # a draft outside the run folder is not 04's to change: measured as usual
        layout = Layout(run)
        refuse_read_while_written(run, "05_evaluate", "04_train", layout.train, [outside])
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    assert files_under(run / "train") == train_before and eval_files(run) == eval_before

    # the other way round: 05 runs (holds its lock), 04 --overwrite would delete the draft it measures
    holder = hold_lock(run, "05_evaluate")
    try:
        res = run_stage("04_train.py", cfg, "--overwrite", timeout=120)
        error_line(res, f"04_train --overwrite would delete what 05_evaluate is reading: 05_evaluate is running on {run} "
                        f"(pid {holder.pid})")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    assert files_under(run / "train") == train_before
