"""No error of the compiled CPU pass reaches the caller (issue 41 §3).

Where the Numba pass cannot run, CPU caches take the PyTorch path (the same
values) with one warning naming the cause and the fix: under
NUMBA_DISABLE_JIT, with a build that fails the start-up check, or when the
pass raises in a step. A damaged numba disk cache (an index naming another
signature's file, a truncated build, a garbage index) is compiled afresh and
saved anew; a cache built beforehand in a folder the process cannot write
(a read-only image) is loaded, not compiled again at every start.

Each start is a fresh process on a copy of the package (its own
__pycache__) with its own NUMBA_CACHE_DIR and HOME under tmp_path, so no
test reads or writes the repo's cache.
"""

import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_kvchecksum.core import kernels
from vllm_kvchecksum.core.kernels import numba_path
from vllm_kvchecksum.core.layer_view import LayerView

ROOT = Path(__file__).resolve().parents[2]

# One layer of 12 blocks, checksummed in one call: the four-block groups of
# the compiled pass and its prefetches run (the call NUMBA_DISABLE_JIT broke).
_CASE = """
import torch
from vllm_kvchecksum.core.layer_view import LayerView

def case_view(path="auto"):
    gen = torch.Generator().manual_seed(41)
    k, v = (torch.randn(12, 2, 16, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    view = LayerView([k, v], block_size=16, layer=3, first_head=2, path=path)
    ids = torch.tensor([7, 2, 11, 0, 5, 9, 1, 3, 10, 4, 8, 6])
    valid = torch.full((12,), 16)
    valid[-1], valid[4] = 5, 0
    return view, (ids, torch.arange(12) * 16, valid)

def case_sums(path="auto", accumulate=None):
    view, rows = case_view(path)
    out = torch.zeros(12, 2, dtype=torch.int64)
    (accumulate or view.accumulate)(out, 1, *rows)
    return view.path, out[:, 1].tolist()
"""

_START = """
import json, logging, os, sys, tempfile
sys.path.insert(0, {site!r})
records = []

class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.levelname + " " + record.getMessage())

logging.getLogger("vllm_kvchecksum").addHandler(Keep(logging.WARNING))
exec({case!r})
path, sums = case_sums()
from vllm_kvchecksum.core import kernels
numba_path = sys.modules.get("vllm_kvchecksum.core.kernels.numba_path")
stats = getattr(getattr(numba_path, "_cache_rows", None), "stats", None)
try:
    tempfile.TemporaryFile(dir={probe!r}).close()
    writable = True
except OSError:
    writable = False
print("ANSWER " + json.dumps({{
    "path": path, "sums": sums, "warnings": [r for r in records if r.startswith(("WARNING", "ERROR"))],
    "hits": None if stats is None else len(stats.cache_hits),
    "misses": None if stats is None else len(stats.cache_misses),
    "module": kernels.__file__, "writable": writable}}))
"""


def want_sums():
    namespace = {}
    exec(_CASE, namespace)
    return namespace["case_sums"]("torch")[1]


class Starts:
    """Fresh processes on a copy of the package (site, by default one under
    tmp_path), with their own numba cache folder and home under tmp_path."""

    def __init__(self, tmp_path: Path, numba_cache_dir: bool = True, site: Path | None = None):
        self.tmp = tmp_path
        self.site = site or tmp_path / "site"
        if site is None:
            shutil.copytree(ROOT / "vllm_kvchecksum", self.site / "vllm_kvchecksum",
                            ignore=shutil.ignore_patterns("__pycache__"))
        self.cache = tmp_path / "numba-cache"
        home = tmp_path / "home"
        home.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
        env.update(HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"))
        if numba_cache_dir:
            env["NUMBA_CACHE_DIR"] = str(self.cache)
        self.env = env

    def argv(self, probe: Path | None = None):
        code = _START.format(site=str(self.site), case=_CASE, probe=str(probe or self.tmp))
        return [sys.executable, "-c", code]

    def answer(self, done: subprocess.CompletedProcess) -> dict:
        assert done.returncode == 0, done.stderr[-3000:]
        line = [x for x in done.stdout.splitlines() if x.startswith("ANSWER ")][-1]
        got = json.loads(line[len("ANSWER "):])
        assert got["module"].startswith(str(self.site)), got["module"]
        return got

    def start(self, **env) -> dict:
        done = subprocess.run(self.argv(), env=dict(self.env, **env), capture_output=True, text=True, timeout=600)
        return self.answer(done)

    def files(self, suffix: str) -> list[Path]:
        """The cache's files of the pass ending in suffix, in NUMBA_CACHE_DIR."""
        return sorted(self.cache.glob(f"*/numba_path._cache_rows-*{suffix}"))

    def start_read_only(self) -> dict:
        """A start that can write nowhere under tmp_path and the site (the
        package, its __pycache__, the cache folder, home): chmod where this
        is not root, else read-only bind mounts in a mount namespace of its own."""
        argv = self.argv(probe=self.cache if self.cache.exists() else self.site / "vllm_kvchecksum")
        folders = [str(self.tmp)] + ([] if self.site.is_relative_to(self.tmp) else [str(self.site)])
        if os.geteuid() != 0:
            subprocess.run(["chmod", "-R", "a-w", *folders], check=True)
            try:
                done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=600)
            finally:
                subprocess.run(["chmod", "-R", "u+w", *folders], check=True)
        else:
            # sh -c SCRIPT FOLDER...  -- ARGV: each folder read-only, then ARGV.
            script = ('while [ "$1" != -- ]; do mount --bind -o ro "$1" "$1" || exit 97; shift; done; '
                      'shift; exec "$@"')
            mount = ["unshare", "-m", "sh", "-c", script, "sh", *folders, "--"]
            if shutil.which("unshare") is None or subprocess.run(
                    mount + ["true"], capture_output=True).returncode != 0:
                pytest.skip("running as root without a way to make a folder read-only (unshare -m)")
            done = subprocess.run(mount + argv, env=self.env, capture_output=True, text=True, timeout=600)
        got = self.answer(done)
        assert got["writable"] is False
        return got


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A copy of the package and numba's cache of the pass built by a first
    start (it compiled all three widths), for the tests to copy."""
    starts = Starts(tmp_path_factory.mktemp("built"))
    first = starts.start()
    assert (first["path"], first["hits"], first["misses"]) == ("numba", 0, 3)
    return starts


def from_built(built: Starts, tmp_path: Path) -> Starts:
    """Starts on built's package, with a copy of its cache."""
    starts = Starts(tmp_path, site=built.site)
    shutil.copytree(built.cache, starts.cache)
    return starts


def test_numba_disable_jit_takes_the_pytorch_path_with_one_warning(built, tmp_path):
    """NUMBA_DISABLE_JIT=1: the pass would run as Python, where its prefetch
    intrinsic raises; the view takes the PyTorch path from the start."""
    got = from_built(built, tmp_path).start(NUMBA_DISABLE_JIT="1")
    assert got["path"] == "torch" and got["sums"] == want_sums()
    assert len(got["warnings"]) == 1 and "NUMBA_DISABLE_JIT" in got["warnings"][0], got["warnings"]


def test_a_cache_index_naming_the_wrong_files_is_rebuilt(built, tmp_path):
    """Two builds' files swapped: the index gives the 16-bit build for the
    64-bit signature. The start compiles afresh and saves anew (one warning);
    the next loads all three."""
    starts = from_built(built, tmp_path)
    one, two = starts.files(".1.nbc")[0], starts.files(".2.nbc")[0]
    swap = one.with_suffix(".swap")
    one.rename(swap), two.rename(one), swap.rename(two)
    second = starts.start()
    assert second["path"] == "numba" and second["sums"] == want_sums()
    assert len(second["warnings"]) == 1 and "damaged" in second["warnings"][0], second["warnings"]
    assert str(one.parent) in second["warnings"][0]
    third = starts.start()
    assert (third["path"], third["hits"], third["misses"], third["warnings"]) == ("numba", 3, 0, [])
    assert third["sums"] == want_sums()


@pytest.mark.parametrize("damage", ["truncated build", "garbage index"])
def test_a_damaged_cache_is_rebuilt(built, tmp_path, damage):
    """A truncated build or a garbage index made every later start take the
    PyTorch path, for good: now the start compiles afresh and saves anew."""
    starts = from_built(built, tmp_path)
    if damage == "truncated build":
        build = starts.files(".1.nbc")[0]
        build.write_bytes(build.read_bytes()[:100])
    else:
        starts.files(".nbi")[0].write_bytes(b"garbage")
    second = starts.start()
    assert second["path"] == "numba" and second["sums"] == want_sums()
    assert len(second["warnings"]) == 1 and "damaged" in second["warnings"][0], second["warnings"]
    third = starts.start()
    assert (third["path"], third["hits"], third["misses"], third["warnings"]) == ("numba", 3, 0, [])


@pytest.mark.parametrize("where", ["NUMBA_CACHE_DIR", "__pycache__"])
def test_a_read_only_prebuilt_cache_is_loaded(tmp_path, where):
    """A cache built at image build time (NUMBA_CACHE_DIR, or next to the
    module) in a folder the worker cannot write, nor any other: loaded, with
    no warning, instead of compiled at every start."""
    starts = Starts(tmp_path, numba_cache_dir=where == "NUMBA_CACHE_DIR")
    built = starts.start()
    assert (built["hits"], built["misses"]) == (0, 3)
    assert bool(starts.files(".nbi")) == (where == "NUMBA_CACHE_DIR")
    got = starts.start_read_only()
    assert (got["path"], got["hits"], got["misses"], got["warnings"]) == ("numba", 3, 0, [])
    assert got["sums"] == want_sums()


def test_a_damaged_read_only_cache_is_bypassed(built, tmp_path):
    """A truncated build in a read-only cache, with no writable folder: the
    start compiles afresh (saving nothing), with one warning naming the
    read-only folder, and uses the pass."""
    starts = from_built(built, tmp_path)
    build = starts.files(".1.nbc")[0]
    build.write_bytes(build.read_bytes()[:100])
    got = starts.start_read_only()
    assert got["path"] == "numba" and got["sums"] == want_sums() and got["misses"] == 3
    assert len(got["warnings"]) == 1, got["warnings"]
    assert "damaged" in got["warnings"][0] and f"{build.parent} is read-only" in got["warnings"][0]


def test_under_numba_disable_jit_the_pass_imports_and_runs_as_python(tmp_path):
    """For debugging the pass itself: imported under NUMBA_DISABLE_JIT it
    is the Python function, which gives the same sums (with no prefetch:
    numba's intrinsic cannot run as Python)."""
    code = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
exec({_CASE!r})
from vllm_kvchecksum.core.kernels import numba_path
assert not hasattr(numba_path._cache_rows, "overloads")
numba_path.PREFETCH_ROWS_AHEAD = 0
print("ANSWER", case_sums("torch", numba_path.NumbaLayerPath(case_view("torch")[0]).accumulate)[1])
"""
    env = dict(os.environ, NUMBA_DISABLE_JIT="1", NUMBA_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("ANSWER ")[-1].strip() == str(want_sums())


def test_a_stale_read_only_cache_says_how_to_fix_it(built, tmp_path):
    """A read-only cache with no build for this numba (another version's
    index) and no writable folder: compiled at each start, with one warning
    naming the folder and NUMBA_CACHE_DIR."""
    starts = from_built(built, tmp_path)
    index = starts.files(".nbi")[0]
    index.write_bytes(pickle.dumps("0.0.1", protocol=-1))  # numba checks its version first
    got = starts.start_read_only()
    assert (got["path"], got["hits"], got["misses"]) == ("numba", 0, 3)
    assert len(got["warnings"]) == 1, got["warnings"]
    assert str(index.parent) in got["warnings"][0] and "NUMBA_CACHE_DIR" in got["warnings"][0]


# -- in this process: the start-up check and the guarded call ----------------

@pytest.fixture
def numba_state(monkeypatch):
    """kernels' state as a fresh process has it, restored afterwards."""
    monkeypatch.setattr(kernels, "_numba_off", None, raising=False)
    kernels.numba_available.cache_clear()
    yield
    kernels.numba_available.cache_clear()


def kv(blocks=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(blocks, 2, 16, 64, generator=gen).to(torch.bfloat16) for _ in range(2)]


def rows(n=12):
    return torch.arange(n).flip(0), torch.arange(n) * 16, torch.full((n,), 16)


def test_a_pass_that_raises_in_a_step_gives_way_to_pytorch(numba_state, monkeypatch, caplog):
    """The pass raises (as a mismatched build does: TypeError) after adding
    to some rows: out is put back and computed on the PyTorch path; that
    view and every later one use it, with one warning; the pass is not
    called again."""
    caches = kv()
    want = torch.zeros(12, 2, dtype=torch.int64)
    LayerView(caches, block_size=16, layer=1, path="torch").accumulate(want, 1, *rows())
    early = LayerView(caches, block_size=16, layer=1)
    view = LayerView(caches, block_size=16, layer=1)
    assert early.path == view.path == "numba"
    calls = []

    def broken(*args):
        calls.append(1)
        args[16][:, args[17]] += 99  # out, column: a partial sum, then the error
        raise TypeError("No matching definition for argument type(s)")

    monkeypatch.setattr(numba_path, "_cache_rows", broken)
    out = torch.full((12, 2), 5, dtype=torch.int64)
    with caplog.at_level(logging.WARNING, logger="vllm_kvchecksum"):
        view.accumulate(out, 1, *rows())
        assert view.path == "torch" and torch.equal(out[:, 1] - 5, want[:, 1]) and (out[:, 0] == 5).all()
        again = torch.zeros(12, 2, dtype=torch.int64)
        early.accumulate(again, 1, *rows())
        assert early.path == "torch" and torch.equal(again, want)
        assert LayerView(caches, block_size=16, layer=1).path == "torch"
    assert len(calls) == 1
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "TypeError" in warnings[0].getMessage(), caplog.text
    assert "PyTorch path" in warnings[0].getMessage()


def test_a_bad_block_id_is_the_callers_error_not_a_reason_to_leave_the_pass(numba_state, caplog):
    view = LayerView(kv(), block_size=16, layer=1)
    out = torch.zeros(2, 1, dtype=torch.int64)
    with pytest.raises(IndexError, match="block id 12 of row 1"):
        view.accumulate(out, 0, torch.tensor([0, 12]), torch.tensor([0, 16]), torch.tensor([16, 16]))
    assert view.path == "numba" and kernels.numba_switched_off() is None
    assert "WARNING" not in caplog.text


@pytest.mark.parametrize("broken", ["wrong sums", "raises"])
def test_a_pass_failing_the_start_up_check_is_compiled_afresh(numba_state, monkeypatch, caplog, broken):
    """A build that gives other sums than the PyTorch path, or raises (as
    one loaded from a damaged cache could), is found before any view
    chooses it and compiled afresh; the check then passes; one warning."""
    real = numba_path._cache_rows
    rebuilt = []

    def wrong(*args):
        if broken == "raises":
            raise TypeError("No matching definition for argument type(s)")
        result = real(*args)
        args[16][:, args[17]] += 1
        return result

    monkeypatch.setattr(numba_path, "_cache_rows", wrong)
    monkeypatch.setattr(numba_path, "rebuild", lambda: (rebuilt.append(1), setattr(numba_path, "_cache_rows", real)))
    with caplog.at_level(logging.WARNING, logger="vllm_kvchecksum"):
        assert kernels.numba_available() is True
        assert LayerView(kv(), block_size=16, layer=1).path == "numba"
    assert rebuilt == [1] and numba_path.self_check() is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "start-up check" in warnings[0] and "passes" in warnings[0], warnings
    assert ("TypeError" in warnings[0]) == (broken == "raises")


def test_a_pass_failing_the_check_even_when_compiled_afresh_is_not_used(numba_state, monkeypatch, caplog):
    monkeypatch.setattr(numba_path, "self_check", lambda: "its sums of 16-bit pieces differ")
    monkeypatch.setattr(numba_path, "rebuild", lambda: None)
    with caplog.at_level(logging.WARNING, logger="vllm_kvchecksum"):
        assert kernels.numba_available() is False
        assert LayerView(kv(), block_size=16, layer=1).path == "torch"
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "16-bit pieces differ" in warnings[0], warnings


def test_the_start_up_check_runs_every_piece_width_and_both_ways_of_summing():
    """What self_check compares: each compiled signature, the one-loop sums
    with four blocks at once and prefetches, and the token-by-token ones."""
    seen = set()
    for geometry, ids, t0, valid in numba_path._check_cases():
        args = numba_path._CacheArgs(geometry.caches[0], geometry)
        full = int((valid >= geometry.block_size).sum())
        seen.add((geometry.piece_bits, len(args.weights) > 0, full >= 4 + numba_path.PREFETCH_ROWS_AHEAD))
    assert {bits for bits, _, _ in seen} == {16, 32, 64}
    assert (64, True, True) in seen and any(not one_loop for _, one_loop, _ in seen)
    calls = numba_path.call_count
    assert numba_path.self_check() is None and numba_path.call_count == calls
