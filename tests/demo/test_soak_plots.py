"""The soak's PNG charts, drawn from a report (no servers)."""

from __future__ import annotations

from PIL import Image

from kvcs_soak import plots


def report(rows: int = 20) -> dict:
    timeline = []
    for i in range(rows):
        down = 8 <= i < 11  # the producer restarting: no values
        timeline.append({"t": 2.0 * i,
                         "consumer": {"loads_verified": 10.0 * i, "loads_mismatched": float(i // 4),
                                      "loads_unverified": 0.0, "loads_not_compared": 1.0,
                                      "loads_in_flight": float(i % 5), "sends_in_flight": 0.0,
                                      "held_blocks": 0.0, "rss_mb": 2300.0 + i},
                         "producer": None if down else {"sends_in_flight": float(i % 3), "rss_mb": 2400.0 + 2 * i}})
    return {"timeline": timeline,
            "latencies": {"answered 200": [0.1 * i for i in range(1, 50)], "failed by a mismatch (503)": [0.5, 0.7],
                          "cost run, checksums on": [], "cost run, checksums off": [0.2, 0.3]}}


def test_three_charts_are_written(tmp_path):
    paths = plots.write_plots(report(), tmp_path)
    assert [p.name for p in paths] == ["soak-verdicts.png", "soak-held.png", "soak-latency.png"]
    sizes = [Image.open(p).size for p in paths]
    assert sizes[0] == (plots.WIDTH, plots.HEIGHT) and sizes[1] == (plots.WIDTH, 2 * plots.HEIGHT)
    # Something was drawn in colour besides the frame and the text.
    colours = Image.open(paths[0]).convert("RGB").getcolors(maxcolors=100000)
    assert {c for _, c in colours} & {plots.COLORS[0], plots.COLORS[1]}


def test_an_empty_report_still_draws(tmp_path):
    paths = plots.write_plots({}, tmp_path)
    assert all(p.exists() and Image.open(p).size[0] == plots.WIDTH for p in paths)


def test_the_axes_round_up_and_the_cdf_ends_at_one():
    assert plots._nice_max(0) == 1.0 and plots._nice_max(7) == 8 and plots._nice_max(105) == 120 and plots._nice_max(230) == 250
    points = plots.cdf([3.0, 1.0, 2.0])
    assert points == [(1.0, 1 / 3), (2.0, 2 / 3), (3.0, 1.0)]
