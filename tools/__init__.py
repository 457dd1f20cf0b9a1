"""The developer's tools, run from a checkout's root (``python -m tools.<name>``); not in the wheel.

gpu_check (make gpu-check), ci_durations (a CI log's phases per test file), perf/ (speed and memory
measurements: ``python -m tools.perf.<name>``, make bench), rehearsal/ (make rehearse), and the
helpers they share with the tests: char_tokenizer, fixed_rollouts, ports.
"""
