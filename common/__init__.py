"""The pipeline's code: one package per stage over shared packages (docs/design.md#package-map)."""
