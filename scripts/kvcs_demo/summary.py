"""What every mode of the demo prints: its lines, and the end of its summary."""

from __future__ import annotations


def log(msg: str) -> None:
    print(msg, flush=True)


def log_ending(report: dict, ttft_what: str) -> None:
    """The summary's last lines: the TTFT comparison (when measured), the wall
    time, and the failed checks. `ttft_what` says what the TTFT figures time."""
    t = report.get("ttft") or {}
    if t.get("ratio"):
        log(f"TTFT p50 ({ttft_what}, {t['requests_each']} requests each): checksums on "
            f"{t['on_p50_ms']:.0f} ms, off {t['off_p50_ms']:.0f} ms, ratio {t['ratio']:.2f}")
    log(f"wall time {report['wall_s']:.0f} s; " + ("every check passed" if report["ok"] else
                                                  f"{len(report['failures'])} check(s) FAILED:"))
    for f in report["failures"][:20]:
        log(f"  FAIL {f}")
