"""Stage 04: training the draft with training-time test, checkpoints, offline evaluation, export."""
