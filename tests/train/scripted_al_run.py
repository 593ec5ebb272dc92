"""04 (run_training) with the replayed acceptance length of each eval forced to a scripted value, so that
the best checkpoint's step is known: `python tests/train/scripted_al_run.py CONFIG '{"10": 2.0, ...}'`.
Only replay[k]["acceptance_length"] at k = evaluate.num_speculative_tokens changes; every other figure
of the eval is the real one. Used by tests/train/test_best_checkpoint.py (also in a subprocess, to be
SIGKILLed)."""

from __future__ import annotations

import json
import sys


def install(scripted: dict) -> None:
    """Patch common.train.progress.evaluate: the eval at step s reports scripted[str(s)] when listed."""
    import common.train.progress as progress_mod

    real = progress_mod.evaluate
    steps = {"now": None}
    original_step = progress_mod.Progress.evaluate

    def progress_evaluate(self, loss, index, reader, step):
        steps["now"] = step
        return original_step(self, loss, index, reader, step)

    def evaluate(loss, index, reader, cfg, env):
        report = real(loss, index, reader, cfg, env)
        value = scripted.get(str(steps["now"]))
        if report is not None and value is not None:
            k = str(min(cfg.evaluate.num_speculative_tokens, cfg.train.ttt_steps))
            report["replay"][k]["acceptance_length"] = float(value)
        return report

    progress_mod.evaluate = evaluate
    progress_mod.Progress.evaluate = progress_evaluate


def main(config_path: str, scripted: dict) -> int:
    from common.core.config import load_config
    from common.train.trainer import run_training

    install(scripted)
    return run_training(load_config(config_path))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], json.loads(sys.argv[2])))
