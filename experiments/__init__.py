"""Experiments built on aspo_lit: the pre-registered CPU-scale study of the paper's training
dynamics (``study``: runs; ``report``: verdicts and the Markdown report). Nothing in ``aspo_lit``
imports this package; ``python -m aspo_lit study`` reaches it by name."""
