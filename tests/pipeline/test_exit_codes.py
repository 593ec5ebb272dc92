"""run_pipeline's exit code for a failed stage is the stage's own (130 when the stage was interrupted, 2 for its
one-line error), and 128 + N for a stage killed by signal N, as a shell reports it."""

import signal

from run_pipeline import exit_code_of


def test_a_stage_exit_code_passes_through():
    assert exit_code_of(130) == 130  # an interrupted stage: the pipeline reports the interruption, not a failure
    assert exit_code_of(2) == 2
    assert exit_code_of(1) == 1


def test_a_stage_killed_by_a_signal_exits_like_a_shell_reports_it():
    assert exit_code_of(-signal.SIGKILL) == 128 + 9
    assert exit_code_of(-signal.SIGTERM) == 128 + 15
    assert exit_code_of(0) == 1  # a "failed" stage with exit 0 is still a failure
