"""Row filters declared in the config: which upstream rows a source keeps (paper §7.1, Appendix B:
"all datasets are cleaned and filtered following the preprocessing protocol of [35]").

A filter reads the raw upstream row (field paths as in `aspo_lit.data.fields.field_value`) before
the row is converted, so a row it drops is never checked or used. Each one has a ``name``: the
kept/dropped counts are logged and exported per source and per filter under that name
(``data/<split>/<source>/filter/<name>``). Name one in YAML by ``class_path``:

    filters:
      - class_path: aspo_lit.data.filters.FieldRange     # Skywork-OR1's difficulty filter (1.5B)
        init_args: {field: extra_info.model_difficulty.DeepSeek-R1-Distill-Qwen-1.5B, min: 1, max: 15, name: difficulty}

A filter that needs the policy's own rollouts (a pass rate measured now) cannot run while the
config loads; the published per-model difficulty fields are what these read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aspo_lit.data.fields import MISSING, field_value


class RowFilter:
    """Keeps a row or not; subclasses implement `keep`."""

    def __init__(self, name: str) -> None:
        if not name:
            raise ValueError("a row filter needs a non-empty name")
        self.name = name

    def keep(self, row: Mapping[str, Any]) -> bool:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class FieldRange(RowFilter):
    """Keeps rows whose `field` lies in ``[min, max]`` (both inclusive, either may be omitted).

    Numbers compare as numbers; strings compare as strings, so ISO dates work
    (``contest_date`` in ``["2024-08-01", "2025-02-01"]`` keeps 2024-08-01T00:00:00 and drops
    2025-02-01T00:00:00, which sorts after ``"2025-02-01"``). A row without the field, or with a
    value of the other kind, is dropped.
    """

    def __init__(self, field: str, min: float | str | None = None, max: float | str | None = None,
                 name: str | None = None) -> None:
        super().__init__(name or field)
        if min is None and max is None:
            raise ValueError(f"filter {self.name!r}: give min, max or both")
        bounds = [b for b in (min, max) if b is not None]
        if len({isinstance(b, str) for b in bounds}) > 1:
            raise ValueError(f"filter {self.name!r}: min and max must both be numbers or both strings")
        self.field, self.min, self.max = field, min, max

    def keep(self, row: Mapping[str, Any]) -> bool:
        value = field_value(row, self.field)
        want_str = isinstance(self.min if self.min is not None else self.max, str)
        if isinstance(value, bool) or (isinstance(value, str) != want_str):
            return False
        if not want_str and not isinstance(value, (int, float)):
            return False
        return (self.min is None or value >= self.min) and (self.max is None or value <= self.max)


class FieldIn(RowFilter):
    """Keeps rows whose `field` equals one of `values` (a missing field counts as null).

    E.g. CodeForces problems the execution reward can grade: ``input_mode`` in ``[stdio]``,
    ``generated_checker`` in ``[null]`` (exact-output problems), ``interaction_format`` in
    ``[null, ""]`` (not interactive).
    """

    def __init__(self, field: str, values: list[Any], name: str | None = None) -> None:
        super().__init__(name or field)
        if not values:
            raise ValueError(f"filter {self.name!r}: values must not be empty")
        self.field, self.values = field, list(values)

    def keep(self, row: Mapping[str, Any]) -> bool:
        value = field_value(row, self.field)
        value = None if value is MISSING else value
        return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in self.values)
