"""vLLM's own P/D end-to-end tests, unmodified, against servers with KV checksums on.

    .venv/bin/python -m kvcs_soak.vllm_pd_tests [--suite edge-cases|mamba-prefix-cache] [--out DIR]
    (scripts/ on PYTHONPATH)

Starts a producer and a consumer as vLLM's run script for the suite does
(NixlConnector, kv_role kv_both), with enable_kv_checksum and fail-closed
added, a tiny model on the CPU, and vLLM's own toy proxy
(tests/v1/kv_connector/nixl_integration/toy_proxy_server.py), then runs the
suite's test file against them with pytest, as that script does:
- edge-cases (run_edge_case_test.sh, test_edge_cases.py): the tiny Llama;
- mamba-prefix-cache (run_mamba_prefix_cache_test.sh,
  test_mamba_prefix_cache.py): the tiny granite-4.0-h style hybrid (Mamba2
  and attention; a copy that admits 16384 positions, as the script's
  --max-model-len asks: it has no position embedding), prefix caching with
  --mamba-cache-mode align, block size 128. The same long prompt twice: the
  second load must transfer less (a prefix hit on the consumer).
The tests must pass, and the consumer's /metrics must show every load it
made verified: none mismatched, unverified or left uncompared. Writes
OUT/report.json; exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
# vLLM's NIXL end-to-end tests run here (each needs live servers): the test
# file, the tiny model, and the serve flags of its run script that differ
# from the demo's servers.
SUITES = {
    "edge-cases": ("test_edge_cases.py", "llama", {}),
    "mamba-prefix-cache": ("test_mamba_prefix_cache.py", "granite-h-long",
                           {"--block-size": "128", "--max-model-len": "16384", "--mamba-cache-mode": "align",
                            "--enable-prefix-caching": None}),
}
LONG_POSITIONS = 16384


def suite_model(name: str) -> Path:
    """The suite's tiny model directory (made under build/ on first use)."""
    if name == "llama":
        return make_models(ROOT / "build")["llama"]
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_tiny_model import make_granite_h

    base = make_granite_h(ROOT / "build" / "tiny-granite-h")
    long = ROOT / "build" / "tiny-granite-h-long"
    if not (long / "config.json").exists():
        tmp = long.with_name(long.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(base, tmp)
        config = json.loads((tmp / "config.json").read_text())
        config["max_position_embeddings"] = LONG_POSITIONS
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tmp.rename(long)
    return long


def with_flags(argv: list[str], flags: dict[str, str | None]) -> list[str]:
    """argv with each flag set to its value (replaced when present, else added; None: a switch)."""
    argv = list(argv)
    for flag, value in flags.items():
        if flag in argv:
            i = argv.index(flag)
            if value is None:
                continue
            argv[i + 1] = value
        else:
            argv += [flag] if value is None else [flag, value]
    return argv


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
    p.add_argument("--suite", choices=sorted(SUITES), default="edge-cases")
    p.add_argument("--out", type=Path, default=ROOT / "build" / "vllm-pd-tests")
    p.add_argument("--python", default=sys.executable)
    args = p.parse_args(argv)
    t0 = time.monotonic()
    work = args.out
    work.mkdir(parents=True, exist_ok=True)
    test_file, model, flags = SUITES[args.suite]
    setup = Setup("vllm-pd", suite_model(model), faults=False)
    specs = []
    for side in ("producer", "consumer"):
        port, side_port = free_port_block(1), free_port_block(8)
        setup.urls[side] = f"http://127.0.0.1:{port}"
        argv_ = with_flags(server_argv(args.python, setup, "kv_both", port, "cpu", kv_config()), flags)
        specs.append(ServerSpec(f"vllm-pd-{side}", argv_,
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
                                str(NIXL_TESTS / test_file)], env=env, cwd=NIXL_TESTS,
                               capture_output=True, text=True, timeout=TESTS_TIMEOUT_S)
        (work / "pytest.log").write_text(tests.stdout + tests.stderr)
        time.sleep(2.0)  # the last verdict reaches /metrics with the next stats interval
        delta = diff(checksum_counts(setup.urls["consumer"]), before)
    failures = judge(tests.returncode, delta)
    report = {"suite": args.suite, "tests": [test_file], "pytest_exit": tests.returncode, "pytest_tail": tests.stdout[-2000:],
              "consumer_checksums": delta, "failures": failures, "ok": not failures,
              "wall_s": time.monotonic() - t0}
    (work / "report.json").write_text(json.dumps(report, indent=2))
    log(tests.stdout[-1500:])
    log(f"consumer KV checksum counters over the tests: {delta}")
    log("every check passed" if not failures else "\n".join(f"FAIL {f}" for f in failures))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
