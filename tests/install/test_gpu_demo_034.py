"""`make demo-0.34` (scripts/gpu_demo_034.py): the vLLM 0.34.0 demo on a GPU host, as far as this
CPU machine takes it.

It has not run on a GPU. What runs here: the script itself (its dry run and
its refusal on a host without a GPU, as subprocesses), the commands it picks
for its own venv and for an environment given with --python, its checks of
real environments (.venv with vLLM 0.32.0, the pip-installed 0.34.0 wheel of
tests/install without torch), real pip failing on the requirement this
index lacks, and its apply step on a copy of the pip-installed 0.34.0 (an
earlier series undone first in a venv of its own, refused in one given).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import vllm034_venv

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_demo_034 as flow  # noqa: E402

from vllm_kvchecksum.install import inplace  # noqa: E402
from vllm_kvchecksum.install.series import read_series  # noqa: E402

SCRIPT = ROOT / "scripts" / "gpu_demo_034.py"
NO_GPU = pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this host has nvidia-smi")


def run_script(*args: str) -> subprocess.CompletedProcess:
    """The script as `make demo-0.34` runs it: the system's python3 (any Python: it needs the standard library
    only), from another directory."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([shutil.which("python3") or sys.executable, str(SCRIPT), *args], capture_output=True,
                          text=True, cwd="/", env=env, timeout=300)


def listing(path: Path):
    return sorted(p.name for p in path.iterdir()) if path.exists() else None


# ----------------------------------------------------------------- the script, here


@NO_GPU
def test_dry_run_prints_the_steps_and_says_it_would_stop_without_a_gpu():
    done = run_script("--dry-run", "--", "--model", "/models/m", "--setups", "tp1-tp1")
    assert done.returncode == 2, done.stdout + done.stderr
    py = str(flow.VENV / "bin" / "python")
    whats = [line for line in done.stdout.splitlines() if line and not line.startswith((" ", "["))]
    assert whats == ["the venv:", f"vLLM {flow.VERSION} and what the demo needs, from the package index (GBs: the "
                     "CUDA wheels):", "the series applied in place (this clone's helper and patches/v0.34.0):",
                     "the demo: its proxy and vLLM servers run by the same Python:"]  # a model given: no tiny one
    assert f"{py} -m pip install --disable-pip-version-check vllm==0.34.0 nixl==1.5.2 msgpack" in done.stdout
    assert f"PYTHONPATH={ROOT} {py} -m vllm_kvchecksum.install apply" in done.stdout
    assert (f"{py} -m kvcs_demo --device cuda --python {py} --out {flow.OUT} --model /models/m --setups tp1-tp1"
            in done.stdout)
    assert "would stop before installing anything: no NVIDIA GPU here: there is no nvidia-smi" in done.stdout


@NO_GPU
def test_without_a_gpu_it_stops_before_installing_anything():
    before = listing(flow.VENV)
    done = run_script()  # no model either: it would make the tiny one, after the checks
    assert done.returncode == 2
    assert done.stderr.startswith("make demo-0.34: no NVIDIA GPU here: there is no nvidia-smi")
    assert "`make demo` (v0.32.0, CPU)" in done.stderr
    assert listing(flow.VENV) == before  # no venv made or changed


def test_what_it_refuses_before_anything(tmp_path):
    for device, args, words in (
            ("cpu", ["--model", "m"], "--device cpu: vLLM 0.34.0 has no CPU engine that runs here"),
            ("cuda", ["--model", "m", "--python=/x"], "--python=/x: set by make demo-0.34"),
            ("cuda", ["--model", "m", "--out", "d"], "--out: set by make demo-0.34")):
        with pytest.raises(flow.FlowError, match=words):
            flow.check_demo_args(device, args)
    flow.check_demo_args("cuda", ["--model=m"])  # passes
    flow.check_demo_args("cuda", [])  # no model: the tiny Llama (test_plan_without_a_model_makes_the_tiny_llama)
    # A driver tool that answers but lists no GPU (true: exit 0, nothing; false: exit 1).
    for tool, exit_code in (("true", 0), ("false", 1)):
        with pytest.raises(flow.FlowError, match=rf"no NVIDIA GPU here: `{tool} -L` lists none \(exit {exit_code}"):
            flow.find_gpus(tool)


def test_plan_for_a_given_environment_installs_nothing():
    steps = flow.plan("/opt/vllm/bin/python", ["--model", "m"])
    assert [s.kind for s in steps] == ["apply", "demo"]
    apply, demo = steps
    assert apply.argv == ["/opt/vllm/bin/python", "-m", "vllm_kvchecksum.install", "apply"]
    assert apply.env == {"PYTHONPATH": str(ROOT)}
    assert demo.argv[:7] == ["/opt/vllm/bin/python", "-m", "kvcs_demo", "--device", "cuda", "--python",
                             "/opt/vllm/bin/python"]
    assert demo.env["PYTHONPATH"].split(os.pathsep) == [str(ROOT / "scripts"), str(ROOT)]


def test_plan_without_a_model_makes_the_tiny_llama():
    steps = flow.plan("/opt/vllm/bin/python", ["--setups", "tp1-tp1"])
    assert [s.kind for s in steps] == ["apply", "model", "demo"]
    assert steps[1].argv == ["/opt/vllm/bin/python", str(ROOT / "scripts" / "make_tiny_model.py"),
                             str(ROOT / "build" / "tiny-llama")]
    assert steps[2].argv[-4:] == ["--setups", "tp1-tp1", "--model", str(ROOT / "build" / "tiny-llama")]
    assert [s.kind for s in flow.plan("/py", ["--model=/m"])] == ["apply", "demo"]


def test_plan_skips_a_current_venv_and_rebuilds_a_stale_one(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    steps = flow.plan(None, ["--model", "m"], venv=venv, base_python="/usr/bin/python3")
    assert [(s.kind, s.runs) for s in steps] == [("venv", True), ("pip", True), ("apply", True), ("demo", True)]
    assert steps[1].argv[0] == steps[2].argv[0] == steps[3].argv[0] == str(venv / "bin" / "python")
    assert steps[0].argv == ["/usr/bin/python3", "-m", "venv", str(venv)]
    (venv / flow.STAMP).write_text(flow.requirements_digest() + "\n")
    steps = flow.plan(None, ["--model", "m"], venv=venv)
    assert [(s.kind, s.runs) for s in steps] == [("venv", False), ("pip", False), ("apply", True), ("demo", True)]
    assert "is current with vllm==0.34.0 nixl==1.5.2 msgpack" in steps[0].text()
    (venv / flow.STAMP).write_text(flow.requirements_digest(("vllm==0.34.0",)) + "\n")  # other requirements
    assert flow.plan(None, ["--model", "m"], venv=venv)[1].runs


# ----------------------------------------------------------------- real environments and real pip


def test_vllm_0_32_is_not_the_environment_it_needs():
    """.venv: the patched v0.32.0 tree as `vllm`."""
    found = flow.probe(sys.executable)
    assert found["vllm"].startswith("0.32.0")
    with pytest.raises(flow.FlowError, match=rf"{sys.executable} has vLLM 0\.32\.0\S*, not 0\.34\.0"):
        flow.check_env(sys.executable, found)


@NO_GPU
def test_a_given_environment_without_torch_is_refused_naming_what_it_lacks(venv034):
    """The pip-installed 0.34.0 wheel alone (tests/install's venv, --no-deps): the right vLLM, nothing
    beside it. The dry run lists both reasons to stop, and installs nothing into that venv."""
    python = str(vllm034_venv.VENV / "bin" / "python")
    found = flow.probe(python)
    assert found["vllm"] == "0.34.0"
    assert found["missing"] == ["torch", "numpy", "msgpack", "nixl", "httpx", "aiohttp", "prometheus_client"]
    done = run_script("--python", python, "--dry-run", "--", "--model", "m")
    assert done.returncode == 2
    assert "no NVIDIA GPU here" in done.stdout
    assert f"{python} lacks torch, numpy, msgpack, nixl, httpx, aiohttp, prometheus_client" in done.stdout
    assert "the venv:" not in done.stdout  # a given environment: no venv, no pip


def test_pip_names_the_requirement_the_index_lacks():
    """Real pip, asked for the requirement of vLLM 0.34.0's CUDA wheel that this project's index lacks
    (--dry-run --no-deps: seconds, nothing installed)."""
    try:
        flow.pip_install(sys.executable, ("flashinfer-python==0.7.3",), extra=("--dry-run", "--no-deps"))
    except flow.FlowError as exc:
        msg = str(exc)
    else:
        pytest.skip("this package index has flashinfer-python==0.7.3: `pip install vllm==0.34.0` may work here")
    if "cannot reach the package index" in msg:
        pytest.skip(msg)
    assert msg.startswith("pip cannot install flashinfer-python==0.7.3: flashinfer-python==0.7.3 is not on the "
                          "package index it uses (the newest there is ")
    assert "make demo-0.34 GPU_PYTHON=/path/to/bin/python" in msg


def test_the_message_of_pips_full_failure():
    """What pip printed for `pip install vllm==0.34.0 nixl==1.5.2 msgpack` here (its last two lines, the
    version list shortened), explained."""
    out = ("ERROR: Could not find a version that satisfies the requirement flashinfer-python==0.7.3 (from vllm) "
           "(from versions: 0.2.0.post1, 0.7.2.post1, 0.7.4)\n"
           "ERROR: No matching distribution found for flashinfer-python==0.7.3\n")
    msg = flow.explain_pip_failure(out)
    assert msg.startswith("pip cannot install vllm==0.34.0 nixl==1.5.2 msgpack: flashinfer-python==0.7.3 is not "
                          "on the package index it uses (the newest there is 0.7.4). vLLM 0.34.0's CUDA wheel")
    assert "PIP_INDEX_URL" in msg
    assert "cannot reach" in flow.explain_pip_failure("... NewConnectionError(...) ...")
    assert flow.explain_pip_failure("x\nsomething else\n").endswith("its last lines:\nx\nsomething else")


# ----------------------------------------------------------------- apply, on a copy of the pip-installed 0.34.0


def apply_step(site: Path) -> flow.Step:
    step = flow.plan(sys.executable, ["--model", "m"])[0]
    step.argv += ["--site", str(site)]
    return step


def test_apply_undoes_an_earlier_series_in_its_own_venv_only(site_copy, tmp_path):
    """An earlier series (here: the 0.34 series less its last patch) applied: a venv of its own gets it
    undone and this clone's applied; an environment given with --python is left as it is."""
    series_dir = ROOT / "patches" / "v0.34.0"
    earlier = tmp_path / "earlier"
    shutil.copytree(series_dir, earlier)
    names = (earlier / "series").read_text().split()
    (earlier / "series").write_text("\n".join(names[:-1]) + "\n")
    inst = inplace.find_install(site_copy)
    inplace.apply(inst, read_series(earlier))
    with pytest.raises(flow.FlowError, match="has another series applied"):
        flow.apply_series(apply_step(site_copy), own=False)
    assert inplace.read_state(inst)["series_digest"] == read_series(earlier).digest
    flow.apply_series(apply_step(site_copy), own=True)
    assert inplace.read_state(inst)["series_digest"] == read_series(series_dir).digest


# ----------------------------------------------------------------- scripts/gpu_check.sh


def test_gpu_check_runs_without_vllm():
    """scripts/gpu_check.sh is the same check for both bases because its test files need no vLLM: they
    import and collect with `import vllm` failing."""
    import re

    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    files = sorted(set(re.findall(r"tests/unit/test_\w+\.py", script)))
    assert "tests/unit/test_host_copy.py" in files and "tests/unit/test_triton_kernel_cuda.py" in files
    code = ("import sys; sys.modules['vllm'] = None\n"  # `import vllm` raises ImportError
            "import pytest\n"
            f"sys.exit(pytest.main(['-p', 'no:cacheprovider', '-q', '--collect-only', *{files!r}]))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert re.search(r"^\d+ tests collected", done.stdout, re.M), done.stdout[-2000:]
