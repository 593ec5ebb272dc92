"""Stages 01 (prepare the prompts) and 01b (generate the answers with the target)."""
