"""The hidden-state shard format: stage 02 writes it, stage 04 reads it (shards.py)."""
