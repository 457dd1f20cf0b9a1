"""Speed and memory measurements, one module each: ``python -m tools.perf.<name> --help``."""
