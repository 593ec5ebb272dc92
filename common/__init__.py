"""Shared building blocks of the EAGLE-3 draft training pipeline."""
