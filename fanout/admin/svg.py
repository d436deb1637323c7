"""Charts drawn on the server as inline SVG: no script and no library, so the admin works
offline. Each chart scales to its panel's width (a viewBox), its colours come from admin.css,
and every bar has a <title> with its value for a pointer that rests on it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe

WIDTH, HEIGHT = 600, 160
# Room for the axis labels, in the viewBox's units: 15 of them read as 9 px on a phone.
LEFT, RIGHT, TOP, BOTTOM = 50, 10, 10, 26


@dataclass
class Series:
    name: str  # the legend's words
    css: str  # the class that colours it: fanout-chart-<css>
    values: Sequence[float | None]


def number(value: float) -> str:
    """A short number for an axis: 1.2k, 35, 0.5."""
    if value >= 10_000:
        return f"{value / 1000:,.0f}k"
    if value >= 1000:
        return f"{value / 1000:.1f}k"
    if value >= 10 or value == int(value):
        return f"{value:,.0f}"
    return f"{value:.2g}"


_LINE = '<line class="fanout-chart-{}" x1="{}" y1="{}" x2="{}" y2="{}"/>'
_TEXT = '<text class="fanout-chart-label" x="{}" y="{}" text-anchor="{}">{}</text>'
_RECT = (
    '<rect class="fanout-chart-{}" x="{}" y="{}" width="{}" height="{}">'
    "<title>{}: {}{}</title></rect>"
)
PLOT_W, PLOT_H = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM


def _svg(label: str, height: int, *parts: str, fit: bool = True) -> SafeString:
    return format_html(
        '<svg class="fanout-chart" viewBox="0 0 {} {}" role="img" aria-label="{}"{}>{}</svg>',
        WIDTH,
        height,
        label,
        mark_safe(' preserveAspectRatio="xMidYMid meet"' if fit else ""),
        mark_safe("".join(parts)),
    )


def _across(css: str, y: float | str) -> SafeString:
    """A line across the plot at height ``y``: the x axis, a grid line."""
    return format_html(_LINE, css, LEFT, y, WIDTH - RIGHT, y)


def _x_labels(ticks: Sequence[tuple[float, str]], slots: int, height: int) -> SafeString:
    """Labels under some x slots: the first starts there, the last ends there."""
    return format_html_join(
        "",
        _TEXT,
        (
            (
                f"{LEFT + PLOT_W * i / max(slots, 1):.1f}",
                height - 5,
                "start" if i == 0 else ("end" if i >= slots else "middle"),
                text,
            )
            for i, text in ticks
        ),
    )


def _frame(
    body: str,
    label: str,
    ymax: float,
    unit: str,
    ticks: Sequence[tuple[float, str]],
    slots: int,
    height: int = HEIGHT,
) -> SafeString:
    """The axes around ``body``: the y axis's top value, and labels under some x slots."""
    bottom = height - BOTTOM
    return _svg(
        label,
        height,
        body,
        _across("axis", bottom),
        _across("grid", TOP),
        format_html(_TEXT, LEFT - 4, TOP + 10, "end", f"{number(ymax)}{unit}"),
        format_html(_TEXT, LEFT - 4, bottom, "end", "0"),
        _x_labels(ticks, slots, height),
    )


@dataclass
class _Scale:
    """Where a bar chart's values land: ``slots`` bars side by side, ``ymax`` at the top."""

    slots: int
    ymax: float

    @property
    def slot_w(self) -> float:
        return PLOT_W / max(self.slots, 1)

    @property
    def gap(self) -> float:
        return min(1.0, self.slot_w * 0.15)

    def y(self, value: float) -> float:
        return TOP + PLOT_H - PLOT_H * value / self.ymax


def bars(
    series: Sequence[Series],
    label: str,
    ticks: Sequence[tuple[float, str]],
    unit: str = "",
    slot_names: Sequence[str] = (),
    limit: float | None = None,
    ceiling: tuple[float, str] | None = None,
    limit_name: str = "limit",
    marks: Sequence[tuple[int, int, str]] = (),
) -> SafeString:
    """Bars stacked in the order of ``series``, one slot per value; ``limit`` draws a dashed
    line (its title ``limit_name``), ``ceiling`` (value, title) a dotted one: how far above
    the limit a bar may rightly rise (a rate's burst)."""
    slots = max((len(s.values) for s in series), default=0)
    totals = [sum(s.values[i] or 0 for s in series) for i in range(slots)]
    top = ceiling[0] if ceiling else 0
    scale = _Scale(slots, max([*totals, limit or 0, top, 0]) or 1)
    names = [f" {n}" for n in slot_names] + [""] * slots
    # ``marks``: stretches of slots (first, end, title) shaded behind the bars.
    rects = [_mark(first, end, title, scale) for first, end, title in marks]
    rects += [r for i in range(slots) for r in _stack(series, i, scale, names[i])]
    lines = [] if limit is None else [("limit", limit, limit_name)]
    if ceiling is not None:
        lines.append(("ceiling", ceiling[0], ceiling[1]))
    for css, value, name in lines:
        rects.append(
            format_html(
                '<line class="fanout-chart-{}" x1="{}" y1="{}" x2="{}" y2="{}">'
                "<title>{}: {}{}</title></line>",
                css,
                LEFT,
                f"{scale.y(value):.2f}",
                WIDTH - RIGHT,
                f"{scale.y(value):.2f}",
                name,
                number(value),
                unit,
            )
        )
    return _frame("".join(rects), label, scale.ymax, unit, ticks, slots)


def _mark(first: int, end: int, title: str, scale: _Scale) -> str:
    x, w = LEFT + first * scale.slot_w, (end - first) * scale.slot_w
    return format_html(
        '<rect class="fanout-chart-idle" x="{}" y="{}" width="{}" height="{}"><title>{}</title>'
        '</rect><text class="fanout-chart-label" x="{}" y="{}" text-anchor="middle">{}</text>',
        f"{x:.2f}",
        TOP,
        f"{w:.2f}",
        PLOT_H,
        title,
        f"{x + w / 2:.2f}",
        TOP + PLOT_H / 2,
        "ended" if w >= 40 else "",
    )


def _stack(series: Sequence[Series], i: int, scale: _Scale, where: str) -> list[str]:
    """Slot ``i``'s bars, each series's value on top of the ones before it."""
    rects: list[str] = []
    base = 0.0
    for s in series:
        v = s.values[i] or 0
        if v <= 0:
            continue
        rects.append(
            format_html(
                _RECT,
                s.css,
                f"{LEFT + i * scale.slot_w + scale.gap / 2:.2f}",
                f"{scale.y(base + v):.2f}",
                f"{max(scale.slot_w - scale.gap, 0.5):.2f}",
                f"{max(PLOT_H * v / scale.ymax, 0.5):.2f}",
                s.name,
                number(v),
                where,
            )
        )
        base += v
    return rects


@dataclass
class Span:
    name: str
    css: str
    start: float  # seconds from the chart's origin
    end: float
    url: str = ""


def spans(
    rows: Sequence[Span], label: str, total: float, ticks: Sequence[tuple[float, str]], slots: int
) -> SafeString:
    """One horizontal bar per row, from its start to its end, on a shared time axis."""
    row_h = 16
    height = TOP + BOTTOM + row_h * max(len(rows), 1)
    plot_w = WIDTH - LEFT - RIGHT
    total = total or 1.0
    parts = []
    for i, r in enumerate(rows):
        x = LEFT + plot_w * max(r.start, 0) / total
        w = max(plot_w * (r.end - r.start) / total, 1.0)
        rect = format_html(
            '<rect class="fanout-chart-{}" x="{}" y="{}" width="{}" height="{}">'
            "<title>{}</title></rect>",
            r.css,
            f"{x:.2f}",
            TOP + i * row_h + 1,
            f"{min(w, WIDTH - RIGHT - x):.2f}",
            row_h - 2,
            r.name,
        )
        parts.append(format_html('<a href="{}">{}</a>', r.url, rect) if r.url else rect)
    return _frame_spans("".join(parts), label, ticks, slots, height)


def _frame_spans(
    body: str, label: str, ticks: Sequence[tuple[float, str]], slots: int, height: int
) -> SafeString:
    axis = _across("axis", height - BOTTOM)
    return _svg(label, height, body, axis, _x_labels(ticks, slots, height), fit=False)


def legend(series: Sequence[Series]) -> SafeString:
    """The chart's colours and names, for the series that have a value."""
    shown = [s for s in series if any(v for v in s.values)]
    return format_html(
        '<ul class="fanout-legend fanout-chart-legend">{}</ul>',
        format_html_join(
            "",
            '<li><span class="fanout-swatch fanout-chart-{}"></span>{}</li>',
            ((s.css, s.name) for s in shown),
        ),
    )
