"""Stage 03: the draft vocabulary chosen from the training data."""
