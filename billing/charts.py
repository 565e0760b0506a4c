"""A stacked bar chart as SVG, drawn on the server: no JS library, no CDN."""

from django.utils.html import escape

PALETTE = ("#2563eb", "#16a34a", "#dc2626", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#65a30d", "#475569")
# The most series drawn each in its own place: past it, the smallest are one series, "N others".
MAX_SERIES = len(PALETTE) * 10  # the colours the bars and the legend go through


def _folded(series: dict[str, list[int]]) -> dict[str, list[int]]:
    """Return ``series`` with at most MAX_SERIES of them: the largest (by total) as they are, the
    rest added up into one, last. Every credit is in one of them."""
    if len(series) <= MAX_SERIES:
        return series
    largest = set(sorted(series, key=lambda name: sum(series[name]), reverse=True)[: MAX_SERIES - 1])
    rest = [values for name, values in series.items() if name not in largest]
    kept = {name: values for name, values in series.items() if name in largest}
    return {**kept, f"{len(rest)} others": [sum(day) for day in zip(*rest, strict=True)]}


def stacked_bars_svg(*, labels: list[str], series: dict[str, list[int]], width: int = 900, height: int = 260) -> str:
    """Return an SVG of one stacked bar per label, one colour per series, with axes and a legend.
    Past MAX_SERIES series, the smallest are drawn as one (``_folded``)."""
    series = _folded(series)
    left, bottom, top = 48, 40, 12
    plot_w, plot_h = width - left - 12, height - bottom - top
    totals = [sum(values[i] for values in series.values()) for i in range(len(labels))]
    peak = max(totals, default=0) or 1
    slot = plot_w / max(len(labels), 1)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height + 20 * ((len(series) + 5) // 6)}" '
        f'role="img" aria-label="credits per day" font-family="sans-serif" font-size="11">'
    ]
    for step in range(5):  # the y axis: five gridlines
        value = peak * step / 4
        y = top + plot_h - plot_h * step / 4
        parts.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e5e7eb"/>')
        parts.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" fill="#6b7280">{value:.0f}</text>')
    for i, label in enumerate(labels):
        x, y = left + i * slot + slot * 0.15, top + plot_h
        for colour, (name, values) in zip(PALETTE * 10, series.items(), strict=False):
            if values[i]:
                h = plot_h * values[i] / peak
                y -= h
                parts.append(
                    f'<rect x="{x:.1f}" y="{y:.1f}" width="{slot * 0.7:.1f}" height="{h:.1f}" fill="{colour}">'
                    f"<title>{escape(label)} · {escape(name)}: {values[i]} credits</title></rect>"
                )
        if i % max(1, len(labels) // 10) == 0:
            parts.append(
                f'<text x="{x + slot * 0.35:.1f}" y="{top + plot_h + 16}" text-anchor="middle" fill="#6b7280">'
                f"{escape(label[5:])}</text>"
            )
    for j, (colour, name) in enumerate(zip(PALETTE * 10, series, strict=False)):
        x, y = left + (j % 6) * 140, height + 4 + 20 * (j // 6)
        parts.append(f'<rect x="{x}" y="{y}" width="10" height="10" fill="{colour}"/>')
        parts.append(f'<text x="{x + 14}" y="{y + 9}">{escape(name)} ({sum(series[name])})</text>')
    parts.append("</svg>")
    return "".join(parts)
