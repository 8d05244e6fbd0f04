"""vLLM's own P/D end-to-end tests, unmodified, against servers with KV checksums on.

    .venv/bin/python -m kvcs_soak.vllm_pd_tests [--out DIR]   (scripts/ on PYTHONPATH)

Starts a producer and a consumer as vLLM's run_edge_case_test.sh does
(NixlConnector, kv_role kv_both), with enable_kv_checksum and fail-closed
added, the tiny Llama on the CPU, and vLLM's own toy proxy
(tests/v1/kv_connector/nixl_integration/toy_proxy_server.py), then runs
vLLM's test_edge_cases.py against them with pytest, as that script does.
The tests must pass, and the consumer's /metrics must show every load it
made verified: none mismatched, unverified or left uncompared. Writes
OUT/report.json; exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from kvcs_demo.demo import checksum_counts, diff
from kvcs_demo.servers import ProcessGroup, ServerSpec, free_port_block
from kvcs_demo.setups import ROOT, Setup, make_models, server_argv, server_env
from kvcs_demo.summary import log
from kvcs_soak.truth import LOAD_VERDICTS, counter_total

STARTUP_TIMEOUT_S = 900.0
TESTS_TIMEOUT_S = 900
NIXL_TESTS = ROOT / "build" / "vllm" / "tests" / "v1" / "kv_connector" / "nixl_integration"
# The files of vLLM's NIXL end-to-end tests run here (each needs live servers).
TEST_FILES = ("test_edge_cases.py",)


def kv_config() -> dict:
    """run_edge_case_test.sh's config (CPU buffer), with KV checksums on and fail-closed."""
    return {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
            "enable_kv_checksum": True, "kv_checksum_fail_closed": True, "kv_load_failure_policy": "fail"}


def toy_proxy_argv(python: str, port: int, producer_port: int, consumer_port: int) -> list[str]:
    return [python, str(NIXL_TESTS / "toy_proxy_server.py"), "--port", str(port),
            "--prefiller-ports", str(producer_port), "--decoder-ports", str(consumer_port)]


def judge(returncode: int, delta: dict[str, int]) -> list[str]:
    """The checks: the tests passed, and every load the consumer made verified."""
    failures = []
    if returncode != 0:
        failures.append(f"vLLM's P/D tests failed (pytest exit {returncode})")
    loads = {name: counter_total(delta, name) for name in LOAD_VERDICTS}
    if loads["loads_verified"] == 0:
        failures.append("the consumer verified no load: the tests made no P/D transfer with checksums")
    bad = {k: v for k, v in delta.items() if k.split("/")[0] in LOAD_VERDICTS[1:] and v}
    if bad:
        failures.append(f"loads not verified: {bad}")
    return failures


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvcs_soak.vllm_pd_tests", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "build" / "vllm-pd-tests")
    p.add_argument("--python", default=sys.executable)
    args = p.parse_args(argv)
    t0 = time.monotonic()
    work = args.out
    work.mkdir(parents=True, exist_ok=True)
    setup = Setup("vllm-pd", make_models(ROOT / "build")["llama"], faults=False)
    specs = []
    for side in ("producer", "consumer"):
        port, side_port = free_port_block(1), free_port_block(8)
        setup.urls[side] = f"http://127.0.0.1:{port}"
        specs.append(ServerSpec(f"vllm-pd-{side}", server_argv(args.python, setup, "kv_both", port, "cpu", kv_config()),
                                server_env("cpu", side_port) | {"PYTHONUNBUFFERED": "1"}, port,
                                work / f"{side}.log"))
    proxy_port = free_port_block(1)
    ports = [s.port for s in specs]
    with ProcessGroup() as group:
        servers = [group.start(s) for s in specs]
        proxy = group.start(ServerSpec("vllm-toy-proxy", toy_proxy_argv(args.python, proxy_port, *ports),
                                       {"PYTHONUNBUFFERED": "1"}, proxy_port, work / "proxy.log",
                                       health_path="/healthcheck"))
        (work / "process_groups.json").write_text(json.dumps({m.name: m.pgid for m in [*servers, proxy]}))
        group.wait_healthy([*servers, proxy], timeout=STARTUP_TIMEOUT_S)
        log(f"producer, consumer and vLLM's toy proxy up after {time.monotonic() - t0:.0f} s")
        before = checksum_counts(setup.urls["consumer"])
        env = dict(os.environ, PREFILL_PORT=str(ports[0]), DECODE_PORT=str(ports[1]), PROXY_PORT=str(proxy_port),
                   PREFILL_HOST="127.0.0.1", DECODE_HOST="127.0.0.1", PROXY_HOST="127.0.0.1")
        # --noconftest: vLLM's tests/conftest.py has an autouse fixture that
        # empties the accelerator's cache after each test, which raises on a
        # machine with none; these tests use none of its fixtures.
        tests = subprocess.run([args.python, "-m", "pytest", "-p", "no:cacheprovider", "--noconftest", "-q", "-s",
                                *(str(NIXL_TESTS / f) for f in TEST_FILES)], env=env, cwd=NIXL_TESTS,
                               capture_output=True, text=True, timeout=TESTS_TIMEOUT_S)
        (work / "pytest.log").write_text(tests.stdout + tests.stderr)
        time.sleep(2.0)  # the last verdict reaches /metrics with the next stats interval
        delta = diff(checksum_counts(setup.urls["consumer"]), before)
    failures = judge(tests.returncode, delta)
    report = {"tests": list(TEST_FILES), "pytest_exit": tests.returncode, "pytest_tail": tests.stdout[-2000:],
              "consumer_checksums": delta, "failures": failures, "ok": not failures,
              "wall_s": time.monotonic() - t0}
    (work / "report.json").write_text(json.dumps(report, indent=2))
    log(tests.stdout[-1500:])
    log(f"consumer KV checksum counters over the tests: {delta}")
    log("every check passed" if not failures else "\n".join(f"FAIL {f}" for f in failures))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
