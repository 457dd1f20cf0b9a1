"""Tasks: what the math, code and testbed runs differ in (their rows, prompt, reward and domain),
each a small class a DataModule and an offline evaluation build alike (`base.Task`)."""
