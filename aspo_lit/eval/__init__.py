"""Evaluation: the benchmarks (``datasets``), multiple-choice prompts and grading (``choice``),
avg@K / pass@K of a model and the Table 1-3 runs (``evaluate``), and the tables beside the
paper's (``tables``)."""
