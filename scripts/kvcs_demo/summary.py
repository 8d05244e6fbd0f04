"""What every mode of the demo prints: its lines, and the end of its summary."""

from __future__ import annotations


def log(msg: str) -> None:
    print(msg, flush=True)


def ttft_caveat(report: dict) -> str:
    """What the TTFT ratio can and cannot say on the machine that measured it."""
    machine = report.get("machine") or {}
    if machine.get("device") == "cpu":
        return (f"Noise, not a cost: single requests on a shared {machine.get('cpus') or '?'}-core CPU machine vary "
                "more than the checksums cost (ratios from 0.43 to 3.8 were seen here with the same code, "
                "docs/e2e.md); it shows only that they add no cost of the order of a request. Their cost is "
                "measured in docs/performance.md.")
    return ("A smoke test, not a benchmark: the p50 of single requests, one at a time. The checksums' cost is "
            "measured in docs/performance.md.")


def log_ending(report: dict, ttft_what: str) -> None:
    """The summary's last lines: the TTFT comparison (when measured) and what it
    can say here, the wall time, and the failed checks. `ttft_what` says what
    the TTFT figures time."""
    t = report.get("ttft") or {}
    if t.get("ratio"):
        log(f"TTFT p50 ({ttft_what}; {t['requests_each']} single requests each, taking turns): checksums on "
            f"{t['on_p50_ms']:.0f} ms, off {t['off_p50_ms']:.0f} ms, ratio {t['ratio']:.2f}")
        log(f"  {ttft_caveat(report)}")
    log(f"wall time {report['wall_s']:.0f} s; " + ("every check passed" if report["ok"] else
                                                  f"{len(report['failures'])} check(s) FAILED:"))
    for f in report["failures"][:20]:
        log(f"  FAIL {f}")
