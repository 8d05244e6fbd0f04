"""pytest plugin: write each test's node id and outcome to $KVCS_OUTCOMES.

The upstream gate compares outcomes per test id, so it needs them exactly
as pytest names them, whatever the test file's layout.
"""

import os

_results: dict[str, str] = {}


def pytest_runtest_logreport(report):
    nodeid = report.nodeid
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        outcome = "xfailed" if hasattr(report, "wasxfail") and report.skipped else report.outcome
        _results[nodeid] = outcome
    elif report.when == "teardown" and report.outcome == "failed":
        _results[nodeid] = "error"


def pytest_collectreport(report):
    if report.outcome == "failed":
        _results[report.nodeid or "<collection>"] = "collection-error"


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("KVCS_OUTCOMES")
    if path:
        with open(path, "w") as f:
            for nodeid in sorted(_results):
                f.write(f"{_results[nodeid]} {nodeid}\n")
