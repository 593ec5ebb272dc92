"""The EAGLE-3 draft: model, TTT loss, acceptance arithmetic, and the file formats vLLM and 04 read."""
