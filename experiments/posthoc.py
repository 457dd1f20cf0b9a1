"""Post-hoc statistics of a study's claims, beside (never instead of) its pre-registered verdicts.

The pre-registered rule (:mod:`experiments.claims`) says *supported / not supported /
inconclusive*; it does not say how large a difference the data exclude, it ignores that seeds
share the data order, and it applies no correction for the number of claims. This module adds,
per claim line, from the same per-seed values:

- the difference of means with its 95 % CI (Welch), and the **equivalence bound**: the smallest
  margin ±δ inside which TOST at α = 0.05 declares the two losses equivalent (the 90 % CI's
  farthest end from 0);
- the **paired-by-seed** analysis (seed *s* of both losses saw the same data order and sampling
  seed): the mean of the per-seed differences, its 95 % CI, the one-sided p-value in the claimed
  direction, its Holm adjustment over all the claim lines tested, and the paired TOST bound;
- for a heavy-tailed metric (claim 7's maximum grad norm): the same on log10 values, and the rank
  tests (Mann-Whitney U, exact; Wilcoxon signed-rank over the seed pairs, exact).

The values come from the study's page itself (its table "Per-seed values entering the verdicts"
and the per-run regime table: the numbers as printed, 3 significant figures), so the analysis can
be redone from the committed page: ``python -m experiments.posthoc docs/studies/study-v2.md``. The section
is written at the end of the page under :data:`HEADING`, followed by the study's hand-written
post-hoc notes (``<figures dir>/posthoc-notes.md``), and replaced on every run.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from experiments.claims import CLAIMS, Claim
from experiments.render import LABELS

HEADING = "## Post-hoc analyses (not pre-registered)"
ALPHA = 0.05
#: metrics whose per-seed values span orders of magnitude: analysed on log10 and by ranks too
HEAVY_TAILED = ("train/grad_norm",)
#: the per-run column of the regime table, and the claims it answers as a *change* over the run
#: (the claims say "falls faster"; their verdicts judge the final level)
DECLINE = "entropy decline"


@dataclass(frozen=True)
class Comparison:
    """``a - b`` (a: the loss the claim says is higher), unpaired and paired by seed."""

    n: int
    diff: float               # mean(a) - mean(b)
    ci95: tuple[float, float]  # Welch
    tost: float               # equivalence bound, Welch (90 % CI)
    paired_diff: float        # mean over seeds of a_s - b_s
    paired_ci95: tuple[float, float]
    paired_p: float           # one-sided, H1: mean(a_s - b_s) > 0
    paired_tost: float


def _t(q: float, df: float) -> float:
    from scipy.stats import t

    return float(t.ppf(q, df))


def welch(a: Sequence[float], b: Sequence[float]) -> tuple[float, float, float]:
    """(mean(a) - mean(b), its standard error, Welch-Satterthwaite degrees of freedom)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    va, vb = np.var(a, ddof=1) / len(a), np.var(b, ddof=1) / len(b)
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1)) if se > 0 else math.inf
    return float(a.mean() - b.mean()), se, float(df)


def tost_bound(diff: float, se: float, df: float, alpha: float = ALPHA) -> float:
    """The smallest δ for which both one-sided tests of TOST reject at ``alpha``: the data exclude
    any difference outside ±δ (the (1 - 2α) CI's end farthest from 0)."""
    return abs(diff) + _t(1 - alpha, df) * se


def compare(a: Sequence[float], b: Sequence[float]) -> Comparison:
    """Unpaired and paired statistics of ``a - b``; ``a[i]`` and ``b[i]`` are the same seed."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"need >= 2 seed pairs, got {len(a)} and {len(b)} values")
    diff, se, df = welch(a, b)
    d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    n = len(d)
    pse = float(np.std(d, ddof=1) / math.sqrt(n))
    pdiff = float(d.mean())
    if pse > 0:
        from scipy.stats import t

        p = float(t.sf(pdiff / pse, n - 1))
    else:
        p = 0.0 if pdiff > 0 else 1.0
    half, phalf = _t(0.975, df) * se, _t(0.975, n - 1) * pse
    return Comparison(n, diff, (diff - half, diff + half), tost_bound(diff, se, df),
                      pdiff, (pdiff - phalf, pdiff + phalf), p, tost_bound(pdiff, pse, n - 1))


def holm(p_values: Sequence[float], alpha: float = ALPHA) -> tuple[list[float], list[float]]:
    """Holm's step-down procedure: (adjusted p-values, the threshold each p must meet in its rank),
    both in the input's order. The smallest p must be <= alpha/m, the next <= alpha/(m-1), ..."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted, thresholds = [0.0] * m, [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i], thresholds[i] = running, alpha / (m - rank)
    return adjusted, thresholds


def rank_tests(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """One-sided exact p-values that ``a`` is larger: Mann-Whitney U (unpaired) and the Wilcoxon
    signed-rank test over the seed pairs."""
    from scipy.stats import mannwhitneyu, wilcoxon

    u = float(mannwhitneyu(a, b, alternative="greater", method="exact").pvalue)
    w = float(wilcoxon(np.asarray(a) - np.asarray(b), alternative="greater", method="exact").pvalue)
    return u, w


# ---------------------------------------------------------------------------------------------
# The page's own numbers


def _table_after(text: str, marker: str) -> list[list[str]]:
    """The rows (cells stripped) of the first Markdown table after the line containing ``marker``."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if marker in line), None)
    if start is None:
        raise ValueError(f"the page has no line with {marker!r}")
    rows, seen = [], False
    for line in lines[start + 1:]:
        if line.startswith("|"):
            seen = True
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(set(c) <= set(":-") for c in cells):
                rows.append(cells)
        elif seen:
            break
    if not rows:
        raise ValueError(f"no table after {marker!r}")
    return rows


def read_page(text: str) -> tuple[dict[tuple[str, str], list[float]], dict[str, list[float]]]:
    """From a study page: ``{(loss, column): per-seed values}`` of the table "Per-seed values entering
    the verdicts" (columns as headed there, e.g. ``train/entropy (final)``), and ``{loss: per-seed
    entropy decline}`` of the per-run regime table (runs ``<loss>_s<seed>``, seeds in order)."""
    by_label = {v: k for k, v in LABELS.items()}
    header, *rows = _table_after(text, "Per-seed values entering the verdicts")
    values = {}
    for row in rows:
        loss = by_label.get(row[0], row[0])
        for column, cell in zip(header[1:], row[1:], strict=True):
            values[(loss, column)] = [float(x) for x in cell.split(" / ")]
    header, *rows = _table_after(text, "Per run:")
    col = header.index(DECLINE)
    decline: dict[str, dict[int, float]] = {}
    for row in rows:
        loss, seed = re.fullmatch(r"(.+)_s(\d+)", row[0]).groups()
        decline.setdefault(loss, {})[int(seed)] = float(row[col])
    return values, {loss: [d[s] for s in sorted(d)] for loss, d in decline.items()}


def column_of(claim: Claim, columns: Sequence[str]) -> str:
    """The per-seed table's column of a claim's metric and statistic."""
    want = f"({'max' if claim.statistic == 'max' else 'final'})"
    for column in columns:
        name, stat = column.rsplit(" ", 1)
        if stat == want and (name == claim.metric or (claim.metric.startswith("val") and name.startswith("val/"))):
            return column
    raise KeyError(f"no per-seed column for claim {claim.id} ({claim.metric}, {claim.statistic})")


# ---------------------------------------------------------------------------------------------
# The section


def _g(x: float) -> str:
    return f"{x:.3g}" if math.isfinite(x) else "n/a"


def _ci(ci: tuple[float, float]) -> str:
    return f"[{_g(ci[0])}, {_g(ci[1])}]"


def _p(p: float) -> str:
    return f"{p:.2g}" if p >= 1e-3 else f"{p:.1e}"


def render(values: dict[tuple[str, str], list[float]], decline: dict[str, list[float]],
           claims: Sequence[Claim] = CLAIMS) -> list[str]:
    """The section's generated part: one table of every claim line, the holm thresholds, the
    entropy-decline reading of the "falls faster" claims, and the heavy-tailed claim on log10 and by ranks."""
    columns = sorted({c for _, c in values})
    tested = [c for c in claims if (c.higher, column_of(c, columns)) in values and (c.lower, column_of(c, columns)) in values]
    stats = {c.id: compare(values[(c.higher, column_of(c, columns))], values[(c.lower, column_of(c, columns))])
             for c in tested}
    adjusted, thresholds = holm([stats[c.id].paired_p for c in tested])
    n = len(tested)
    lines = [HEADING, "",
             "_Added after the verdicts (2026-12-05; `python -m experiments.posthoc`), from the per-seed values "
             "as printed above (3 significant figures). Nothing here changes a verdict line; every "
             "number below is post hoc._", "",
             f"**Claim lines tested: {n}**, judged by the pre-registered 2 × SE rule without a correction "
             f"for their number. At a family-wise α = {ALPHA} (Holm), the smallest of {n} one-sided "
             f"p-values must be ≤ {ALPHA}/{n} = {ALPHA / n:.4f}, the next ≤ {ALPHA}/{n - 1} = "
             f"{ALPHA / (n - 1):.4f}, and so on: the bound any future *supported* on this family must meet.", "",
             "Per claim line, the difference in the claimed direction (> 0: as the paper says). *Unpaired*: "
             "Welch's 95 % CI, and the equivalence bound ±δ (TOST, α = 0.05: the data exclude any "
             "difference beyond ±δ). *Paired by seed* (seed s of both losses shared the data order): the mean "
             "of the per-seed differences, its 95 % CI (t, n - 1 df), the one-sided p, Holm-adjusted over "
             f"the {n} lines, and the paired TOST bound.", ""]
    table = ["| claim | metric | difference | 95 % CI | TOST ±δ | paired mean | paired 95 % CI | one-sided p | Holm p | Holm threshold | paired TOST ±δ |",
             "|:--|:--|--:|:--|--:|--:|:--|--:|--:|--:|--:|"]
    for c, adj, thr in zip(tested, adjusted, thresholds, strict=True):
        s = stats[c.id]
        table.append(f"| ({c.id}) | {column_of(c, columns)} | {_g(s.diff)} | {_ci(s.ci95)} | {_g(s.tost)} | "
                     f"{_g(s.paired_diff)} | {_ci(s.paired_ci95)} | {_p(s.paired_p)} | {_p(adj)} | {thr:.4f} | "
                     f"{_g(s.paired_tost)} |")
    lines += table + [""]
    changes = [c for c in tested if c.metric == "train/entropy" and c.higher in decline and c.lower in decline]
    if changes:
        lines += ["**\"Falls faster\" as a change, not a level.** Claims " + ", ".join(f"({c.id})" for c in changes)
                  + " say GRPO's entropy *falls faster*; their verdicts judge the final level (the last-20 % mean). "
                  "The change itself, each run's entropy decline (first minus last 20 % of rollout batches, the "
                  "regime table's column), compared the same way (> 0: GRPO declined more, as claimed):", "",
                  "| claim | GRPO decline − other's | 95 % CI | TOST ±δ | paired mean | paired 95 % CI | one-sided p | paired TOST ±δ |",
                  "|:--|--:|:--|--:|--:|:--|--:|--:|"]
        for c in changes:
            s = compare(decline[c.lower], decline[c.higher])
            lines.append(f"| ({c.id}) | {_g(s.diff)} | {_ci(s.ci95)} | {_g(s.tost)} | {_g(s.paired_diff)} | "
                         f"{_ci(s.paired_ci95)} | {_p(s.paired_p)} | {_g(s.paired_tost)} |")
        lines.append("")
    for c in tested:
        if c.metric not in HEAVY_TAILED:
            continue
        a, b = values[(c.higher, column_of(c, columns))], values[(c.lower, column_of(c, columns))]
        s = compare(np.log10(a).tolist(), np.log10(b).tolist())
        u, w = rank_tests(a, b)
        wins = sum(x > y for x, y in zip(a, b, strict=True))
        lines += [f"**Claim ({c.id}) on a log scale and by ranks.** Its metric is a maximum with a heavy tail "
                  f"(one seed's {_g(max(a))} against a median of {_g(float(np.median(a)))}), which a mean/SD rule "
                  f"reads as noise. On log10 values the difference is {_g(s.diff)} decades (95 % CI {_ci(s.ci95)}; "
                  f"paired {_g(s.paired_diff)}, {_ci(s.paired_ci95)}, one-sided p {_p(s.paired_p)}). By ranks: "
                  f"{LABELS.get(c.higher, c.higher)} was above {LABELS.get(c.lower, c.lower)} in {wins} of "
                  f"{len(a)} seed pairs; Mann-Whitney U one-sided exact p = {_p(u)}, Wilcoxon signed-rank "
                  f"one-sided exact p = {_p(w)} (the smallest p a {len(a)}-pair signed-rank test can give is "
                  f"{_p(0.5 ** len(a))}).", ""]
    return lines


def write_section(page: Path, notes: Path | None = None) -> Path:
    """Replace (or add) the post-hoc section at the end of ``page``: the generated part, then the notes."""
    text = page.read_text()
    head = text.split("\n" + HEADING, 1)[0].rstrip("\n") + "\n"
    values, decline = read_page(head)
    section = render(values, decline)
    if notes is not None and notes.is_file():
        section += [notes.read_text().rstrip("\n"), ""]
    page.write_text(head + "\n" + "\n".join(section))
    return page


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.posthoc", description=__doc__.split("\n\n")[0])
    parser.add_argument("page", type=Path, help="a study page, e.g. docs/studies/study-v2.md")
    parser.add_argument("--notes", type=Path, default=None,
                        help="hand-written post-hoc notes appended to the section (default: <page stem>/posthoc-notes.md)")
    args = parser.parse_args(argv)
    notes = args.notes or args.page.with_suffix("") / "posthoc-notes.md"
    print(f"[posthoc] {write_section(args.page, notes)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
