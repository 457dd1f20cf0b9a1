"""aspo-lit: ASPO and the GRPO baselines on PyTorch Lightning (see README.md, docs/design.md)."""

__version__ = "0.1.0"
