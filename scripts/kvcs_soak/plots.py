"""The soak's pictures: PNG line charts of its report, drawn with Pillow.

Pillow comes with vLLM (no plotting library is installed); its default
bitmap font labels the axes. write_plots(report, out) writes, from
report["timeline"] (the sampler's rows) and report["answer_list"]:

  soak-verdicts.png  the consumer's verdict counters over the run
  soak-held.png      what both schedulers hold (gauges) and both servers' RSS
  soak-latency.png   latency distributions (CDF) of the answered requests:
                     answered 200 against failed by a mismatch, and with
                     --cost checksums on against off

Each chart is a list of named series of (x, y) points; a missing value
(a server down while the producer restarts) breaks the line.
"""

from __future__ import annotations

import math
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

WIDTH, HEIGHT = 900, 420
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 70, 20, 34, 46
COLORS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14), (23, 190, 207)]

Series = dict[str, list[tuple[float, float | None]]]


def _nice_max(value: float) -> float:
    if value <= 0:
        return 1.0
    magnitude = 10 ** math.floor(math.log10(value))
    for step in (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10):
        if value <= step * magnitude:
            return step * magnitude
    return 10 * magnitude


def _label(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 10 or value == int(value) else f"{value:.2g}"


def chart(title: str, x_label: str, y_label: str, series: Series, size=(WIDTH, HEIGHT),
          from_zero: bool = True) -> Image.Image:
    """One line chart: axes from 0 (or, from_zero False, from a round value
    below the lowest point) to a round maximum, five ticks each, a legend."""
    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default()
    w, h = size
    left, top, right, bottom = MARGIN_LEFT, MARGIN_TOP, w - MARGIN_RIGHT, h - MARGIN_BOTTOM
    points = [(x, y) for pts in series.values() for x, y in pts if y is not None]
    x_max = _nice_max(max((x for x, _ in points), default=1.0))
    y_lo = 0.0
    if not from_zero and points:
        low, high = min(y for _, y in points), max(y for _, y in points)
        step = _nice_max(max(high - low, 1.0)) / 5
        y_lo = max(0.0, math.floor(low / step) * step - step)
    y_max = y_lo + _nice_max(max((y for _, y in points), default=1.0) - y_lo)

    def at(x: float, y: float) -> tuple[float, float]:
        return left + (right - left) * x / x_max, bottom - (bottom - top) * (y - y_lo) / (y_max - y_lo)

    draw.text((left, 8), title, fill="black", font=font)
    draw.rectangle([left, top, right, bottom], outline=(120, 120, 120))
    for i in range(6):
        gx, gy = x_max * i / 5, y_lo + (y_max - y_lo) * i / 5
        px, _ = at(gx, y_lo)
        _, py = at(0, gy)
        draw.line([(px, bottom), (px, bottom + 4)], fill="black")
        draw.text((px - 8, bottom + 6), _label(gx), fill="black", font=font)
        draw.line([(left - 4, py), (left, py)], fill="black")
        draw.line([(left, py), (right, py)], fill=(235, 235, 235))
        draw.text((4, py - 6), _label(gy), fill="black", font=font)
    draw.text(((left + right) // 2 - 3 * len(x_label), h - 18), x_label, fill="black", font=font)
    draw.text((4, top - 16), y_label, fill="black", font=font)
    for i, (name, pts) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        run: list[tuple[float, float]] = []
        for x, y in [*pts, (0.0, None)]:
            if y is None:
                if len(run) > 1:
                    draw.line(run, fill=color, width=2)
                elif run:
                    draw.ellipse([run[0][0] - 2, run[0][1] - 2, run[0][0] + 2, run[0][1] + 2], fill=color)
                run = []
            else:
                run.append(at(x, y))
        ly = top + 6 + 14 * i
        draw.line([(right - 190, ly + 5), (right - 170, ly + 5)], fill=color, width=3)
        draw.text((right - 165, ly), name, fill="black", font=font)
    return img


def stack(images: list[Image.Image]) -> Image.Image:
    out = Image.new("RGB", (max(i.width for i in images), sum(i.height for i in images)), "white")
    y = 0
    for img in images:
        out.paste(img, (0, y))
        y += img.height
    return out


def _timeline_series(timeline: list[dict], side: str, keys: dict[str, str]) -> Series:
    return {label: [(row["t"], (row.get(side) or {}).get(key)) for row in timeline] for label, key in keys.items()}


def cdf(values: list[float]) -> list[tuple[float, float]]:
    """(value, share of values <= it) for sorted values."""
    ordered = sorted(values)
    return [(v, (i + 1) / len(ordered)) for i, v in enumerate(ordered)]


def write_plots(report: dict, out: Path) -> list[Path]:
    """The three PNGs of a soak report, in out; their paths."""
    out.mkdir(parents=True, exist_ok=True)
    timeline = report.get("timeline") or []
    written = []
    verdicts = chart("Consumer KV checksum verdicts over the run (cumulative)", "seconds since the traffic started", "loads",
                     _timeline_series(timeline, "consumer", {
                         "verified": "loads_verified", "mismatched": "loads_mismatched",
                         "unverified": "loads_unverified", "not compared": "loads_not_compared"}))
    written.append(out / "soak-verdicts.png")
    verdicts.save(written[-1])
    held = chart("Checksum state held (gauges), both servers", "seconds since the traffic started", "count", {
        **_timeline_series(timeline, "consumer", {"consumer loads in flight": "loads_in_flight",
                                                  "consumer held blocks": "held_blocks"}),
        **_timeline_series(timeline, "producer", {"producer sends in flight": "sends_in_flight"})})
    rss = chart("Resident memory", "seconds since the traffic started", "MiB", {
        **_timeline_series(timeline, "consumer", {"consumer RSS": "rss_mb"}),
        **_timeline_series(timeline, "producer", {"producer RSS": "rss_mb"})}, from_zero=False)
    written.append(out / "soak-held.png")
    stack([held, rss]).save(written[-1])
    latencies = report.get("latencies") or {}
    series: Series = {name: cdf(values) for name, values in latencies.items() if values}
    written.append(out / "soak-latency.png")
    chart("Latency of answered requests (CDF)", "latency, seconds", "share", series).save(written[-1])
    return written
