"""Stage 05: the draft served by vLLM, measured against the target alone and against 04's prediction."""
