"""What the demo serves: models, P/D pairs, and the vLLM command lines.

A setup is one producer/consumer pair of real vLLM OpenAI servers on one
model. The CPU default runs three: the tiny Llama (one KV cache group,
consumer fail-closed with kv_load_failure_policy "fail"), the tiny Gemma-2
with the hybrid KV cache manager on (a sliding-window group and a full
group; fail-closed with "recompute"), and the same Gemma-2 with it off (one
merged group that NIXL sends whole; fail-open), plus a Llama pair without
checksums for the TTFT baseline. Each policy is shown on real servers, and
each fault kind runs on each layout.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
CPU_SITE = Path(__file__).resolve().parent / "cpu_site"
BLOCK_SIZE = 32  # the CPU attention backend takes multiples of 32 only
MAX_MODEL_LEN = 512

# Policy name -> (kv_checksum_fail_closed, kv_load_failure_policy).
POLICIES = {"fail": (True, "fail"), "recompute": (True, "recompute"), "open": (False, "fail")}
# Mode -> the connector both servers run. pull: the consumer READs the KV
# over NIXL after the producer answered; push: the consumer registers its
# blocks with the producer, which WRITEs the KV into them over NIXL
# (nixl/push_*.py); mooncake: Mooncake P2P (mooncake/mooncake_connector.py),
# the consumer pulls the KV by a transfer id the proxy gives both legs.
CONNECTORS = {"pull": "NixlConnector", "push": "NixlPushConnector", "mooncake": "MooncakeConnector"}
MODES = tuple(CONNECTORS)
# The producers' NIXL side channel host: vLLM's default
# (VLLM_NIXL_SIDE_CHANNEL_HOST), which the demo does not change. Push mode
# hands it to the consumers (through the proxy) before the producer answers.
NIXL_SIDE_CHANNEL_HOST = "localhost"
# Mooncake mode: the Transfer Engine over TCP (no RDMA device here), and
# every address the servers publish on loopback: without VLLM_HOST_IP,
# vLLM's get_ip() picks the host's first non-loopback address.
MOONCAKE_PROTOCOL = "tcp"
MOONCAKE_HOST = "127.0.0.1"
# GPU hosts: vLLM's --gpu-memory-utilization is each server's share of its
# GPUs' memory, checked against the memory free when it starts. A server with
# GPUs of its own takes GPU_MEMORY_PER_SERVER; servers that share a GPU (a
# host with fewer GPUs than the setups have servers) split GPU_MEMORY_SHARE of
# it, leaving the rest to the CUDA contexts.
GPU_MEMORY_PER_SERVER = 0.3
GPU_MEMORY_SHARE = 0.85


@dataclass
class Setup:
    """One producer/consumer pair."""

    name: str
    model: Path
    hybrid: bool = True  # the hybrid KV cache manager (off: --disable-hybrid-kv-cache-manager)
    policy: str = "fail"  # a POLICIES key: what the consumer does with a failed check
    checksums: bool = True  # enable_kv_checksum on both servers
    faults: bool = True  # the consumer wraps its connector in the fault-injecting one
    producer_tp: int = 1
    consumer_tp: int = 1
    mode: str = "pull"  # a MODES key: the connector mode of both servers
    # Set when the servers start.
    urls: dict[str, str] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)
    side_ports: dict[str, int] = field(default_factory=dict)  # NIXL side channel base port
    bootstrap_port: int | None = None  # mooncake mode: the producer's bootstrap server
    control_path: Path | None = None
    injections_path: Path | None = None
    # The producer's drill connector (faults in its held sends, target "sends").
    producer_control_path: Path | None = None
    producer_injections_path: Path | None = None
    # Ground truth (the drill's witness_path): digests of the bytes each
    # producer request sent and each load received (kvcs_soak.truth).
    witness_paths: dict[str, Path] = field(default_factory=dict)

    @property
    def fail_closed(self) -> bool:
        return POLICIES[self.policy][0]


def make_models(build: Path) -> dict[str, Path]:
    """The tiny random models (made once under build/, nothing downloaded)."""
    sys.path.insert(0, str(SCRIPTS))
    from make_tiny_model import make, make_gemma2

    return {"llama": make(build / "tiny-llama").resolve(), "gemma2": make_gemma2(build / "tiny-gemma2").resolve()}


def cpu_setups(models: dict[str, Path], model: Path | None, producer_tp: int, ttft: bool) -> list[Setup]:
    """The default CPU run (see the module docstring). model: another model
    directory, served in place of the tiny Llama and Gemma-2 (one setup per
    policy, hybrid manager on)."""
    if model is not None:
        setups = [Setup("model-fail", model, policy="fail", producer_tp=producer_tp),
                  Setup("model-recompute", model, policy="recompute", producer_tp=producer_tp),
                  Setup("model-open", model, policy="open", producer_tp=producer_tp)]
        base = model
    else:
        setups = [Setup("llama", models["llama"], policy="fail", producer_tp=producer_tp),
                  Setup("gemma2-hybrid", models["gemma2"], hybrid=True, policy="recompute",
                        producer_tp=producer_tp),
                  Setup("gemma2-merged", models["gemma2"], hybrid=False, policy="open", producer_tp=producer_tp)]
        base = models["llama"]
    if ttft:
        # The same connector stack as the checked pairs (the drill wrapper,
        # never switched on), so on/off differ by the checksums alone.
        setups.append(Setup("baseline-off", base, policy="open", checksums=False, producer_tp=producer_tp))
    return setups


def gpu_setups(model: Path) -> list[Setup]:
    """The GPU-host run: TP1->TP1, producer TP2 -> consumer TP1, TP1 -> TP2."""
    return [Setup("tp1-tp1", model, policy="fail"),
            Setup("tp2-tp1", model, policy="fail", producer_tp=2),
            Setup("tp1-tp2", model, policy="fail", consumer_tp=2),
            Setup("baseline-off", model, policy="open", checksums=False)]


def visible_gpus(env: dict[str, str] | None = None) -> list[str]:
    """The GPUs the demo's servers may use: CUDA_VISIBLE_DEVICES when it is set
    (indices or UUIDs, as CUDA takes them), else every GPU `nvidia-smi -L`
    lists; [] when there is none (or no nvidia-smi)."""
    env = os.environ if env is None else env
    if env.get("CUDA_VISIBLE_DEVICES") is not None:
        return [g.strip() for g in env["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    return [str(i) for i, line in enumerate(ln for ln in out.stdout.splitlines() if ln.startswith("GPU "))]


def gpu_plan(setups: list[Setup], gpus: list[str]) -> tuple[dict[tuple[str, str], list[str]], float]:
    """Each server's GPUs, keyed (setup name, "producer"|"consumer"): handed
    out in turn from `gpus`, round again from the first when the servers need
    more than there are; and the --gpu-memory-utilization of every server
    (servers sharing a GPU split GPU_MEMORY_SHARE of it). A server's tensor
    parallel ranks need GPUs of their own: ValueError when one has more ranks
    than there are GPUs."""
    if not gpus:
        raise ValueError("no GPU to run the servers on")
    plan: dict[tuple[str, str], list[str]] = {}
    turn = 0
    for s in setups:
        for side, tp in (("producer", s.producer_tp), ("consumer", s.consumer_tp)):
            if tp > len(gpus):
                raise ValueError(f"{s.name}: the {side} has tensor parallel size {tp}, which needs {tp} GPUs; "
                                 f"{len(gpus)} visible ({','.join(gpus)})")
            plan[(s.name, side)] = [gpus[(turn + k) % len(gpus)] for k in range(tp)]
            turn += tp
    most = max(Counter(g for ids in plan.values() for g in ids).values())
    util = min(GPU_MEMORY_PER_SERVER, math.floor(GPU_MEMORY_SHARE / most * 100) / 100)
    return plan, util


def producer_engine_id(setup: Setup) -> str:
    """The producer's NIXL engine id in push mode (set, not vLLM's random
    one: the consumer registers its blocks with it before the producer
    answers)."""
    return f"kvcs-demo-{setup.name}-producer"


def push_target(setup: Setup) -> str:
    """The proxy's --push-target of the pair: the producer's NIXL coordinates."""
    return (f"{setup.name}={producer_engine_id(setup)},{NIXL_SIDE_CHANNEL_HOST}:{setup.side_ports['producer']},"
            f"{setup.producer_tp}")


def bootstrap_url(setup: Setup) -> str:
    """Mooncake mode: the producer's bootstrap server (its worker serves
    /register and /query on VLLM_MOONCAKE_BOOTSTRAP_PORT, all interfaces)."""
    return f"http://{MOONCAKE_HOST}:{setup.bootstrap_port}"


def mooncake_bootstrap(setup: Setup) -> str:
    """The proxy's --bootstrap of the pair (mooncake mode)."""
    return f"{setup.name}={bootstrap_url(setup)}"


def kv_transfer_config(setup: Setup, role: str, device: str, *, control_path: Path | None = None,
                       injections_path: Path | None = None, seed: int = 0, witness_path: Path | None = None) -> dict:
    """The --kv-transfer-config of one server of the pair.

    With checksums the producer re-checks its KV when each transfer completes
    (kv_checksum_producer_recheck), so every mismatch says where it happened.
    With faults both servers wrap their connector in the drill connector: the
    consumer's faults hit loaded KV, the producer's (target "sends") hit the
    KV of a finished request while its transfer runs.
    """
    nixl = {"kv_connector": CONNECTORS[setup.mode], "kv_role": role}  # the transfer connector (NIXL or not)
    if setup.mode == "mooncake":
        # No kv_buffer_device: MooncakeConnector does not read it (it
        # registers the KV caches themselves with its Transfer Engine).
        nixl["kv_connector_extra_config"] = {"mooncake_protocol": MOONCAKE_PROTOCOL}
    elif device == "cpu":
        nixl["kv_buffer_device"] = "cpu"
    config: dict = dict(nixl)
    if setup.mode == "push" and role == "kv_producer":
        config["engine_id"] = producer_engine_id(setup)
    if setup.checksums:
        fail_closed, policy = POLICIES[setup.policy]
        config.update(enable_kv_checksum=True, kv_checksum_fail_closed=fail_closed,
                      kv_load_failure_policy=policy)
        if role == "kv_producer":
            config["kv_checksum_producer_recheck"] = True
    # A producer's drill is judged by its re-check: only with checksums.
    if setup.faults and (role == "kv_consumer" or setup.checksums):
        faults = {"kinds": "all", "rate": 0.0, "seed": seed}
        if role == "kv_producer":
            faults["target"] = "sends"
        if control_path is not None:
            faults["control_path"] = str(control_path)
        if injections_path is not None:
            faults["log_path"] = str(injections_path)
        if witness_path is not None:
            faults["witness_path"] = str(witness_path)
        config.update(kv_connector="KVChecksumFaultConnector",
                      kv_connector_module_path="vllm_kvchecksum.drills.fault_connector",
                      kv_connector_extra_config={"connectors": [nixl], "kv_checksum_faults": faults})
    return config


def vllm_serve(python: str) -> list[str]:
    """`vllm serve` of the environment `python` belongs to: the `vllm` entry
    point beside it (a venv's bin/), else the same CLI run by that Python (a
    Python with no entry point beside it, e.g. /usr/bin/python3)."""
    entry = Path(python).parent / "vllm"
    if Path(python).parent != Path() and entry.is_file() and os.access(entry, os.X_OK):
        return [str(entry), "serve"]
    return [python, "-m", "vllm.entrypoints.cli.main", "serve"]


def server_argv(python: str, setup: Setup, role: str, port: int, device: str, kv_config: dict, *,
                gpu_memory_utilization: float = GPU_MEMORY_PER_SERVER) -> list[str]:
    """The command line of one real vLLM OpenAI server, as an operator runs it: `vllm serve MODEL ...`
    (gpu_memory_utilization: its share of its GPUs, device cuda; gpu_plan)."""
    tp = setup.producer_tp if role == "kv_producer" else setup.consumer_tp
    argv = [*vllm_serve(python), str(setup.model),
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN),
            "--seed", "0", "--tensor-parallel-size", str(tp),
            "--kv-transfer-config", json.dumps(kv_config, separators=(",", ":"))]
    if device == "cpu":
        # Small KV caches: several servers share this machine's memory.
        argv += ["--dtype", "bfloat16", "--enforce-eager", "--block-size", str(BLOCK_SIZE),
                 "--kv-cache-memory-bytes", str(256 * 2**20)]
    else:
        argv += ["--gpu-memory-utilization", str(gpu_memory_utilization), "--block-size", "16"]
    if not setup.hybrid:
        argv.append("--disable-hybrid-kv-cache-manager")
    return argv


def server_env(device: str, side_channel_port: int, gpus: list[int] | None = None, *, mode: str = "pull",
               bootstrap_port: int | None = None) -> dict[str, str]:
    """The environment of one server. Mooncake mode adds VLLM_HOST_IP (both
    servers) and, on the producer (bootstrap_port), the port of the bootstrap
    server its worker starts; pull and push get neither."""
    env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(ROOT), "VLLM_LOGGING_LEVEL": "INFO"}
    if mode == "mooncake":
        env["VLLM_HOST_IP"] = MOONCAKE_HOST
        if bootstrap_port is not None:
            env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(bootstrap_port)
    if device == "cpu":
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # servers share 2 cores; binding would pin them all to one
        # One OpenMP thread per server: several servers' idle OpenMP threads
        # spin-waiting on two cores stall each other's steps for seconds.
        env["OMP_NUM_THREADS"] = "1"
        # NIXL's progress thread pauses 500 us between rounds instead of
        # spinning a core per server (cpu_site/sitecustomize.py says why).
        env["PYTHONPATH"] = os.pathsep.join([str(CPU_SITE), str(ROOT)])
        env["KVCS_NIXL_PTHR_DELAY_US"] = "500"
        env["KVCS_SHM_BUSY_LOOP_S"] = "0.001"
        # Hybrid (Mamba) models: NIXL needs the dim-first conv state layout,
        # which vLLM's CPU platform picks only when it sees NixlConnector by
        # name; the drill's consumers wrap it (docs/fault-drills.md). Both
        # sides get it, so they agree; models without Mamba ignore it.
        env["VLLM_SSM_CONV_STATE_LAYOUT"] = "DS"
    else:
        env["VLLM_GPU_SYNC_CHECK"] = "error"
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    return env
