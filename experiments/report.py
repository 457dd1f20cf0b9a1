"""The study's report: collect the runs' results, judge the pre-registered claims, draw the
figures and write the page (docs/studies/study-protocol.md; v2: docs/studies/study-protocol-v2.md).

The pieces: :mod:`experiments.results` (the runs' metrics in a DataFrame), :mod:`experiments.claims`
(the claims and the 2 x pooled-SE decision rule), :mod:`experiments.render` (the figures and the
Markdown page); this module composes them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from experiments.claims import judge
from experiments.posthoc import write_section
from experiments.render import MECHANISM_PANELS, copy_fig4, plot_overlays, render_report
from experiments.results import collect

if TYPE_CHECKING:
    from experiments.study import Study


def write_report(study: Study, echo=print) -> Path:
    """Collect ``study``'s runs, draw the figures beside its page, write the page, and echo one line per claim."""
    results = collect(study)
    figures: dict[str, Path] = {}
    study.figures_dir.mkdir(parents=True, exist_ok=True)
    if len(results.metrics):
        figures["overlays"] = plot_overlays(results, study.figures_dir / "figure2_overlays.png")
        if (results.metrics["metric"] == MECHANISM_PANELS[0][0]).any():
            figures["mechanism"] = plot_overlays(
                results, study.figures_dir / "entropy_mechanism.png", MECHANISM_PANELS, (1, 4),
                f"{study.name}: entropy mechanism per loss, mean ± 1 std over seeds {study.seeds} (EMA {study.smooth:g})")
    figures.update({f"fig4_{k}": v for k, v in copy_fig4(results, study.figures_dir).items()})
    study.report.parent.mkdir(parents=True, exist_ok=True)
    study.report.write_text(render_report(results, figures))
    notes = study.figures_dir / "posthoc-notes.md"
    if notes.is_file():  # a study analysed after its verdicts keeps that section (experiments.posthoc)
        write_section(study.report, notes)
    echo(f"[study] report: {study.report}")
    for claim, v in judge(results):
        echo(f"[study]   ({claim.id}) {v.verdict:<13} {claim.text}")
    return study.report
