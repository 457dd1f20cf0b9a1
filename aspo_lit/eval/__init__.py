"""Evaluation: the benchmarks (``datasets``), multiple-choice prompts and grading (``choice``),
avg@K / pass@K of a model (``evaluate``), the Table 1-3 commands (``table_commands``), and the
tables beside the paper's (``tables``)."""
