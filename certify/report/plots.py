"""The HTML report's figures, drawn with matplotlib (Agg) as SVG text.

Every figure is a pure function of its data and renders to the same bytes on every machine with the
same matplotlib: text stays text (``svg.fonttype: none``), element ids come from a fixed salt, and the
SVG carries no date or creator metadata. Tick labels are plain text rather than mathtext, which is
both faster and readable in any browser.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib import colors  # noqa: E402
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator  # noqa: E402
from scipy.stats import beta  # noqa: E402

STYLE = {"svg.hashsalt": "certify-report", "svg.fonttype": "none", "font.family": "DejaVu Sans",
         "font.size": 9, "axes.titlesize": 10, "figure.dpi": 72}
MARGIN_FLOOR = 1e-3     # fractions of a band below this draw at the floor of the colour scale
CERTIFIED = "#3b8f5a"
NOT_CERTIFIED = "#c0392b"


def _svg(fig) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None}, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _plain_log(axis, lo: float, hi: float) -> None:
    """Decade ticks written as plain numbers on a log axis."""
    decades = [10.0 ** k for k in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)]
    axis.set_major_locator(FixedLocator(decades))
    axis.set_minor_locator(NullLocator())
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))


def margin_heatmap(ops: list[str], archs: list[str], worst: dict[tuple[str, str], float | None],
                   text: dict[tuple[str, str], str]) -> str:
    """Op x arch: the colour is the worst certified measured error as a fraction of its band (red
    past 1: outside the band), grey where the op has no target on the arch; each square names
    certified/targets."""
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(archs), 0.8 + 0.28 * len(ops)))
        cmap = plt.get_cmap("viridis").with_extremes(over="#c0392b", bad="#dddddd")
        grid = [[worst.get((o, a)) for a in archs] for o in ops]
        data = [[math.nan if v is None else max(v, MARGIN_FLOOR) for v in row] for row in grid]
        norm = colors.LogNorm(vmin=MARGIN_FLOOR, vmax=1.0)
        im = ax.imshow(data, cmap=cmap, norm=norm, aspect="auto")
        for i, o in enumerate(ops):
            for j, a in enumerate(archs):
                label = text.get((o, a), "-")
                v = grid[i][j]
                light = v is not None and (v > 1 or norm(max(v, MARGIN_FLOOR)) < 0.6)
                ax.text(j, i, label, ha="center", va="center", fontsize=7,
                        color="white" if light else "black")
        ax.set_xticks(range(len(archs)), archs)
        ax.set_yticks(range(len(ops)), ops)
        ax.xaxis.tick_top()
        bar = fig.colorbar(im, ax=ax, extend="max", fraction=0.05)
        bar.set_label("worst measured error / band")
        _plain_log(bar.ax.yaxis, MARGIN_FLOOR, 1.0)
        return _svg(fig)


@dataclass(frozen=True)
class Bar:
    label: str          # "variant / cell"
    arch: str
    fraction: float     # measured / band of the output nearest its band; 0 for a bitwise match
    certified: bool


def band_bars(title: str, bars: list[Bar]) -> str:
    """One horizontal bar per (variant, cell, arch): measured error as a fraction of its band, on a
    log axis with the band at 1."""
    with plt.rc_context(STYLE):
        labels = list(dict.fromkeys(b.label for b in bars))
        archs = list(dict.fromkeys(b.arch for b in bars))
        h = 0.8 / max(1, len(archs))
        fig, ax = plt.subplots(figsize=(7.5, 0.9 + 0.22 * len(labels) * max(1, len(archs))))
        shades = plt.get_cmap("tab10")
        for k, arch in enumerate(archs):
            ys, xs, edge = [], [], []
            for b in bars:
                if b.arch == arch:
                    ys.append(labels.index(b.label) + (k - (len(archs) - 1) / 2) * h)
                    xs.append(max(b.fraction, MARGIN_FLOOR))
                    edge.append(CERTIFIED if b.certified else NOT_CERTIFIED)
            ax.barh(ys, xs, height=h * 0.9, color=shades(k), edgecolor=edge, linewidth=1.2,
                    label=arch)
        hi = max([2.0] + [b.fraction * 1.5 for b in bars if math.isfinite(b.fraction)])
        ax.set_xscale("log")
        ax.set_xlim(MARGIN_FLOOR, hi)
        _plain_log(ax.xaxis, MARGIN_FLOOR, hi)
        ax.axvline(1.0, color=NOT_CERTIFIED, linestyle="--", linewidth=1)
        ax.set_yticks(range(len(labels)), labels)
        ax.invert_yaxis()
        ax.set_xlabel(f"measured error / band (bitwise and below {MARGIN_FLOOR:g} drawn at "
                      f"{MARGIN_FLOOR:g}; the band is the dashed line)")
        ax.set_title(title)
        ax.legend(loc="lower right", fontsize=7)
        return _svg(fig)


@dataclass(frozen=True)
class AxisRow:
    axis: str
    reached: tuple[int, int] | None     # (min, max) over the scenarios; None: not reached
    cells: tuple[int, ...]              # the cells' values of the axis


def reach_axes(title: str, rows: list[AxisRow]) -> str:
    """Per integer axis: the range the scenarios reach (a bar) against the cells' values (dots)."""
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(len(rows), 1, figsize=(7.5, 0.4 + 0.62 * len(rows)), squeeze=False)
        for ax, row in zip(axes[:, 0], rows):
            values = [*row.cells, *(row.reached or ())]
            lo, hi = min(values), max(values)
            log = lo >= 1 and hi / lo >= 16
            if row.reached is not None:
                ax.plot(row.reached, [0, 0], color="#4878a8", linewidth=7, solid_capstyle="butt",
                        label="reached")
            ax.plot(row.cells, [0] * len(row.cells), "o", color="#e08a1e", label="cells")
            if log:
                ax.set_xscale("log")
                _plain_log(ax.xaxis, lo, hi)
            pad = (hi - lo) * 0.05 or 1
            ax.set_xlim(lo / 1.3 if log else lo - pad, hi * 1.3 if log else hi + pad)
            ax.set_yticks([0], [row.axis])
            ax.set_ylim(-1, 1)
            for side in ("top", "right", "left"):
                ax.spines[side].set_visible(False)
        axes[0, 0].set_title(title)
        axes[0, 0].legend(loc="lower right", fontsize=7, ncol=2, bbox_to_anchor=(1, 1.0))
        fig.subplots_adjust(hspace=1.2)
        return _svg(fig)


def risk_curve(points: list[tuple[float, float, float]], budget: float) -> str:
    """The pre-merge list as its budget shrinks: (budget s, cost s, share of all risk covered)."""
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(6.5, 3.2))
        xs = [p[0] for p in points]
        ax.plot(xs, [p[2] for p in points], "o-", color="#3b8f5a", label="risk covered")
        ax.axvline(budget, color="#888888", linestyle=":", linewidth=1, label="the budget")
        ax.set_xlabel("pre-merge budget (s of CI time)")
        ax.set_ylabel("share of all risk covered")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
        ax.set_title("What the pre-merge list keeps as its budget shrinks")
        return _svg(fig)


def clopper_pearson(successes: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """The exact two-sided interval of a binomial proportion."""
    a = (1 - level) / 2
    lo = 0.0 if successes == 0 else float(beta.ppf(a, successes, n - successes + 1))
    hi = 1.0 if successes == n else float(beta.ppf(1 - a, successes + 1, n - successes))
    return lo, hi


@dataclass(frozen=True)
class CheckPoint:
    label: str                      # "kind task"
    measured: float | None          # accuracy in points (0..100)
    reference: float | None
    samples: int | None
    false_fail_rate: float | None
    level: float | None
    power: float | None
    passed: bool


def gate_checks(title: str, checks: list[CheckPoint]) -> str:
    """Left: each accuracy check's measured score with its 95 % Clopper-Pearson interval and the
    reference's score. Right: each statistical check's exact false-fail rate against its level, and
    its power against the stated regression."""
    with plt.rc_context(STYLE):
        fig, (left, right) = plt.subplots(1, 2, figsize=(9, 0.9 + 0.3 * len(checks)), sharey=True)
        ys = range(len(checks))
        for y, c in zip(ys, checks):
            colour = CERTIFIED if c.passed else NOT_CERTIFIED
            if c.measured is not None and c.samples and 0 <= c.measured <= 100:
                k = round(c.measured / 100 * c.samples)
                lo, hi = clopper_pearson(k, c.samples)
                left.plot([100 * lo, 100 * hi], [y, y], color=colour, linewidth=2)
                left.plot([c.measured], [y], "o", color=colour)
            if c.reference is not None and 0 <= c.reference <= 100:
                left.plot([c.reference], [y], "x", color="black")
            if c.false_fail_rate is not None:
                right.plot([c.false_fail_rate], [y], "o", color="#4878a8")
            if c.level is not None:
                right.plot([c.level], [y], "|", color="black", markersize=10)
            if c.power is not None:
                right.plot([c.power], [y], "s", color="#e08a1e")
        left.set_yticks(list(ys), [c.label for c in checks])
        left.invert_yaxis()
        left.set_xlim(-2, 102)
        left.set_xlabel("score, points (dot: measured, bar: 95 % interval, x: reference)")
        right.set_xscale("log")
        right.set_xlim(1e-4, 1.5)
        _plain_log(right.xaxis, 1e-4, 1.0)
        right.set_xlabel("dot: false-fail rate, bar: level, square: power")
        for ax in (left, right):
            ax.grid(alpha=0.3, axis="x")
        fig.suptitle(title)
        fig.tight_layout()
        return _svg(fig)
