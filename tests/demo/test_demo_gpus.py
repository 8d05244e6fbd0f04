"""`make demo VLLM_DEVICE=cuda` on the GPUs a host has: which GPU each server
gets, how much of it, which setups fit, and the refusal where there is none.

No GPU here: what is checked is the plan the demo makes before any server
starts (kvcs_demo.setups.gpu_plan, visible_gpus; demo.fitting_setups), and
that without a GPU the demo stops before starting one.
"""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import pytest

from kvcs_demo import demo
from kvcs_demo.demo import choose_setups, parse_args
from kvcs_demo.setups import GPU_MEMORY_SHARE, Setup, gpu_plan, gpu_setups, visible_gpus

X = Path("X")


@pytest.fixture(autouse=True)
def _no_device_env(monkeypatch):
    monkeypatch.delenv("VLLM_DEVICE", raising=False)


def flag(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, (name, argv)
    return argv[argv.index(name) + 1]


def test_one_gpu_shared_by_every_server():
    """A one-GPU host: the TP1 pair and the TTFT baseline (4 servers) share
    GPU 0, each with a quarter of GPU_MEMORY_SHARE (vLLM refuses to start a
    server asking for more than is free)."""
    setups = [s for s in gpu_setups(X) if s.producer_tp == s.consumer_tp == 1]
    plan, util = gpu_plan(setups, ["0"])
    assert plan == {("tp1-tp1", "producer"): ["0"], ("tp1-tp1", "consumer"): ["0"],
                    ("baseline-off", "producer"): ["0"], ("baseline-off", "consumer"): ["0"]}
    assert util == 0.21
    assert 4 * util <= GPU_MEMORY_SHARE


def test_eight_gpus_wrap_round_and_keep_tp_ranks_apart():
    """The four default setups need 10 GPUs; on 8 the last pair wraps round to
    GPUs 0 and 1, which then hold two servers each; a TP2 server's two ranks
    are always on two GPUs."""
    gpus = [str(i) for i in range(8)]
    plan, util = gpu_plan(gpu_setups(X), gpus)
    assert plan[("tp2-tp1", "producer")] == ["2", "3"]
    assert plan[("tp1-tp2", "consumer")] == ["6", "7"]
    assert plan[("baseline-off", "producer")] == ["0"] and plan[("baseline-off", "consumer")] == ["1"]
    load = Counter(g for ids in plan.values() for g in ids)
    assert set(load) == set(gpus) and max(load.values()) == 2
    assert util == 0.3  # 0.85 / 2 is more than a server with a GPU of its own takes
    assert all(len(set(ids)) == len(ids) for ids in plan.values())


def test_tp2_on_a_single_gpu_is_refused():
    with pytest.raises(ValueError, match=r"tp2-tp1: the producer has tensor parallel size 2, which needs 2 GPUs; "
                                         r"1 visible \(7\)"):
        gpu_plan(gpu_setups(X), ["7"])
    with pytest.raises(ValueError, match="no GPU"):
        gpu_plan(gpu_setups(X), [])


def test_server_specs_on_one_gpu(tmp_path):
    """The command lines and environments the servers get on a one-GPU host
    (CUDA_VISIBLE_DEVICES as the host names the GPU: an index or a UUID)."""
    setups = [s for s in gpu_setups(X) if s.name in ("tp1-tp1", "baseline-off")]
    specs = demo.server_specs(setups, "cuda", tmp_path, "py", ["GPU-5d2c"])
    servers = [spec for ss in specs.values() for spec in ss]
    assert len(servers) == 4
    for spec in servers:
        assert spec.env["CUDA_VISIBLE_DEVICES"] == "GPU-5d2c"
        assert flag(spec.argv, "--gpu-memory-utilization") == "0.21"


def test_default_setups_that_do_not_fit_are_left_out(capsys):
    args = parse_args(["--device", "cuda", "--model", "X", "--gpus", "0"])
    assert args.gpus == ["0"]
    assert [s.name for s in choose_setups(args)] == ["tp1-tp1", "baseline-off"]
    out = capsys.readouterr().out
    assert "left out tp2-tp1, tp1-tp2: tensor parallel 2 needs 2 GPUs, and 1 is visible (0)" in out
    args = parse_args(["--device", "cuda", "--model", "X", "--gpus", "0,1"])
    assert [s.name for s in choose_setups(args)] == ["tp1-tp1", "tp2-tp1", "tp1-tp2", "baseline-off"]


def test_a_named_setup_that_does_not_fit_stops_the_demo():
    args = parse_args(["--device", "cuda", "--model", "X", "--gpus", "3", "--setups", "tp1-tp2"])
    with pytest.raises(SystemExit, match=r"setups tp1-tp2: tensor parallel 2 needs 2 GPUs, and 1 is visible \(3\); "
                                         r"choose others with --setups, or give more GPUs"):
        choose_setups(args)


def test_gpus_flag(capsys):
    assert parse_args(["--device", "cuda", "--model", "X", "--gpus", " 2, 3 ,"]).gpus == ["2", "3"]
    assert parse_args(["--device", "cuda", "--model", "X"]).gpus is None  # found when the demo runs
    for argv, err in ((["--gpus", "0"], "--gpus is for --device cuda"),
                      (["--device", "cuda", "--model", "X", "--gpus", ","], "--gpus names no GPU")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert err in capsys.readouterr().err


def test_visible_gpus_from_cuda_visible_devices():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "1,3"}) == ["1", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-aa, GPU-bb"}) == ["GPU-aa", "GPU-bb"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []  # set and empty: CUDA sees none either


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this host has nvidia-smi")
def test_without_a_gpu_the_cuda_demo_stops_before_any_server(monkeypatch, tmp_path):
    """Here (no nvidia-smi, no CUDA_VISIBLE_DEVICES) the demo finds no GPU and
    says so, before it makes a setup or starts a server."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_gpus() == []

    def no_servers(*a, **kw):
        raise AssertionError("the demo went on without a GPU")
    monkeypatch.setattr(demo, "choose_setups", no_servers)
    monkeypatch.setattr(demo, "ProcessGroup", no_servers)
    with pytest.raises(SystemExit, match=r"--device cuda: no GPU found .*name the GPUs with --gpus"):
        demo.main(["--device", "cuda", "--model", str(tmp_path), "--out", str(tmp_path / "out")])


def test_cpu_servers_get_no_gpu_plan(tmp_path):
    specs = demo.server_specs([Setup("llama", X)], "cpu", tmp_path, "py")
    for spec in specs["llama"]:
        assert "CUDA_VISIBLE_DEVICES" not in spec.env and "--gpu-memory-utilization" not in spec.argv
