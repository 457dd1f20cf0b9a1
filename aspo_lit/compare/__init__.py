"""A run against a reference (docs/compare.md): the commands (`commands`), a reference file and the
test of a run against it (`run_reference`), and a run as its log folder holds it (`runlog`)."""
