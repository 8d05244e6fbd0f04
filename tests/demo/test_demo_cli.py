"""kvcs_demo.demo and kvcs_demo.setups without servers.

What `make demo` decides before any server starts (its arguments, setups,
the vLLM command lines and environments, including the GPU-host flow that
cannot run here) and what it makes of what the servers answer (counter
deltas, reported block positions, injection records, the per-request
verdicts, the report and its table), fed with synthetic data. No vLLM server
and no model is started or made here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

import pytest

from kvcs_demo import demo, prom
from vllm_kvchecksum.engine import incident
from kvcs_demo.demo import (FAULT_KINDS, PhaseResult, RequestResult, build_report, checksum_counts, choose_setups,
                            diff, expected_verdict, injections_for, judge, loads_in, parse_args,
                            positions_from_client_error, positions_from_log, print_table, verdict_of)
from kvcs_demo.setups import (BLOCK_SIZE, CPU_SITE, MAX_MODEL_LEN, MODES, ROOT, Setup, bootstrap_url, cpu_setups,
                              gpu_setups, kv_transfer_config, mooncake_bootstrap, producer_engine_id, push_target,
                              server_argv, server_env)

ALL_KINDS = ["flip_bit", "overwrite_piece", "swap_tokens", "swap_heads", "swap_layers", "swap_blocks",
             "misplace_block", "change_tail", "drop_checksums", "producer_flip_bit"]
FAKE_MODELS = {"llama": Path("/fake/tiny-llama"), "gemma2": Path("/fake/tiny-gemma2")}


@pytest.fixture(autouse=True)
def _no_device_env(monkeypatch):
    monkeypatch.delenv("VLLM_DEVICE", raising=False)


def parse_error(capsys, argv) -> str:
    """parse_args(argv) must exit with argparse's usage error; its message."""
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def flag(argv: list[str], name: str) -> str:
    """The value after `name` (present exactly once)."""
    assert argv.count(name) == 1, (name, argv)
    return argv[argv.index(name) + 1]


# ----------------------------------------------------------------- 1. parse_args

def test_parse_args_defaults():
    args = parse_args([])
    assert list(FAULT_KINDS) == ALL_KINDS
    assert args.requests == 1
    assert args.kinds == ALL_KINDS
    assert args.device == "cpu"
    assert args.model is None
    assert args.setups is None
    assert args.producer_tp == 1
    assert args.mode == "pull"
    assert args.ttft_requests == 20
    assert args.no_hostile is False
    assert args.out == ROOT / "build" / "demo"


def test_parse_args_device_from_env(monkeypatch, capsys):
    monkeypatch.setenv("VLLM_DEVICE", "cuda")
    args = parse_args(["--model", "org/some-model"])
    assert args.device == "cuda"
    assert args.model == Path("org/some-model")
    # The env default is checked like the flag: cuda still needs --model.
    assert "--device cuda needs --model" in parse_error(capsys, [])
    # The flag wins over the environment.
    assert parse_args(["--device", "cpu"]).device == "cpu"


def test_parse_args_kinds_subset():
    assert parse_args(["--kinds", "swap_blocks,flip_bit"]).kinds == ["swap_blocks", "flip_bit"]
    assert parse_args(["--kinds", "change_tail,"]).kinds == ["change_tail"]


def test_parse_args_alerts():
    assert parse_args([]).alerts is False
    assert parse_args(["--alerts"]).alerts is True


def test_alerts_without_prometheus_fail_before_any_server_starts(monkeypatch, tmp_path):
    from kvcs_demo import alerts

    monkeypatch.setattr(alerts.shutil, "which", lambda name: None)
    monkeypatch.setattr(demo, "choose_setups", lambda args: [Setup("llama", Path("/m/tiny-llama"))])

    def no_servers(*a, **kw):
        raise AssertionError("a server was started")
    monkeypatch.setattr(demo, "server_specs", no_servers)
    monkeypatch.setattr(demo, "ProcessGroup", no_servers)
    with pytest.raises(alerts.AlertsError, match=r"`make setup` installs Debian's prometheus package"):
        demo.main(["--alerts", "--out", str(tmp_path)])


def test_parse_args_unknown_kind(capsys):
    err = parse_error(capsys, ["--kinds", "flip_bit,bogus"])
    assert "unknown fault kinds ['bogus']" in err
    assert "flip_bit" in err.split("known:")[1]  # the known ones are listed


def test_parse_args_requests_zero(capsys):
    assert "--requests must be at least 1" in parse_error(capsys, ["--requests", "0"])
    assert parse_args(["--requests", "3"]).requests == 3


def test_parse_args_cuda_needs_model(capsys):
    assert "--device cuda needs --model" in parse_error(capsys, ["--device", "cuda"])
    assert parse_args(["--device", "cuda", "--model", "X"]).device == "cuda"


# ----------------------------------------------------------------- 2. setups

def shape(s: Setup) -> tuple:
    return (s.name, s.model, s.hybrid, s.policy, s.checksums, s.faults, s.producer_tp, s.consumer_tp)


def test_gpu_setups_via_choose_setups():
    got = choose_setups(parse_args(["--device", "cuda", "--model", "X"]))
    x = Path("X")
    assert [shape(s) for s in got] == [
        ("tp1-tp1", x, True, "fail", True, True, 1, 1),
        ("tp2-tp1", x, True, "fail", True, True, 2, 1),
        ("tp1-tp2", x, True, "fail", True, True, 1, 2),
        ("baseline-off", x, True, "open", False, True, 1, 1),
    ]
    assert [shape(s) for s in got] == [shape(s) for s in gpu_setups(x)]


def test_gpu_setups_without_ttft_have_no_baseline():
    got = choose_setups(parse_args(["--device", "cuda", "--model", "X", "--ttft-requests", "0"]))
    assert [s.name for s in got] == ["tp1-tp1", "tp2-tp1", "tp1-tp2"]
    assert all(s.checksums for s in got)


def test_gpu_setups_filter():
    got = choose_setups(parse_args(["--device", "cuda", "--model", "X", "--setups", "tp2-tp1"]))
    assert [s.name for s in got] == ["tp2-tp1", "baseline-off"]


def test_cpu_setups_default():
    got = cpu_setups(FAKE_MODELS, None, 1, ttft=True)
    llama, gemma = FAKE_MODELS["llama"], FAKE_MODELS["gemma2"]
    assert [shape(s) for s in got] == [
        ("llama", llama, True, "fail", True, True, 1, 1),
        ("gemma2-hybrid", gemma, True, "recompute", True, True, 1, 1),
        ("gemma2-merged", gemma, False, "open", True, True, 1, 1),
        ("baseline-off", llama, True, "open", False, True, 1, 1),
    ]
    assert [s.fail_closed for s in got[:3]] == [True, True, False]


def test_cpu_setups_producer_tp_and_no_ttft():
    got = cpu_setups(FAKE_MODELS, None, 2, ttft=False)
    assert [s.name for s in got] == ["llama", "gemma2-hybrid", "gemma2-merged"]
    assert [(s.producer_tp, s.consumer_tp) for s in got] == [(2, 1)] * 3


def test_cpu_setups_other_model():
    m = Path("/fake/other")
    got = cpu_setups({}, m, 1, ttft=True)
    assert [shape(s) for s in got] == [
        ("model-fail", m, True, "fail", True, True, 1, 1),
        ("model-recompute", m, True, "recompute", True, True, 1, 1),
        ("model-open", m, True, "open", True, True, 1, 1),
        ("baseline-off", m, True, "open", False, True, 1, 1),
    ]


@pytest.fixture
def fake_make_models(monkeypatch):
    calls = []

    def make_models(build):
        calls.append(build)
        return dict(FAKE_MODELS)

    monkeypatch.setattr(demo, "make_models", make_models)
    return calls


def test_choose_setups_cpu_makes_models_once(fake_make_models):
    got = choose_setups(parse_args([]))
    assert fake_make_models == [ROOT / "build"]
    assert [s.name for s in got] == ["llama", "gemma2-hybrid", "gemma2-merged", "baseline-off"]
    assert got[0].model == FAKE_MODELS["llama"]


def test_choose_setups_cpu_other_model_makes_none(fake_make_models):
    got = choose_setups(parse_args(["--model", "/fake/other"]))
    assert fake_make_models == []
    assert [s.name for s in got] == ["model-fail", "model-recompute", "model-open", "baseline-off"]


def test_setups_filter_keeps_baseline_only_with_ttft(fake_make_models):
    got = choose_setups(parse_args(["--setups", "llama,gemma2-merged"]))
    assert [s.name for s in got] == ["llama", "gemma2-merged", "baseline-off"]
    got = choose_setups(parse_args(["--setups", "llama,gemma2-merged", "--ttft-requests", "0"]))
    assert [s.name for s in got] == ["llama", "gemma2-merged"]


def test_setups_filter_unknown_name(fake_make_models):
    with pytest.raises(SystemExit) as exc:
        choose_setups(parse_args(["--setups", "llama,nope"]))
    msg = str(exc.value.code)
    assert msg.startswith("unknown setups ['nope']; known: ")
    assert "baseline-off, gemma2-hybrid, gemma2-merged, llama" in msg
    # Without TTFT there is no baseline pair to ask for.
    with pytest.raises(SystemExit) as exc:
        choose_setups(parse_args(["--setups", "baseline-off", "--ttft-requests", "0"]))
    assert str(exc.value.code).startswith("unknown setups ['baseline-off']")


# ----------------------------------------------------------------- 3. command lines

NIXL_CPU_CONSUMER = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_buffer_device": "cpu"}
NIXL_PUSH_CPU_CONSUMER = {"kv_connector": "NixlPushConnector", "kv_role": "kv_consumer", "kv_buffer_device": "cpu"}
MOONCAKE_PRODUCER = {"kv_connector": "MooncakeConnector", "kv_role": "kv_producer",
                     "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}
MOONCAKE_CONSUMER = {"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer",
                     "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}
# The consumer's connector config, as the fault-injecting wrapper gets it, by mode.
CONSUMER_CONNECTOR = {"pull": NIXL_CPU_CONSUMER, "push": NIXL_PUSH_CPU_CONSUMER, "mooncake": MOONCAKE_CONSUMER}


@pytest.mark.parametrize("mode", ["pull", "push", "mooncake"])
@pytest.mark.parametrize("policy, fail_closed, load_policy",
                         [("fail", True, "fail"), ("recompute", True, "recompute"), ("open", False, "fail")])
def test_kv_config_cpu_consumer_with_faults(tmp_path, mode, policy, fail_closed, load_policy):
    s = Setup("x", Path("/m"), policy=policy, mode=mode)
    control, injections = tmp_path / "x.faults.json", tmp_path / "x.injections.jsonl"
    cfg = kv_transfer_config(s, "kv_consumer", "cpu", control_path=control, injections_path=injections, seed=7)
    # The same wrapper in every mode, around the mode's connector: pull's
    # NixlConnector; NixlPushConnector (the consumer's engine id stays vLLM's
    # own: its PUSH_REG carries it); the Mooncake config whole, its own extra
    # config (the protocol) included, and no kv_buffer_device.
    assert cfg == {
        "kv_connector": "KVChecksumFaultConnector",
        "kv_connector_module_path": "vllm_kvchecksum.drills.fault_connector",
        "kv_role": "kv_consumer",
        **({} if mode == "mooncake" else {"kv_buffer_device": "cpu"}),
        "enable_kv_checksum": True,
        "kv_checksum_fail_closed": fail_closed,
        "kv_load_failure_policy": load_policy,
        "kv_connector_extra_config": {
            "connectors": [CONSUMER_CONNECTOR[mode]],
            "kv_checksum_faults": {"kinds": "all", "rate": 0.0, "seed": 7, "control_path": str(control),
                                   "log_path": str(injections)},
        },
    }
    json.dumps(cfg)  # it goes on a command line


def drill_producer(child: dict, **top) -> dict:
    """A checksummed producer's config: it re-checks its sends, and its
    connector is wrapped in the drill connector, faults on its sends off."""
    return {"kv_connector": "KVChecksumFaultConnector", "kv_connector_module_path": "vllm_kvchecksum.drills.fault_connector",
            "kv_role": "kv_producer", **top, "kv_checksum_producer_recheck": True,
            "kv_connector_extra_config": {"connectors": [child], "kv_checksum_faults": {
                "kinds": "all", "rate": 0.0, "seed": 0, "target": "sends"}}}


def test_kv_config_cpu_producer_rechecks_and_wraps_the_drill():
    cfg = kv_transfer_config(Setup("x", Path("/m"), policy="recompute"), "kv_producer", "cpu")
    assert cfg == drill_producer({"kv_connector": "NixlConnector", "kv_role": "kv_producer",
                                  "kv_buffer_device": "cpu"},
                                 kv_buffer_device="cpu", enable_kv_checksum=True, kv_checksum_fail_closed=True,
                                 kv_load_failure_policy="recompute")
    # Without faults, the producer's connector is the plain one.
    cfg = kv_transfer_config(Setup("x", Path("/m"), faults=False), "kv_producer", "cpu")
    assert cfg["kv_connector"] == "NixlConnector" and cfg["kv_checksum_producer_recheck"] is True


def test_kv_config_checksums_off():
    s = Setup("baseline-off", Path("/m"), policy="open", checksums=False)
    prod = kv_transfer_config(s, "kv_producer", "cpu")
    assert prod == {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu"}
    cons = kv_transfer_config(s, "kv_consumer", "cpu")
    assert cons["kv_connector"] == "KVChecksumFaultConnector"  # the same stack, never switched on
    for key in ("enable_kv_checksum", "kv_checksum_fail_closed", "kv_load_failure_policy"):
        assert key not in cons
    assert cons["kv_connector_extra_config"]["connectors"] == [NIXL_CPU_CONSUMER]
    assert cons["kv_connector_extra_config"]["kv_checksum_faults"] == {"kinds": "all", "rate": 0.0, "seed": 0}


def test_kv_config_consumer_without_faults():
    cfg = kv_transfer_config(Setup("x", Path("/m"), faults=False), "kv_consumer", "cpu")
    assert cfg["kv_connector"] == "NixlConnector"
    assert "kv_connector_extra_config" not in cfg and "kv_connector_module_path" not in cfg


def test_kv_config_cuda_has_no_buffer_device():
    s = Setup("tp1-tp2", Path("X"), consumer_tp=2)
    prod = kv_transfer_config(s, "kv_producer", "cuda")
    cons = kv_transfer_config(s, "kv_consumer", "cuda")
    assert "kv_buffer_device" not in prod and "kv_buffer_device" not in cons
    assert cons["kv_connector_extra_config"]["connectors"] == [{"kv_connector": "NixlConnector",
                                                                "kv_role": "kv_consumer"}]
    assert cons["enable_kv_checksum"] is True and cons["kv_checksum_fail_closed"] is True


@pytest.mark.parametrize("hybrid", [True, False])
def test_server_argv_cpu(hybrid):
    s = Setup("x", Path("/models/tiny"), hybrid=hybrid, producer_tp=2)
    for role, tp in (("kv_producer", "2"), ("kv_consumer", "1")):
        kv = kv_transfer_config(s, role, "cpu")
        argv = server_argv("/py/python", s, role, 12345, "cpu", kv)
        # `vllm serve MODEL`, by the Python's CLI when no entry point is beside it.
        assert argv[:5] == ["/py/python", "-m", "vllm.entrypoints.cli.main", "serve", "/models/tiny"]
        assert "--model" not in argv and "vllm.entrypoints.openai.api_server" not in argv
        assert flag(argv, "--port") == "12345"
        assert flag(argv, "--host") == "127.0.0.1"
        assert flag(argv, "--max-model-len") == str(MAX_MODEL_LEN)
        assert flag(argv, "--tensor-parallel-size") == tp
        assert json.loads(flag(argv, "--kv-transfer-config")) == kv
        assert BLOCK_SIZE == 32
        assert flag(argv, "--block-size") == "32"
        assert flag(argv, "--kv-cache-memory-bytes") == str(256 * 2**20)
        assert flag(argv, "--dtype") == "bfloat16"
        assert "--enforce-eager" in argv
        assert "--gpu-memory-utilization" not in argv
        assert ("--disable-hybrid-kv-cache-manager" in argv) is (not hybrid)


@pytest.mark.parametrize("hybrid", [True, False])
def test_server_argv_cuda(hybrid):
    s = Setup("tp1-tp2", Path("org/model"), hybrid=hybrid, consumer_tp=2)
    for role, tp in (("kv_producer", "1"), ("kv_consumer", "2")):
        kv = kv_transfer_config(s, role, "cuda")
        argv = server_argv("py", s, role, 8000, "cuda", kv)
        assert argv[:5] == ["py", "-m", "vllm.entrypoints.cli.main", "serve", "org/model"]
        assert flag(argv, "--tensor-parallel-size") == tp
        assert flag(argv, "--block-size") == "16"
        assert "--kv-cache-memory-bytes" not in argv and "--enforce-eager" not in argv
        kv_arg = json.loads(flag(argv, "--kv-transfer-config"))
        assert "kv_buffer_device" not in kv_arg
        assert "kv_buffer_device" not in json.dumps(kv_arg)  # nor in the wrapped child
        assert ("--disable-hybrid-kv-cache-manager" in argv) is (not hybrid)


def test_server_argv_runs_the_venvs_vllm_serve(tmp_path):
    """A venv's Python: its own `vllm` entry point, `vllm serve MODEL` as an operator types it."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    python, entry = bin_dir / "python", bin_dir / "vllm"
    python.write_text("")
    entry.write_text("#!/bin/sh\n")
    s = Setup("x", Path("/models/tiny"))
    kv = kv_transfer_config(s, "kv_consumer", "cpu")
    # Not executable: no entry point to run; the Python's CLI instead.
    assert server_argv(str(python), s, "kv_consumer", 1, "cpu", kv)[:4] == \
        [str(python), "-m", "vllm.entrypoints.cli.main", "serve"]
    entry.chmod(0o755)
    argv = server_argv(str(python), s, "kv_consumer", 1, "cpu", kv)
    assert argv[:3] == [str(entry), "serve", "/models/tiny"]


def test_the_fallback_cli_module_is_vllms_serve():
    """The module the fallback runs is the one behind the `vllm` entry point (pyproject's console script)."""
    import importlib.metadata

    [ep] = [e for e in importlib.metadata.entry_points(group="console_scripts") if e.name == "vllm"]
    assert ep.value == "vllm.entrypoints.cli.main:main"


def test_server_env_cuda():
    env = server_env("cuda", 5600, [2, 3])
    assert env["VLLM_GPU_SYNC_CHECK"] == "error"
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
    assert env["PYTHONPATH"] == str(ROOT)
    for key in ("OMP_NUM_THREADS", "KVCS_NIXL_PTHR_DELAY_US", "VLLM_CPU_OMP_THREADS_BIND"):
        assert key not in env
    assert "CUDA_VISIBLE_DEVICES" not in server_env("cuda", 5600)


def test_server_env_cpu():
    env = server_env("cpu", 5700)
    assert env["OMP_NUM_THREADS"] == "1"
    assert env["KVCS_NIXL_PTHR_DELAY_US"] == "500"
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5700"
    path = env["PYTHONPATH"].split(os.pathsep)
    assert path == [str(CPU_SITE), str(ROOT)]
    assert (Path(path[0]) / "sitecustomize.py").is_file()
    assert "VLLM_GPU_SYNC_CHECK" not in env and "CUDA_VISIBLE_DEVICES" not in env


def test_server_specs_cuda_gives_each_server_its_own_gpus(tmp_path):
    """With a GPU for every rank (10 here); fewer are shared: test_demo_gpus.py."""
    setups = gpu_setups(Path("X"))
    specs = demo.server_specs(setups, "cuda", tmp_path, "py", [str(i) for i in range(10)])
    assert list(specs) == ["tp1-tp1", "tp2-tp1", "tp1-tp2", "baseline-off"]
    gpus = {spec.name: spec.env["CUDA_VISIBLE_DEVICES"] for ss in specs.values() for spec in ss}
    assert gpus == {"tp1-tp1-producer": "0", "tp1-tp1-consumer": "1",
                    "tp2-tp1-producer": "2,3", "tp2-tp1-consumer": "4",
                    "tp1-tp2-producer": "5", "tp1-tp2-consumer": "6,7",
                    "baseline-off-producer": "8", "baseline-off-consumer": "9"}
    for s in setups:
        prod, cons = specs[s.name]
        assert flag(prod.argv, "--tensor-parallel-size") == str(s.producer_tp)
        assert flag(cons.argv, "--tensor-parallel-size") == str(s.consumer_tp)
        assert prod.env["PYTHONUNBUFFERED"] == "1" and cons.env["VLLM_GPU_SYNC_CHECK"] == "error"
        assert flag(prod.argv, "--gpu-memory-utilization") == flag(cons.argv, "--gpu-memory-utilization") == "0.3"
        assert s.urls == {"producer": f"http://127.0.0.1:{prod.port}", "consumer": f"http://127.0.0.1:{cons.port}"}
        assert s.control_path == tmp_path / f"{s.name}.faults.json"
        assert json.loads(s.control_path.read_text()) == {"kinds": [], "rate": 0.0}
        assert s.injections_path.read_text() == ""
        faults = json.loads(flag(cons.argv, "--kv-transfer-config"))["kv_connector_extra_config"][
            "kv_checksum_faults"]
        assert faults["control_path"] == str(s.control_path) and faults["log_path"] == str(s.injections_path)
    ports = [spec.port for ss in specs.values() for spec in ss]
    assert len(set(ports)) == len(ports)


def test_set_faults_writes_the_control_file(tmp_path):
    s = Setup("x", Path("/m"), control_path=tmp_path / "x.faults.json")
    demo.set_faults(s, "swap_heads")
    assert json.loads(s.control_path.read_text()) == {"kinds": ["swap_heads"], "rate": 1.0}
    demo.set_faults(s, None)
    assert json.loads(s.control_path.read_text()) == {"kinds": [], "rate": 0.0}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.faults.json"]


# ----------------------------------------------------------------- 3b. push mode
#
# --mode push: NixlPushConnector on both servers (the consumer's wrapped by
# the fault-injecting connector as in pull), the producer with a fixed NIXL
# engine id, and the proxy given each producer's NIXL coordinates, since the
# consumer registers its blocks with the producer before the producer answers.


def test_modes():
    assert MODES == ("pull", "push", "mooncake")
    assert parse_args(["--mode", "push"]).mode == "push"
    assert parse_args(["--mode", "mooncake"]).mode == "mooncake"


def test_parse_args_unknown_mode(capsys):
    assert "invalid choice: 'lmcache'" in parse_error(capsys, ["--mode", "lmcache"])


@pytest.mark.parametrize("mode", ["pull", "push", "mooncake"])
def test_choose_setups_gives_every_setup_the_mode(fake_make_models, mode):
    got = choose_setups(parse_args(["--mode", mode, "--setups", "llama"]))
    assert [(s.name, s.mode) for s in got] == [("llama", mode), ("baseline-off", mode)]
    got = choose_setups(parse_args(["--mode", mode, "--device", "cuda", "--model", "X"]))
    assert {s.mode for s in got} == {mode}


def test_kv_config_push_producer_has_its_engine_id():
    s = Setup("llama", Path("/m"), policy="fail", mode="push")
    assert producer_engine_id(s) == "kvcs-demo-llama-producer"
    assert kv_transfer_config(s, "kv_producer", "cpu") == drill_producer(
        {"kv_connector": "NixlPushConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu"},
        kv_buffer_device="cpu", engine_id="kvcs-demo-llama-producer", enable_kv_checksum=True,
        kv_checksum_fail_closed=True, kv_load_failure_policy="fail")


def test_kv_config_push_baseline_and_cuda():
    off = Setup("baseline-off", Path("/m"), policy="open", checksums=False, mode="push")
    assert kv_transfer_config(off, "kv_producer", "cpu") == {
        "kv_connector": "NixlPushConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu",
        "engine_id": "kvcs-demo-baseline-off-producer"}
    cons = kv_transfer_config(off, "kv_consumer", "cpu")
    assert cons["kv_connector_extra_config"]["connectors"] == [NIXL_PUSH_CPU_CONSUMER]
    assert "enable_kv_checksum" not in cons and "engine_id" not in cons
    gpu = Setup("tp2-tp1", Path("X"), producer_tp=2, mode="push")
    assert kv_transfer_config(gpu, "kv_consumer", "cuda")["kv_connector_extra_config"]["connectors"] == [
        {"kv_connector": "NixlPushConnector", "kv_role": "kv_consumer"}]
    assert kv_transfer_config(gpu, "kv_producer", "cuda")["engine_id"] == "kvcs-demo-tp2-tp1-producer"


def test_server_specs_push_mode_records_the_side_channels(tmp_path):
    setups = [Setup("llama", Path("/m/l"), policy="fail", producer_tp=2, mode="push"),
              Setup("gemma2-merged", Path("/m/g"), hybrid=False, policy="open", mode="push")]
    specs = demo.server_specs(setups, "cpu", tmp_path, "py")
    for s in setups:
        prod, cons = specs[s.name]
        assert s.side_ports == {"producer": int(prod.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]),
                                "consumer": int(cons.env["VLLM_NIXL_SIDE_CHANNEL_PORT"])}
        assert json.loads(flag(prod.argv, "--kv-transfer-config"))["engine_id"] == producer_engine_id(s)
        assert json.loads(flag(cons.argv, "--kv-transfer-config"))["kv_connector_extra_config"][
            "connectors"][0]["kv_connector"] == "NixlPushConnector"
    llama = setups[0]
    assert push_target(llama) == f"llama=kvcs-demo-llama-producer,localhost:{llama.side_ports['producer']},2"
    # ... which the proxy parses back to the producer's coordinates.
    from kvcs_demo.proxy import PushTarget, parse_push_target
    assert parse_push_target(push_target(llama)) == (
        "llama", PushTarget("kvcs-demo-llama-producer", "localhost", llama.side_ports["producer"], 2, 1))


class _RecordingGroup:
    def __init__(self):
        self.specs = []

    def start(self, spec):
        self.specs.append(spec)
        return spec


@pytest.mark.parametrize("mode", ["pull", "push", "mooncake"])
def test_start_proxy_argv(tmp_path, mode):
    setups = [Setup("a", Path("/m"), mode=mode), Setup("b", Path("/m"), producer_tp=2, mode=mode)]
    for i, s in enumerate(setups):
        s.urls = {"producer": f"http://127.0.0.1:{100 + i}", "consumer": f"http://127.0.0.1:{200 + i}"}
        s.side_ports = {"producer": 300 + i, "consumer": 400 + i}
        if mode == "mooncake":
            s.bootstrap_port = 500 + i
    group = _RecordingGroup()
    demo.start_proxy(group, setups, tmp_path, "py")
    [spec] = group.specs
    argv = spec.argv
    assert argv[:5] == ["py", "-m", "kvcs_demo.proxy", "--port", str(spec.port)]
    pairs = ["--pair=a=http://127.0.0.1:100,http://127.0.0.1:200", "--pair=b=http://127.0.0.1:101,http://127.0.0.1:201"]
    if mode == "pull":
        assert argv[5:] == pairs  # as before push mode existed
    elif mode == "push":
        assert argv[5:] == [*pairs, "--mode=push", "--push-target=a=kvcs-demo-a-producer,localhost:300,1",
                            "--push-target=b=kvcs-demo-b-producer,localhost:301,2"]
    else:
        assert argv[5:] == [*pairs, "--mode=mooncake", "--bootstrap=a=http://127.0.0.1:500",
                            "--bootstrap=b=http://127.0.0.1:501"]


# ----------------------------------------------------------------- 3c. mooncake mode
#
# --mode mooncake: MooncakeConnector (P2P) on both servers over TCP, the
# consumer's wrapped by the fault-injecting connector as in pull and push;
# both servers publish loopback addresses (VLLM_HOST_IP), and each producer
# serves its own bootstrap server, which the proxy is given.


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_kv_config_mooncake_producer(device):
    s = Setup("llama", Path("/m"), policy="fail", mode="mooncake")
    # No engine id (the proxy asks the bootstrap server), no kv_buffer_device.
    assert kv_transfer_config(s, "kv_producer", device) == drill_producer(
        MOONCAKE_PRODUCER, enable_kv_checksum=True, kv_checksum_fail_closed=True, kv_load_failure_policy="fail")


def test_kv_config_mooncake_baseline():
    off = Setup("baseline-off", Path("/m"), policy="open", checksums=False, mode="mooncake")
    assert kv_transfer_config(off, "kv_producer", "cpu") == MOONCAKE_PRODUCER
    cons = kv_transfer_config(off, "kv_consumer", "cpu")
    assert cons["kv_connector"] == "KVChecksumFaultConnector" and "enable_kv_checksum" not in cons
    assert cons["kv_connector_extra_config"]["connectors"] == [MOONCAKE_CONSUMER]
    # The producer config given to one server is not changed by another's.
    assert kv_transfer_config(off, "kv_producer", "cpu") == MOONCAKE_PRODUCER


def test_server_env_mooncake():
    prod = server_env("cpu", 5700, mode="mooncake", bootstrap_port=26000)
    cons = server_env("cpu", 5701, mode="mooncake")
    assert prod["VLLM_HOST_IP"] == cons["VLLM_HOST_IP"] == "127.0.0.1"
    assert prod["VLLM_MOONCAKE_BOOTSTRAP_PORT"] == "26000"
    assert "VLLM_MOONCAKE_BOOTSTRAP_PORT" not in cons  # only producers start a bootstrap server
    # Otherwise the usual CPU environment.
    assert {k: v for k, v in prod.items() if k not in ("VLLM_HOST_IP", "VLLM_MOONCAKE_BOOTSTRAP_PORT")} == \
        server_env("cpu", 5700)
    assert {k: v for k, v in cons.items() if k != "VLLM_HOST_IP"} == server_env("cpu", 5701)
    gpu = server_env("cuda", 5600, [1], mode="mooncake", bootstrap_port=26001)
    assert gpu["VLLM_HOST_IP"] == "127.0.0.1" and gpu["CUDA_VISIBLE_DEVICES"] == "1"


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_server_env_other_modes_have_no_mooncake_keys(mode):
    for env in (server_env("cpu", 5700, mode=mode), server_env("cpu", 5700, mode=mode, bootstrap_port=26000),
                server_env("cuda", 5700, mode=mode)):
        assert not {"VLLM_HOST_IP", "VLLM_MOONCAKE_BOOTSTRAP_PORT"} & set(env)
    assert server_env("cpu", 5700, mode=mode) == server_env("cpu", 5700)


def test_server_specs_mooncake_gives_each_producer_its_bootstrap_port(tmp_path):
    setups = [Setup("llama", Path("/m/l"), policy="fail", mode="mooncake"),
              Setup("gemma2-hybrid", Path("/m/g"), policy="recompute", mode="mooncake"),
              Setup("baseline-off", Path("/m/l"), policy="open", checksums=False, mode="mooncake")]
    specs = demo.server_specs(setups, "cpu", tmp_path, "py")
    ports = []
    for s in setups:
        prod, cons = specs[s.name]
        assert s.bootstrap_port is not None
        assert prod.env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] == str(s.bootstrap_port)
        assert "VLLM_MOONCAKE_BOOTSTRAP_PORT" not in cons.env
        assert prod.env["VLLM_HOST_IP"] == cons.env["VLLM_HOST_IP"] == "127.0.0.1"
        kv = json.loads(flag(prod.argv, "--kv-transfer-config"))
        assert kv.get("kv_connector_extra_config", {}).get("connectors", [kv])[0]["kv_connector"] == \
            "MooncakeConnector"
        assert json.loads(flag(cons.argv, "--kv-transfer-config"))["kv_connector_extra_config"][
            "connectors"] == [MOONCAKE_CONSUMER]
        ports += [prod.port, cons.port, s.bootstrap_port]
    # Every pair's own bootstrap server: no port twice, none a server's.
    assert len(set(ports)) == len(ports)
    llama = setups[0]
    assert bootstrap_url(llama) == f"http://127.0.0.1:{llama.bootstrap_port}"
    assert mooncake_bootstrap(llama) == f"llama=http://127.0.0.1:{llama.bootstrap_port}"
    # ... which the proxy parses back.
    from kvcs_demo.proxy import parse_bootstrap
    assert parse_bootstrap(mooncake_bootstrap(llama)) == ("llama", bootstrap_url(llama))


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_server_specs_other_modes_have_no_bootstrap_port(tmp_path, mode):
    setups = [Setup("llama", Path("/m/l"), policy="fail", mode=mode)]
    specs = demo.server_specs(setups, "cpu", tmp_path, "py")
    assert setups[0].bootstrap_port is None
    for spec in specs["llama"]:
        assert not {"VLLM_HOST_IP", "VLLM_MOONCAKE_BOOTSTRAP_PORT"} & set(spec.env)


# ----------------------------------------------------------------- 4. verdict plumbing

METRICS_TEXT = """\
# TYPE vllm:kv_checksum_loads_verified counter
vllm:kv_checksum_loads_verified_total{engine="0",model_name="m"} 3.0
vllm:kv_checksum_loads_verified_total{engine="1",model_name="m"} 2.0
vllm:kv_checksum_loads_verified_created{engine="0",model_name="m"} 1.7e9
# TYPE vllm:kv_checksum_loads_unverified counter
vllm:kv_checksum_loads_unverified_total{engine="0",model_name="m",reason="no_producer_checksums"} 1.0
vllm:kv_checksum_loads_unverified_total{engine="0",model_name="m",reason="malformed_payload"} 4.0
# TYPE vllm:kv_checksum_mismatched_blocks counter
vllm:kv_checksum_mismatched_blocks_total{engine="0",model_name="m"} 6.0
# TYPE vllm:kv_checksum_checked_bytes gauge
vllm:kv_checksum_checked_bytes{engine="0",model_name="m"} 99.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 1.0
"""


def test_checksum_counts_flattens_counters(monkeypatch):
    monkeypatch.setattr(prom, "scrape", lambda url: prom.parse(METRICS_TEXT))
    assert checksum_counts("http://unused") == {
        "loads_verified": 5.0,
        "loads_unverified/no_producer_checksums": 1.0,
        "loads_unverified/malformed_payload": 4.0,
        "mismatched_blocks": 6.0,
    }


def test_diff():
    after = {"loads_verified": 5.0, "loads_mismatched": 2.0, "mismatched_blocks": 7.0, "new/x": 1.0}
    before = {"loads_verified": 5.0, "loads_mismatched": 1.0, "mismatched_blocks": 4.0, "gone": 3.0}
    d = diff(after, before)
    assert d == {"loads_mismatched": 1, "mismatched_blocks": 3, "new/x": 1}
    assert all(type(v) is int for v in d.values())


def test_loads_in():
    assert loads_in({}) == 0
    assert loads_in({"mismatched_blocks": 4}) == 0
    assert loads_in({"loads_verified": 1, "loads_unverified/no_producer_checksums": 2,
                     "loads_not_compared/too_short": 1, "mismatched_blocks": 4}) == 4


@pytest.mark.parametrize("delta, want", [
    ({"loads_unverified/no_producer_checksums": 1}, ("unverified", "no_producer_checksums")),
    ({"loads_verified": 1}, ("verified", None)),
    ({"mismatched_blocks": 2, "loads_mismatched": 1}, ("mismatch", None)),
    ({"loads_not_compared/window": 1}, ("not_compared", "window")),
    ({"mismatched_blocks": 3}, ("no_load", None)),
    ({"loads_verified": 0}, ("no_load", None)),
    ({}, ("no_load", None)),
])
def test_verdict_of(delta, want):
    assert verdict_of(delta) == want


def test_positions_from_client_error():
    msg = "kv_checksum_mismatch: KV checksum mismatch for request x (group 0 blocks [1, 3], group 1 blocks [4])"
    assert positions_from_client_error(msg) == {0: [1, 3], 1: [4]}
    assert positions_from_client_error("kv_checksum_mismatch: ... (group 2 blocks [7, 0])") == {2: [0, 7]}
    assert positions_from_client_error("Internal Server Error") == {}


LOG_LINES = """\
(APIServer pid=1) INFO 12-03 01:02:40 [api_server.py:1] Started server process
(EngineCore pid=1) ERROR 12-03 01:02:41 [scheduler.py:409] KV checksum mismatch for request 'cmpl-demo.llama.flip_bit.000.r-0-11111111': group 0 differs at block positions 2 (1 of 5 compared); failing the load
(EngineCore pid=1) ERROR 12-03 01:02:51 [scheduler.py:409] KV checksum mismatch for request 'cmpl-demo.llama.flip_bit.001.r-0-afb3b7e8': group 0 differs at block positions 0-2, 4 (4 of 5 compared); group 1 differs at block positions 3 (1 of 3 compared); failing the load
(APIServer pid=1) INFO 12-03 01:02:52 [logger.py:1] done
"""


def test_positions_from_log(tmp_path):
    path = tmp_path / "consumer.log"
    path.write_text(LOG_LINES)
    assert positions_from_log(path, "demo.llama.flip_bit.001.r") == {0: [0, 1, 2, 4], 1: [3]}
    assert positions_from_log(path, "demo.llama.flip_bit.000.r") == {0: [2]}
    assert positions_from_log(path, "demo.llama.flip_bit.002.r") == {}
    assert positions_from_log(path, "demo.gemma2-hybrid.flip_bit.001.r") == {}
    assert positions_from_log(tmp_path / "missing.log", "demo.llama.flip_bit.001.r") == {}


def test_injections_for(tmp_path):
    path = tmp_path / "inj.jsonl"
    recs = [{"request_id": "cmpl-demo.llama.flip_bit.000.r-0-aa", "kind": "flip_bit", "group": 0,
             "positions": [1]},
            {"request_id": "cmpl-demo.llama.swap_blocks.000.r-0-bb", "kind": "swap_blocks", "group": 0,
             "positions": [0, 2]},
            {"request_id": "cmpl-demo.llama.flip_bit.000.r-1-cc", "kind": "flip_bit", "group": 1,
             "positions": [3]}]
    path.write_text("\n".join([json.dumps(recs[0]), "not json {", "", json.dumps(recs[1]),
                               '{"truncated": ', json.dumps(recs[2]), '{"kind": "no id"}']) + "\n")
    assert injections_for(path, "demo.llama.flip_bit.000.r") == [recs[0], recs[2]]
    assert injections_for(path, "demo.llama.swap_blocks.000.r") == [recs[1]]
    assert injections_for(path, "demo.llama.clean.000.r") == []
    assert injections_for(None, "demo.llama.flip_bit.000.r") == []
    assert injections_for(tmp_path / "missing.jsonl", "demo.llama.flip_bit.000.r") == []


# ----------------------------------------------------------------- 5. judge

INJ = {"request_id": "cmpl-demo.x.flip_bit.000.r-0-aa", "kind": "flip_bit", "group": 0, "positions": [3, 1],
       "block_ids": [11, 13], "expect": "mismatch"}
MISMATCH_ERR = "kv_checksum_mismatch: KV checksum mismatch for request r (group 0 blocks [1, 3])"


def result(phase="flip_bit", *, status=200, verdict="mismatch", reason=None, injection=INJ, reported=None,
           output_equal=True, error="") -> RequestResult:
    if reported is None:
        reported = {0: [1, 3]} if verdict == "mismatch" else {}
    return RequestResult(f"demo.x.{phase}.000.r", phase, status, verdict, reason,
                         expected_verdict(phase, injection), injection, reported, output_equal, error)


def judged(res: RequestResult, policy: str) -> RequestResult:
    res.ok, res.problem = None, None  # judge must set both
    judge(res, Setup("x", Path("/m"), policy=policy))
    return res


def test_expected_verdict():
    assert expected_verdict("clean", None) == "verified"
    assert expected_verdict("clean", INJ) == "verified"
    assert expected_verdict("flip_bit", None) == "verified"
    assert expected_verdict("flip_bit", INJ) == "mismatch"
    assert expected_verdict("flip_bit", {"kind": "flip_bit"}) == "mismatch"
    assert expected_verdict("flip_bit", INJ | {"skipped": "no block"}) == "verified"
    assert expected_verdict("change_tail", {"expect": "verified"}) == "verified"
    assert expected_verdict("drop_checksums", {"expect": "unverified"}) == "unverified"


def test_fail_policy_mismatch_503_at_the_positions_is_ok():
    r = judged(result(status=503, error=MISMATCH_ERR, output_equal=None), "fail")
    assert (r.ok, r.problem) == (True, "")


def test_fail_policy_wrong_positions_is_a_problem():
    r = judged(result(status=503, error=MISMATCH_ERR, reported={0: [1]}, output_equal=None), "fail")
    assert r.ok is False
    assert r.problem == "reported positions {0: [1]}, injected {0: [1, 3]}"
    r = judged(result(status=503, error=MISMATCH_ERR, reported={1: [1, 3]}, output_equal=None), "fail")
    assert r.ok is False and "reported positions" in r.problem


def test_fail_policy_served_is_a_problem():
    r = judged(result(status=200, output_equal=False), "fail")
    assert r.ok is False
    assert r.problem.startswith("policy fail: expected an error naming the KV checksum failure, got 200")
    # An error that does not name the checksum failure is not enough either.
    r = judged(result(status=500, error="Internal Server Error", output_equal=None), "fail")
    assert r.ok is False and "policy fail" in r.problem and "Internal Server Error" in r.problem


def test_recompute_policy():
    r = judged(result(status=200, output_equal=True), "recompute")
    assert (r.ok, r.problem) == (True, "")
    r = judged(result(status=200, output_equal=False), "recompute")
    assert (r.ok, r.problem) == (False, "output differs from the single-engine reference")
    r = judged(result(status=503, error=MISMATCH_ERR, output_equal=None), "recompute")
    assert r.ok is False and r.problem.startswith("HTTP 503: kv_checksum_mismatch")


def test_open_policy():
    r = judged(result(status=200, output_equal=False), "open")
    assert (r.ok, r.problem) == (True, "")
    r = judged(result(status=500, error="boom", output_equal=None), "open")
    assert (r.ok, r.problem) == (False, "HTTP 500: boom")


def test_change_tail_output_not_judged():
    inj = {"kind": "change_tail", "group": 0, "positions": [4], "expect": "verified"}
    for policy in ("fail", "recompute", "open"):
        r = judged(result("change_tail", verdict="verified", injection=inj, output_equal=False), policy)
        assert (r.ok, r.problem) == (True, ""), policy
    # ... but its verdict is.
    r = judged(result("change_tail", verdict="mismatch", injection=inj, output_equal=True), "open")
    assert r.ok is False and r.problem.startswith("verdict mismatch (None), expected verified")


def test_drop_checksums():
    inj = {"kind": "drop_checksums", "group": None, "positions": None, "expect": "unverified"}
    kw = dict(verdict="unverified", reason="no_producer_checksums", injection=inj)
    r = judged(result("drop_checksums", status=503, error="kv_checksum_unverified: no producer checksums",
                      output_equal=None, **kw), "fail")
    assert (r.ok, r.problem) == (True, "")
    for policy in ("recompute", "open"):
        assert judged(result("drop_checksums", output_equal=True, **kw), policy).ok is True
        r = judged(result("drop_checksums", output_equal=False, **kw), policy)
        assert (r.ok, r.problem) == (False, "output differs from the single-engine reference"), policy


def test_clean_phase():
    for policy in ("fail", "recompute", "open"):
        r = judged(result("clean", verdict="verified", injection=None, output_equal=True), policy)
        assert (r.ok, r.problem) == (True, ""), policy
    r = judged(result("clean", verdict="verified", injection=None, output_equal=False), "open")
    assert (r.ok, r.problem) == (False, "output differs from the single-engine reference")
    r = judged(result("clean", verdict="mismatch", injection=None, reported={0: [0]}, status=503,
                      error=MISMATCH_ERR, output_equal=None), "fail")
    assert r.ok is False and r.problem == "verdict mismatch (None), expected verified"


def test_fault_phase_without_injection_record():
    r = judged(result("flip_bit", verdict="verified", injection=None, output_equal=True), "fail")
    assert (r.ok, r.problem) == (False, "no injection recorded (rate 1)")


# ----------------------------------------------------------------- 6. report and table

E2E_DOC = ROOT / "docs" / "e2e.md"
TOP_KEYS = ["command", "machine", "wall_s", "mode", "requests_per_phase", "setups", "ttft", "failures", "ok"]
MACHINE_KEYS = ["platform", "cpus", "device"]
SETUP_KEYS = ["name", "model", "hybrid_kv_cache_manager", "policy", "fail_closed", "producer_tp", "consumer_tp",
              "startup_log", "phases", "hostile_client"]
PHASE_KEYS = ["phase", "requests", "metrics", "false_mismatches", "outputs_equal", "outputs", "http_errors",
              "injections"]
ALERTS_KEYS = ["expected", "seen", "problems", "wait_s"]  # a phase's "alerts" (--alerts)
INJECTION_KEYS = ["request_id", "kind", "group", "positions", "block_ids", "skipped", "expected", "verdict",
                  "reason", "reported", "status", "output_equal", "output", "reference", "ok", "problem",
                  "timings_ms"]
HOSTILE_KEYS = ["payload", "status", "error", "verdict", "reason", "next_request_status", "ok"]
STARTUP_KEYS = ["producer", "consumer"]  # startup_log: each server's lines
TTFT_KEYS = ["requests_each", "on_p50_ms", "off_p50_ms", "ratio", "failed", "errors", "on_ms", "off_ms"]


def schema_text() -> str:
    text = E2E_DOC.read_text()
    m = re.search(r"### report\.json\n.*?```\n(.*?)```", text, re.S)
    assert m, "docs/e2e.md has no report.json schema block"
    return m.group(1)


def test_schema_lists_the_keys_checked_here():
    schema = schema_text()
    for key in TOP_KEYS + SETUP_KEYS + PHASE_KEYS + ["alerts"] + ALERTS_KEYS + INJECTION_KEYS + HOSTILE_KEYS \
            + TTFT_KEYS:
        assert f'"{key}"' in schema, key
    for key in MACHINE_KEYS:
        assert re.search(rf'"machine": \{{[^}}]*"{key}"', schema), key
    # Every key the schema quotes as a key is one the tests check (or a metric / label name).
    quoted = set(re.findall(r'"([a-z0-9_]+)":', schema))
    metric_names = {"loads_verified", "loads_mismatched", "mismatched_blocks"}
    assert quoted - metric_names == set(TOP_KEYS + SETUP_KEYS + PHASE_KEYS + ["alerts"] + ALERTS_KEYS
                                        + INJECTION_KEYS + HOSTILE_KEYS + TTFT_KEYS + STARTUP_KEYS)


def report_inputs(*, bad_positions=False, hostile_ok=True):
    llama = Setup("llama", Path("/m/tiny-llama"), policy="fail")
    off = Setup("baseline-off", Path("/m/tiny-llama"), policy="open", checksums=False)
    clean = result("clean", verdict="verified", injection=None, output_equal=True)
    clean.request_id = "demo.llama.clean.000.r"
    clean.timings = {"pd_ms": 12.345, "reference_ms": 3.21}
    clean.output = clean.reference = " w17 w17 w3"
    fault = result("flip_bit", status=503, error=MISMATCH_ERR, output_equal=None,
                   reported={0: [1]} if bad_positions else {0: [1, 3]})
    fault.request_id = "demo.llama.flip_bit.000.r"
    for r in (clean, fault):
        judge(r, llama)
    results = {"llama": [PhaseResult("clean", [clean], {"loads_verified": 1}),
                         PhaseResult("flip_bit", [fault], {"loads_mismatched": 1, "mismatched_blocks": 2})]}
    hostile = {"llama": [
        {"payload": "malformed", "status": 503, "error": "kv_checksum_unverified: malformed",
         "verdict": "unverified", "reason": "malformed_payload", "next_request_status": 200, "ok": hostile_ok},
        {"payload": "extreme_values", "status": 503, "error": "kv_checksum_unverified: bounds",
         "verdict": "unverified", "reason": "layout_mismatch", "next_request_status": 200, "ok": True}]}
    ttft = {"requests_each": 2, "on_p50_ms": 105.0, "off_p50_ms": 100.0, "ratio": 1.05, "on_ms": [104.0, 106.0],
            "off_ms": [99.0, 101.0], "failed": {"on": 0, "off": 0}, "errors": {"on": "", "off": ""}}
    startup = {"llama": {"producer": ["KV checksums enabled"], "consumer": ["KV checksums enabled (fail)"]},
               "baseline-off": {"producer": [], "consumer": []}}
    args = argparse.Namespace(device="cpu", mode="pull", requests=1, kinds=["flip_bit"])
    return args, [llama, off], results, hostile, ttft, startup, 12.345


def test_a_ttft_pair_that_fails_requests_fails_the_run():
    args, setups, results, hostile, ttft, startup, wall = report_inputs()
    ttft = dict(ttft, off_p50_ms=None, ratio=None, off_ms=[], failed={"on": 0, "off": 3},
                errors={"on": "", "off": "HTTP 500: EngineCore encountered an issue"})
    report = build_report(args, setups, results, hostile, ttft, startup, wall)
    assert report["ok"] is False
    assert report["failures"] == ["TTFT off: 3 of 3 requests failed (HTTP 500: EngineCore encountered an issue)"]


def test_a_ttft_pair_that_fails_one_request_fails_the_run():
    args, setups, results, hostile, ttft, startup, wall = report_inputs()
    ttft = dict(ttft, failed={"on": 1, "off": 0}, errors={"on": "HTTP 502: ", "off": ""})
    report = build_report(args, setups, results, hostile, ttft, startup, wall)
    assert report["failures"] == ["TTFT on: 1 of 3 requests failed (HTTP 502: )"] and report["ok"] is False


def test_measure_ttft_counts_every_failed_answer_warm_up_included(monkeypatch):
    # The off pair fails its warm-up request only; the on pair serves all.
    answers = {"demo.ttft.off.000.r": (500, {"error": {"message": "EngineCore encountered an issue"}})}
    seen = []

    def fake_completion(client, url, prompt, *, max_tokens, request_id):
        seen.append(request_id)
        return answers.get(request_id, (200, {}))

    monkeypatch.setattr(demo, "completion", fake_completion)
    on, off = (Setup(name, Path("m"), checksums=name == "on") for name in ("on", "off"))
    t = demo.measure_ttft(on, off, "http://proxy", 2)
    assert len(seen) == 6  # 2 requests each plus one warm-up each
    assert t["failed"] == {"on": 0, "off": 1}
    assert t["errors"] == {"on": "", "off": "HTTP 500: EngineCore encountered an issue"}
    assert len(t["on_ms"]) == 2 and len(t["off_ms"]) == 2  # warm-ups are not timed


def test_build_report_schema_and_values():
    report = build_report(*report_inputs())
    json.loads(json.dumps(report))  # serialisable as written
    assert set(report) == set(TOP_KEYS)
    assert set(report["machine"]) == set(MACHINE_KEYS)
    assert report["machine"]["device"] == "cpu" and report["machine"]["cpus"] == os.cpu_count()
    assert (report["wall_s"], report["mode"], report["requests_per_phase"]) == (12.3, "pull", 1)
    assert report["failures"] == [] and report["ok"] is True
    assert report["ttft"]["ratio"] == 1.05 and set(report["ttft"]) == set(TTFT_KEYS)

    assert [s["name"] for s in report["setups"]] == ["llama"]  # a setup without results is left out
    entry = report["setups"][0]
    assert set(SETUP_KEYS) <= set(entry)
    assert (entry["model"], entry["hybrid_kv_cache_manager"], entry["policy"], entry["fail_closed"],
            entry["producer_tp"], entry["consumer_tp"]) == ("/m/tiny-llama", True, "fail", True, 1, 1)
    assert entry["startup_log"] == {"producer": ["KV checksums enabled"],
                                    "consumer": ["KV checksums enabled (fail)"]}
    assert [h["payload"] for h in entry["hostile_client"]] == ["malformed", "extreme_values"]
    for h in entry["hostile_client"]:
        assert set(HOSTILE_KEYS) <= set(h)

    assert [p["phase"] for p in entry["phases"]] == ["clean", "flip_bit"]
    for p in entry["phases"]:
        assert set(PHASE_KEYS) <= set(p), p["phase"]
        for inj in p["injections"]:
            assert set(INJECTION_KEYS) <= set(inj)
    clean, fault = entry["phases"]
    assert {k: clean[k] for k in PHASE_KEYS[1:-1]} == {
        "requests": 1, "metrics": {"loads_verified": 1}, "false_mismatches": 0, "outputs_equal": 1, "outputs": 1,
        "http_errors": 0}
    assert clean["injections"][0]["timings_ms"] == {"pd_ms": 12.3, "reference_ms": 3.2}
    assert clean["injections"][0]["kind"] is None and clean["injections"][0]["expected"] == "verified"
    # The texts output_equal compared, kept for whoever reads the report.
    assert (clean["injections"][0]["output"], clean["injections"][0]["reference"]) == (" w17 w17 w3", " w17 w17 w3")
    assert {k: fault[k] for k in PHASE_KEYS[1:-1]} == {
        "requests": 1, "metrics": {"loads_mismatched": 1, "mismatched_blocks": 2}, "false_mismatches": 0,
        "outputs_equal": 0, "outputs": 0, "http_errors": 1}
    assert fault["injections"] == [{
        "request_id": "demo.llama.flip_bit.000.r", "kind": "flip_bit", "group": 0, "positions": [3, 1],
        "block_ids": [11, 13], "skipped": None, "expected": "mismatch", "verdict": "mismatch", "reason": None,
        "reported": {"0": [1, 3]}, "status": 503, "output_equal": None, "ok": True, "problem": "",
        "where": None, "producer_recheck": None, "output": None, "reference": None, "output_class": None,
        "output_evidence": None, "timings_ms": {}}]


def test_an_alert_problem_fails_the_run():
    args, setups, results, hostile, ttft, startup, wall = report_inputs()
    report = build_report(args, setups, results, hostile, ttft, startup, wall)
    assert [p["alerts"] for p in report["setups"][0]["phases"]] == [None, None]  # no --alerts
    results["llama"][0].alerts = {"expected": ["nothing pending or firing"], "seen": [],
                                  "problems": ["KVChecksumMismatch firing for llama-consumer after the clean phase"]}
    report = build_report(args, setups, results, hostile, ttft, startup, wall)
    assert report["ok"] is False and report["failures"] == [
        "llama/clean/alerts: KVChecksumMismatch firing for llama-consumer after the clean phase"]
    assert report["setups"][0]["phases"][0]["alerts"]["expected"] == ["nothing pending or firing"]


def test_build_report_failures():
    report = build_report(*report_inputs(bad_positions=True))
    assert report["ok"] is False
    assert report["failures"] == [
        "llama/flip_bit/demo.llama.flip_bit.000.r: reported positions {0: [1]}, injected {0: [1, 3]}"]
    report = build_report(*report_inputs(hostile_ok=False))
    assert report["ok"] is False
    assert report["failures"] == ["llama/hostile/malformed: verdict unverified, status 503, next 200"]


def table_rows(out: str, setup: str) -> list[list[str]]:
    return [ln.split() for ln in out.splitlines() if ln.split()[:1] == [setup]]


def test_print_table_one_row_per_phase(capsys):
    print_table(build_report(*report_inputs()))
    out = capsys.readouterr().out
    rows = table_rows(out, "llama")
    phase_rows = [r for r in rows if not r[1].startswith("hostile:")]
    assert [r[1] for r in phase_rows] == ["clean", "flip_bit"]
    # setup phase reqs verif mism unver detected false out=ref
    assert phase_rows[0][:9] == ["llama", "clean", "1", "1", "0", "0", "-", "0", "1/1"]
    assert phase_rows[1][:9] == ["llama", "flip_bit", "1", "0", "1", "0", "1/1", "0", "0/0"]
    assert len(rows) - len(phase_rows) == 2  # the two hostile payloads
    # Positions in one notation, reported / injected, each sorted.
    assert " ".join(phase_rows[1][-5:]) == "g0:[1, 3] / g0:[1, 3]", phase_rows[1]
    assert "{'0'" not in out and "{0:" not in out
    assert "ratio 1.05" in out
    assert "every check passed" in out and "FAIL" not in out


def test_the_table_has_a_legend_for_every_column(capsys):
    print_table(build_report(*report_inputs()))
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.startswith("setup "))
    legend = "\n".join(lines[header + 1:])
    for column in ("reqs", "verif / mism / unver", "detected", "false", "out=ref", "where", "positions"):
        assert re.search(rf"(^|\. ){re.escape(column)}: \S", legend, re.M), column
    assert "gG:[block positions]" in legend and "intact on P" in legend and "0/0" in legend


def test_the_ttft_line_says_what_it_times_and_why_it_is_noise_here(capsys):
    report = build_report(*report_inputs())
    print_table(report)
    out = capsys.readouterr().out
    [line] = [ln for ln in out.splitlines() if ln.startswith("TTFT p50")]
    assert "prefill on the producer, KV transfer, first token on the consumer" in line
    assert "2 single requests each" in line and "ratio 1.05" in line
    caveat = out.splitlines()[out.splitlines().index(line) + 1]
    assert caveat.startswith("  Noise, not a cost: single requests on a shared") and "docs/performance.md" in caveat
    report["machine"]["device"] = "cuda"
    print_table(report)
    out = capsys.readouterr().out
    assert "Noise" not in out and "A smoke test, not a benchmark" in out


def test_positions_text():
    assert demo.positions_text({}) == "-"
    assert demo.positions_text({"1": [4, 0], "0": [3]}) == "g0:[3] g1:[0, 4]"
    assert demo.positions_text({10: [1], 2: [2]}) == "g2:[2] g10:[1]"


def test_print_table_lists_failures(capsys):
    print_table(build_report(*report_inputs(bad_positions=True)))
    out = capsys.readouterr().out
    rows = [r for r in table_rows(out, "llama") if not r[1].startswith("hostile:")]
    assert [r[1] for r in rows] == ["clean", "flip_bit"]
    assert rows[1][6] == "0/1"  # the injection was not reported where it was made
    assert "1 check(s) FAILED:" in out
    assert "  FAIL llama/flip_bit/demo.llama.flip_bit.000.r: reported positions" in out


def test_build_report_fails_a_setup_that_stopped_or_never_ran():
    args, setups, results, hostile, ttft, startup, wall = report_inputs()
    args.kinds = ["flip_bit", "swap_blocks"]  # swap_blocks never ran
    report = build_report(args, setups, results, hostile, ttft, startup, wall,
                          {"llama": "ScrapeError: /metrics timed out"})
    assert not report["ok"]
    assert "llama: ScrapeError: /metrics timed out" in report["failures"]
    assert any("phases ['clean', 'flip_bit'] ran" in f for f in report["failures"])
    missing = Setup("gemma2-merged", Path("/m/g"), policy="open")
    report = build_report(args, [*setups, missing], results, hostile, ttft, startup, wall)
    assert "gemma2-merged: no phase ran" in report["failures"]


def test_prompts_differ_in_their_first_block():
    keys = [f"demo.{s}.{k}.{i:03d}.r" for s in ("llama", "gemma2-hybrid") for k in FAULT_KINDS for i in range(40)]
    firsts = {tuple(demo.prompt_of(k).split()[:32]) for k in keys}
    assert len(firsts) == len(keys)


def test_out_dir_keeps_files_that_are_not_the_demos(tmp_path, monkeypatch):
    keep = tmp_path / "Makefile"
    keep.write_text("x")
    old = tmp_path / "llama.consumer.log"
    old.write_text("old run")
    monkeypatch.setattr(demo, "choose_setups", lambda args: [])
    with pytest.raises(SystemExit):
        demo.main(["--out", str(tmp_path)])
    assert keep.exists() and not old.exists()


# -- where each mismatch happened (join_where) ---------------------------------

def incident_log(*lines: dict) -> str:
    return "".join(f"(EngineCore pid=1) ERROR 12-05 01:00:00 [incident.py:1] {incident.INCIDENT_MARK}"
                   f"{json.dumps(line)}\n" for line in lines)


def consumer_line(request_id: str, positions=(1, 3)) -> dict:
    return {"side": "consumer", "verdict": "mismatch", "source": "producer", "request_id": f"cmpl-{request_id}-0",
            "remote_request_id": f"{request_id}-p", "remote_engine_id": "P", "groups": {"0": list(positions)}}


def producer_line(request_id: str, verdict: str, positions=()) -> dict:
    return {"side": "producer", "verdict": verdict, "request_id": f"{request_id}-p", "transfer_id": None,
            "engine_id": "P", "groups": {"0": list(positions)} if positions else {}}


def joined(tmp_path, monkeypatch, res: RequestResult, consumer: list[dict], producer: list[dict]) -> RequestResult:
    monkeypatch.setattr(demo, "WHERE_WAIT_S", 0.0)
    setup = Setup("x", Path("/m"), policy="open")
    for side, lines in (("consumer", consumer), ("producer", producer)):
        setup.logs[side] = tmp_path / f"{side}.log"
        setup.logs[side].write_text(incident_log(*lines))
    res.ok, res.problem = True, ""
    demo.join_where(setup, [PhaseResult(res.phase, [res])])
    return res


def test_a_consumer_fault_is_intact_on_the_producer(tmp_path, monkeypatch):
    r = result()
    r = joined(tmp_path, monkeypatch, r, [consumer_line(r.request_id)], [producer_line(r.request_id, "intact")])
    assert (r.ok, r.where, r.producer_recheck) == (True, incident.INTACT_ON_PRODUCER, "intact")
    # A producer that says its KV changed, where nothing was injected there, is a failure.
    r = joined(tmp_path, monkeypatch, result(), [consumer_line(r.request_id)],
               [producer_line(r.request_id, "changed", (1,))])
    assert not r.ok and "expected 'intact on the producer" in r.problem
    # So is a verified load the producer never re-checked.
    r = joined(tmp_path, monkeypatch, result("clean", verdict="verified", injection=None), [], [])
    assert not r.ok and "no re-check line" in r.problem
    # And a mismatch with no incident line.
    r = joined(tmp_path, monkeypatch, result(), [], [producer_line(r.request_id, "intact")])
    assert not r.ok and "no incident line" in r.problem
    # A read-after-release line after the re-check's is no re-check: the re-check stands.
    r = result()
    r = joined(tmp_path, monkeypatch, r, [consumer_line(r.request_id)],
               [producer_line(r.request_id, "intact"), producer_line(r.request_id, incident.READ_AFTER_RELEASE)])
    assert r.producer_recheck == "intact"


def test_a_producer_flip_is_changed_on_the_producer(tmp_path, monkeypatch):
    inj = {"kind": "flip_bit", "group": 0, "positions": [3], "skipped": None, "expect": "mismatch"}
    r = result(demo.PRODUCER_FLIP, injection=inj, reported={0: [3]})
    r = joined(tmp_path, monkeypatch, r, [consumer_line(r.request_id, (3,))],
               [producer_line(r.request_id, "changed", (3,))])
    assert (r.ok, r.where) == (True, incident.CHANGED_ON_PRODUCER), r.problem
    # The consumer read before the flip: verified, and still changed on the producer.
    r = joined(tmp_path, monkeypatch, result(demo.PRODUCER_FLIP, injection=inj, verdict="verified"), [],
               [producer_line(r.request_id, "changed", (3,))])
    assert (r.ok, r.where) == (True, None), r.problem
    # A re-check that misses the flip, or names other blocks, fails.
    for line in (producer_line(r.request_id, "intact"), producer_line(r.request_id, "changed", (2,))):
        r = joined(tmp_path, monkeypatch, result(demo.PRODUCER_FLIP, injection=inj, reported={0: [3]}),
                   [consumer_line(r.request_id, (3,))], [line])
        assert not r.ok and "the producer's re-check reported" in r.problem


def test_the_table_has_a_where_column(capsys):
    args, setups, results, hostile, ttft, startup, wall = report_inputs()
    results["llama"][1].requests[0].where = incident.INTACT_ON_PRODUCER
    print_table(build_report(args, setups, results, hostile, ttft, startup, wall))
    row = next(r for r in table_rows(capsys.readouterr().out, "llama") if r[1] == "flip_bit")
    assert row[9:12] == ["1", "intact", "on"]


# -- the producer_flip_bit phase: its faults, judgement and join ------------------

def test_set_faults_puts_the_producer_flip_on_the_producer_only(tmp_path):
    from vllm_kvchecksum.drills.fault_connector import KNOWN_KINDS

    s = Setup("x", Path("/m"), control_path=tmp_path / "c.json", producer_control_path=tmp_path / "p.json")
    off = {"kinds": [], "rate": 0.0}
    demo.set_faults(s, demo.PRODUCER_FLIP)
    producer = json.loads(s.producer_control_path.read_text())
    assert producer == {"kinds": ["flip_bit"], "rate": 1.0} and set(producer["kinds"]) <= set(KNOWN_KINDS)
    assert json.loads(s.control_path.read_text()) == off
    demo.set_faults(s, "swap_heads")
    assert json.loads(s.control_path.read_text()) == {"kinds": ["swap_heads"], "rate": 1.0}
    assert json.loads(s.producer_control_path.read_text()) == off


def test_judge_of_the_producer_flip_phase():
    inj = {"kind": "flip_bit", "group": 0, "positions": [3], "skipped": None, "expect": "mismatch"}
    # Read before the flip landed: the consumer's KV was good (the join judges the producer's re-check),
    # so neither its verdict, its output nor its (no) reported positions are a problem.
    r = judged(result(demo.PRODUCER_FLIP, verdict="verified", injection=inj), "fail")
    assert r.ok is True and r.problem == "", r.problem
    # A mismatch there must name the flipped positions.
    r = judged(result(demo.PRODUCER_FLIP, injection=inj, reported={0: [2]}, status=503,
                      error="kv_checksum_mismatch: x", output_equal=None), "fail")
    assert r.ok is False and r.problem == "reported positions {0: [2]}, injected {0: [3]}", r.problem
    # Anything else than the expected verdict is a problem, in this phase as in the consumer's.
    r = judged(result(demo.PRODUCER_FLIP, verdict="unverified", reason="missing_workers", injection=inj), "open")
    assert r.ok is False and r.problem.startswith("verdict unverified")
    r = judged(result("flip_bit", verdict="verified", output_equal=True), "open")
    assert r.ok is False and r.problem.startswith("verdict verified (None), expected mismatch")


def test_run_request_of_the_producer_flip(tmp_path, monkeypatch):
    rid = "demo.x.producer_flip_bit.000.r"
    s = Setup("x", Path("/m"), policy="fail", injections_path=tmp_path / "c.jsonl",
              producer_injections_path=tmp_path / "p.jsonl")
    s.urls = {"producer": "http://p", "consumer": "http://c"}
    s.logs["consumer"] = tmp_path / "consumer.log"
    s.injections_path.write_text("")
    flip = {"request_id": f"cmpl-{rid}-0-p", "kind": "flip_bit", "group": 0, "positions": [2], "skipped": None,
            "expect": "mismatch"}
    s.producer_injections_path.write_text(json.dumps(flip) + "\n")
    urls = []

    def completion(client, url, prompt, **kw):
        urls.append(url)
        return 200, {"choices": [{"text": "same"}]}

    monkeypatch.setattr(demo, "completion", completion)
    monkeypatch.setattr(demo, "checksum_counts", lambda url: {})
    monkeypatch.setattr(demo, "wait_for_verdict", lambda url, before: {"loads_verified": 1})
    r = demo.run_request(None, s, "http://proxy", demo.PRODUCER_FLIP, 0)
    assert r.injection == flip and r.expected == "mismatch"
    # Its output is compared with the producer's own, under "fail" too.
    assert urls[0] == "http://p" and r.output_equal is True
    assert "no injection recorded" not in r.problem and "output differs" not in r.problem, r.problem


def test_run_request_keeps_both_texts(tmp_path, monkeypatch):
    s = Setup("x", Path("/m"), policy="open", injections_path=tmp_path / "c.jsonl")
    s.urls = {"producer": "http://p", "consumer": "http://c"}
    s.logs["consumer"] = tmp_path / "consumer.log"
    s.injections_path.write_text("")
    texts = {"http://p": " w1 w2", "http://proxy/pairs/x": " w1 w9"}
    monkeypatch.setattr(demo, "completion", lambda client, url, prompt, **kw: (200, {"choices": [{"text": texts[url]}]}))
    monkeypatch.setattr(demo, "checksum_counts", lambda url: {})
    monkeypatch.setattr(demo, "wait_for_verdict", lambda url, before: {"loads_verified": 1})
    r = demo.run_request(None, s, "http://proxy", "clean", 0)
    assert (r.output, r.reference, r.output_equal) == (" w1 w9", " w1 w2", False)
    assert r.problem == "output differs from the single-engine reference"


def test_where_column_counts_mismatches_only():
    assert demo.where_column([{"verdict": "verified", "where": None}, {"verdict": "unverified"}]) == "-"
    assert demo.where_column([{"verdict": "mismatch", "where": incident.INTACT_ON_PRODUCER},
                              {"verdict": "verified", "where": None},
                              {"verdict": "mismatch", "where": None}]) == "1 intact on P, 1 no line"
    # Every answer of the join has its short name in the table.
    answers = [incident.RELEASED_BEFORE_READ, incident.CHANGED_ON_PRODUCER, incident.INTACT_ON_PRODUCER,
               incident.NOT_RECHECKED, incident.UNKNOWN_ATTEMPT, incident.UNKNOWN_RELEASED, incident.WRONG_REQUEST]
    for answer in answers:
        column = demo.where_column([{"verdict": "mismatch", "where": answer}])
        assert column.startswith("1 ") and len(column) < 25, column
        assert column[2:] in demo.TABLE_LEGEND[-2], column


def test_join_more_producer_flip_and_recheck_cases(tmp_path, monkeypatch):
    # The flip of several blocks: the injection lists them in any order.
    inj = {"kind": "flip_bit", "group": 0, "positions": [4, 2], "skipped": None, "expect": "mismatch"}
    r = result(demo.PRODUCER_FLIP, injection=inj, reported={0: [2, 4]})
    r = joined(tmp_path, monkeypatch, r, [consumer_line(r.request_id, (2, 4))],
               [producer_line(r.request_id, "changed", (2, 4))])
    assert (r.ok, r.where) == (True, incident.CHANGED_ON_PRODUCER), r.problem
    # A verified load whose producer says its KV changed, or could not re-check, with nothing injected there.
    for verdict in ("changed", "not_rechecked"):
        r = result("clean", verdict="verified", injection=None)
        r = joined(tmp_path, monkeypatch, r, [], [producer_line(r.request_id, verdict, (1,))])
        assert not r.ok and f"the producer's re-check says {verdict}" in r.problem
    # A producer line found by its transfer id (Mooncake: the router's id), not its own request id.
    r = result("clean", verdict="verified", injection=None)
    line = {**producer_line("other", "intact"), "request_id": "cmpl-own-id-0",
            "transfer_id": f"xfer-{r.request_id}"}
    r = joined(tmp_path, monkeypatch, r, [], [line])
    assert (r.ok, r.producer_recheck) == (True, "intact"), r.problem


def test_join_waits_for_every_producer_line(tmp_path, monkeypatch):
    import threading

    a, b = result("clean", verdict="verified", injection=None), result("clean", verdict="verified", injection=None)
    b.request_id = b.request_id.replace("000", "001")
    setup = Setup("x", Path("/m"), policy="open")
    for side in ("consumer", "producer"):
        setup.logs[side] = tmp_path / f"{side}.log"
    setup.logs["consumer"].write_text("")
    setup.logs["producer"].write_text(incident_log(producer_line(a.request_id, "intact")))

    def late():
        with setup.logs["producer"].open("a") as f:
            f.write(incident_log(producer_line(b.request_id, "intact")))

    monkeypatch.setattr(demo, "WHERE_WAIT_S", 30.0)
    timer = threading.Timer(0.3, late)
    timer.start()
    try:
        for r in (a, b):
            r.ok, r.problem = True, ""
        demo.join_where(setup, [PhaseResult("clean", [a, b])])
    finally:
        timer.join()
    assert (a.producer_recheck, b.producer_recheck) == ("intact", "intact")
    assert a.ok and b.ok, (a.problem, b.problem)


def test_the_hostile_clients_forgeries_decode_from_a_bound_payload():
    """The extreme forgery is a valid payload built from a real (bound) one: the consumer
    must get past decoding to show it keeps serving a payload no block lines up with."""
    import numpy as np

    from kvcs_demo.demo import forged_payloads
    from vllm_kvchecksum.core.payload import KVChecksumPayload, PayloadBinding, PayloadGroup

    real = KVChecksumPayload(num_tokens=77, producer_tp_size=1,
                             groups={0: PayloadGroup(5, 16, 0, np.arange(5, dtype=np.uint64))},
                             binding=PayloadBinding(32, np.arange(3, dtype=np.uint64))).encode()
    forged = forged_payloads(real)
    extreme = KVChecksumPayload.decode(forged["extreme_values"])
    assert extreme.binding is None and extreme.groups[0].num_blocks == 1
    try:
        KVChecksumPayload.decode(forged["malformed"])
    except ValueError:
        pass
    else:
        raise AssertionError("the malformed forgery decoded")
