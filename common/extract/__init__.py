"""Stage 02: the target's aux and final hidden states, through transformers or vLLM."""
