#!/usr/bin/env python3
"""Benchmark the KV checksum code paths (needs torch, numpy; triton on CUDA).

(a) rows: host time to build the per-block rows of one call, the numpy
    builder (vllm_kvchecksum.core.rows.build_rows) against a per-block Python
    loop that fills three lists and turns each into a tensor.
(b) cpu: the read rate (GB/s of KV read) of both CPU paths on one layer,
    the Numba pass (the default on CPU) and the PyTorch fallback, against
    zlib.adler32 (SGLang's choice), zlib.crc32, a numpy sum (the
    memory-read limit) and, when installed (`pip install -e .[bench]`),
    xxHash XXH3-64 (`xxhash`, LMCache's) and CRC32C (`google-crc32c`, vLLM's
    filesystem offload tier's) over the same bytes in the same run, and
    against two other ways to compute the same sums (multiply-and-sum, and
    matrix-vector products), asserted equal; with the PyTorch path's two
    costs apart (the gather alone, the two sums alone); and against a copy
    of the same blocks (the least a transfer of them does, the baseline of
    a producer's re-check, which is one more checksum call per transfer);
    and against reading the same blocks in the same shuffled order one block
    at a time (a compiled plain sum of each block, XXH3-64 of each block).
    Then the Numba pass's ratios to the two goals (issue 24: at least 0.5x
    the numpy sum, at least 1x XXH3, shuffled block ids), and its startup
    cost in a fresh process: importing numba, then compiling the pass with
    an empty disk cache, or loading what a first start cached.
(c) cuda (only with a CUDA device): one layer of 2048 blocks x 8 heads x 16
    tokens x 128 head size, bf16 K and V, and rows of about 1 MB (the size
    of Mamba states), with both paths, against a device-to-device copy of
    the same bytes; asserts the two paths agree bit for bit.

    python scripts/bench_checksum.py [--quick] [--only rows,cpu,cuda]
        [--threads N] [--markdown FILE]

No vllm needed. zlib, numpy and the Numba pass run on one thread, so the
PyTorch path runs on --threads (default 1) for a like-for-like comparison.
The header names the CPU's vector flags and the ones the code was built
for: to measure AVX2-only code on an AVX-512 machine, run with
NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES=-avx512f (both: numba takes the
host's features when only the name is set), ATEN_CPU_CAPABILITY=avx2 and
NPY_DISABLE_CPU_FEATURES set to numpy's AVX-512 features
(docs/performance.md has the command).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import zlib

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vllm_kvchecksum.core.kernels.torch_path import CPU_CHUNK_BYTES  # noqa: E402
from vllm_kvchecksum.core.layer_view import LayerView  # noqa: E402
from vllm_kvchecksum.core.rows import RequestBlocks, build_rows  # noqa: E402


def timeit_interleaved(fns: dict, reps: int) -> dict:
    """Median seconds per call of each fn, taking turns, so that load from
    other processes hits every candidate alike."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


class Table:
    def __init__(self, title: str, header: list[str]):
        self.title, self.header, self.rows = title, header, []

    def add(self, *cells):
        self.rows.append([str(c) for c in cells])

    def text(self) -> str:
        widths = [max(len(r[i]) for r in [self.header] + self.rows)
                  for i in range(len(self.header))]
        fmt = "  ".join(f"{{:>{w}}}" for w in widths)
        lines = [self.title, fmt.format(*self.header)]
        lines += [fmt.format(*r) for r in self.rows]
        return "\n".join(lines)

    def markdown(self) -> str:
        lines = [f"**{self.title}**", "",
                 "| " + " | ".join(self.header) + " |",
                 "|" + "---|" * len(self.header)]
        lines += ["| " + " | ".join(r) + " |" for r in self.rows]
        return "\n".join(lines)


# (a) rows --------------------------------------------------------------------

def rows_by_loop(groups, block_sizes):
    """The baseline: one Python step per block, three lists per group, each
    turned into a tensor (pinned when CUDA is available)."""
    pin = torch.cuda.is_available()
    tensors = []
    for requests, block_size in zip(groups, block_sizes):
        ids, firsts, valid = [], [], []
        for block_ids, first_position, num_tokens in requests:
            for i, block in enumerate(block_ids):
                first = (first_position + i) * block_size
                ids.append(block)
                firsts.append(first)
                valid.append(max(0, min(block_size, num_tokens - first)))
        group = [torch.tensor(x, dtype=torch.int64) for x in (ids, firsts, valid)]
        tensors.append([t.pin_memory() for t in group] if pin else group)
    return tensors


def bench_rows(quick: bool) -> Table:
    table = Table("(a) host row building, one group",
                  ["block size", "tokens x requests", "rows", "per-block loop us",
                   "numpy builder us", "speed-up"])
    rng = np.random.default_rng(0)
    reps = 5 if quick else 30
    for block_size, tokens, requests in ((16, 128 * 1024, 1), (16, 16 * 1024, 32),
                                         (128, 128 * 1024, 1), (128, 4096, 128),
                                         (128, 1024, 1)):
        per_request = tokens // block_size
        groups = [[RequestBlocks(rng.integers(0, 1 << 20, per_request).tolist(), 0, tokens - 3)
                   for _ in range(requests)]]
        loop = rows_by_loop(groups, [block_size])
        built = build_rows(groups, block_size)
        for a, b in zip(loop[0], built.group_rows(built.table, 0)):
            assert torch.equal(a, b), "the builder disagrees with the loop"
        times = timeit_interleaved({
            "loop": lambda: rows_by_loop(groups, [block_size]),
            "numpy": lambda: build_rows(groups, block_size)}, reps)
        t_loop, t_numpy = times["loop"], times["numpy"]
        table.add(block_size, f"{tokens // 1024}K x {requests}", per_request * requests,
                  f"{t_loop * 1e6:.0f}", f"{t_numpy * 1e6:.0f}", f"{t_loop / t_numpy:.1f}x")
    return table


# (b) cpu ---------------------------------------------------------------------

def layer_kv(num_blocks: int, heads: int, tokens: int, head_size: int, device="cpu"):
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (num_blocks, heads, tokens, head_size)
    return [torch.randn(shape, generator=gen, device=device).to(torch.bfloat16)
            for _ in range(2)]


def full_weights(view: LayerView) -> tuple[torch.Tensor, torch.Tensor]:
    """Per cache tensor, the weight m * (2 l + 1) of each piece of a block at
    the request's start, and m, both [rows' pieces] in memory order (HND)."""
    heads, kt, p_total = view.num_heads, view.kernel_tokens, view.pieces_per_token
    w_all, m_all = [], []
    with np.errstate(over="ignore"):
        m = 2 * (np.uint64(view.factor_base) + np.arange(heads, dtype=np.uint64)) + 1
        for cache in view.caches:
            pk = cache.num_pieces
            l = (np.arange(kt, dtype=np.uint64)[:, None] * np.uint64(p_total)
                 + np.uint64(cache.piece_offset) + np.arange(pk, dtype=np.uint64)[None, :])
            w = m[:, None, None] * (2 * l + 1)[None]
            w_all.append(torch.from_numpy(w.reshape(-1).view(np.int64)))
            mm = np.broadcast_to(m[:, None, None], (heads, kt, pk)).reshape(-1)
            m_all.append(torch.from_numpy(np.ascontiguousarray(mm).view(np.int64)))
    return w_all, m_all


def alternative(view: LayerView, kind: str, chunk_rows: int):
    """The same sums (full blocks only) by multiply-and-sum or by mv, with
    their weight tables and gather buffer made up front."""
    w_all, m_all = full_weights(view)
    scale = 2 * view.pieces_per_token
    flats = [c.pieces.reshape(c.pieces.shape[0], -1) for c in view.caches]
    buf = torch.empty(chunk_rows, max(f.shape[1] for f in flats), dtype=torch.int64)

    def run(ids, t0):
        out = torch.zeros(ids.shape[0], dtype=torch.int64)
        for flat, w, m in zip(flats, w_all, m_all):
            for s in range(0, ids.shape[0], chunk_rows):
                rows = ids[s:s + chunk_rows]
                g = torch.index_select(flat, 0, rows,
                                       out=buf[:rows.shape[0], :flat.shape[1]])
                if kind == "mul_sum":
                    a, b = (g * w).sum(1), (g * m).sum(1)
                else:
                    a, b = torch.mv(g, w), torch.mv(g, m)
                out[s:s + chunk_rows] += a + t0[s:s + chunk_rows] * scale * b
        return out
    return run


def optional_peers(raw: list[np.ndarray]) -> list:
    """XXH3-64 and CRC32C over the same bytes, when their packages are installed (the bench extra)."""
    peers = []
    try:
        import xxhash
    except ImportError:
        print("xxhash not installed (pip install -e .[bench]): no XXH3-64 row", file=sys.stderr)
    else:
        peers.append(("xxhash.xxh3_64", lambda: [xxhash.xxh3_64_intdigest(r) for r in raw]))
    try:
        import google_crc32c
    except ImportError:
        print("google-crc32c not installed (pip install -e .[bench]): no CRC32C row", file=sys.stderr)
    else:
        peers.append((f"google_crc32c ({google_crc32c.implementation})",
                      lambda: [google_crc32c.value(r) for r in raw]))
    return peers


def cpu_vector_flags() -> str:
    """The x86 vector features this machine's CPU reports (machines of one
    kind differ: AVX2 only, or AVX-512 with or without bf16 and AMX), so each
    figure says which it was measured on."""
    wanted = ("avx2", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16", "asimd", "sve")
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith(("flags", "Features"))), [])
    except OSError:
        return "unknown"
    return " ".join(w for w in wanted if w in flags) or "none of " + "/".join(wanted)


def built_for() -> str:
    """What the compiled code in this run targets: numba's CPU (the host's,
    or NUMBA_CPU_NAME and NUMBA_CPU_FEATURES), whether numpy was told not to
    use its AVX-512 kernels, and torch's ISA (ATEN_CPU_CAPABILITY)."""
    import numba
    target = " ".join(filter(None, (os.environ.get("NUMBA_CPU_NAME"),
                                    os.environ.get("NUMBA_CPU_FEATURES")))) or "host"
    disabled = os.environ.get("NPY_DISABLE_CPU_FEATURES", "").split()
    numpy_avx512 = "off" if any(f.startswith("AVX512") for f in disabled) else "as the CPU has"
    torch_isa = os.environ.get("ATEN_CPU_CAPABILITY") or "as the CPU has"
    return (f"numba {numba.__version__} built for {target} CPU, numpy AVX-512 {numpy_avx512}, "
            f"torch ISA {torch_isa}")


def rows_order_floors(view: LayerView, raw: list[np.ndarray], ids: torch.Tensor) -> list:
    """The same blocks read in the same shuffled order, one block at a time,
    with no checksum arithmetic: a compiled plain sum of each block, and
    XXH3-64 of each block where it lies (when xxhash is installed). Bench
    only."""
    import numba

    @numba.njit(boundscheck=False)
    def plain_sum(flat, order, block):
        total = np.int64(0)
        for r in range(order.shape[0]):
            start = order[r] * block
            x = flat[start:start + block]
            for e in range(block):
                total += x[e]
        return total

    flats = [c.pieces.reshape(-1).numpy() for c in view.caches]
    block = view.caches[0].block_stride
    order = ids.numpy()
    plain_sum(flats[0], order[:1], block)  # compile outside the timing
    rows = [("plain sum of each block, shuffled order",
             lambda: [plain_sum(f, order, block) for f in flats])]
    try:
        import xxhash
    except ImportError:
        return rows
    block_bytes = raw[0].nbytes // view.num_blocks
    blocks = [[r[i * block_bytes:(i + 1) * block_bytes] for i in order.tolist()] for r in raw]
    rows.append(("xxhash.xxh3_64 of each block, shuffled order",
                 lambda: [[xxhash.xxh3_64_intdigest(b) for b in bs] for bs in blocks]))
    return rows


def gather_and_sums(view: LayerView, chunk_rows: int):
    """The PyTorch path's two costs apart, over the same rows in the same
    chunks: the gather alone (index_select into a reused buffer), and the
    two sums alone read in place (as for consecutive ids)."""
    blocked = [c.pieces for c in view.caches]
    buf = torch.empty(chunk_rows, *blocked[0].shape[1:], dtype=torch.int64)

    def gather(ids):
        for b in blocked:
            for s in range(0, ids.shape[0], chunk_rows):
                rows = ids[s:s + chunk_rows]
                torch.index_select(b, 0, rows, out=buf[:rows.shape[0]])

    def sums():
        for b in blocked:
            for s in range(0, b.shape[0], chunk_rows):
                chunk = b[s:s + chunk_rows]
                chunk.sum(dim=-1), chunk.sum(dim=2)
    return gather, sums


def bench_cpu(quick: bool, threads: int) -> Table:
    torch.set_num_threads(threads)
    num_blocks = 512 if quick else 2048
    reps = 3 if quick else 11
    k, v = layer_kv(num_blocks, 8, 16, 128)
    view = LayerView([k, v], block_size=16, layer=5, first_head=8, path="torch")
    compiled = LayerView([k, v], block_size=16, layer=5, first_head=8, path="numba")
    nbytes = 2 * k.numel() * k.element_size()
    table = Table(f"(b) CPU, one layer: {num_blocks} blocks x 8 heads x 16 tokens x 128, "
                  f"bf16 K and V ({nbytes >> 20} MB), torch threads {threads}",
                  ["what", "ms", "GB/s of KV read", "vs adler32"])
    gen = torch.Generator().manual_seed(1)
    shuffled = torch.randperm(num_blocks, generator=gen)
    t0 = torch.arange(num_blocks, dtype=torch.int64) * 16
    full = torch.full((num_blocks,), 16, dtype=torch.int64)
    out = torch.zeros(num_blocks, 1, dtype=torch.int64)

    def package(ids, path_view=view):
        out.zero_()
        path_view.accumulate(out, 0, ids, t0, full)
        return out[:, 0].clone()

    def numba_pass(ids):
        return package(ids, compiled)

    expect = package(shuffled)
    assert torch.equal(numba_pass(shuffled), expect), "Numba pass"
    chunk_rows = (4 << 20) // (nbytes // num_blocks // 2)
    alternatives = {kind: alternative(view, kind, chunk_rows) for kind in ("mul_sum", "mv")}
    for kind, run in alternatives.items():
        assert torch.equal(run(shuffled, t0), expect), kind
    gather_only, sums_only = gather_and_sums(view, CPU_CHUNK_BYTES // (nbytes // num_blocks // 2))
    raw = [t.view(torch.uint8).numpy() for t in (k, v)]
    # Into blocks that exist already, as a transfer writes into a KV cache.
    copies = [torch.empty_like(t) for t in (k, v)]
    for b in copies:
        b.fill_(1)
    pieces = [t.view(torch.int64).numpy() for t in (k, v)]
    candidates = [
        ("zlib.adler32", lambda: [zlib.adler32(r) for r in raw]),
        ("zlib.crc32", lambda: [zlib.crc32(r) for r in raw]),
        *optional_peers(raw),
        ("numpy sum (uint64)", lambda: [p.sum() for p in pieces]),
        ("Numba pass, shuffled block ids", lambda: numba_pass(shuffled)),
        ("Numba pass, consecutive block ids",
         lambda: numba_pass(torch.arange(num_blocks, dtype=torch.int64))),
        ("PyTorch path, shuffled block ids", lambda: package(shuffled)),
        ("PyTorch path, consecutive block ids",
         lambda: package(torch.arange(num_blocks, dtype=torch.int64))),
        ("alt: gather, multiply, sum", lambda: alternatives["mul_sum"](shuffled, t0)),
        ("alt: gather, 2 x mv", lambda: alternatives["mv"](shuffled, t0)),
        ("part: the gather alone, shuffled", lambda: gather_only(shuffled)),
        # The least a transfer of these blocks does: read and write every byte
        # (a producer's re-check costs one "checksums" call per transfer).
        ("transfer floor: copy of the blocks", lambda: [torch.index_select(t, 0, shuffled, out=b)
                                                         for t, b in zip((k, v), copies)]),
        ("part: the two sums alone, in place", sums_only),
    ]
    candidates += rows_order_floors(compiled, raw, shuffled)
    times = timeit_interleaved(dict(candidates), reps)
    for name, seconds in times.items():
        table.add(name, f"{seconds * 1e3:.1f}", f"{nbytes / seconds / 1e9:.1f}",
                  f"{times['zlib.adler32'] / seconds:.2f}x")
    goals = Table("Numba pass against the goals (shuffled block ids; issue 24)",
                  ["against", "ratio", "goal"])
    ours = times["Numba pass, shuffled block ids"]
    goals.add("numpy sum (uint64)", f"{times['numpy sum (uint64)'] / ours:.2f}x", ">= 0.5x")
    if "xxhash.xxh3_64" in times:
        goals.add("xxhash.xxh3_64", f"{times['xxhash.xxh3_64'] / ours:.2f}x", ">= 1x")
    for floor in ("plain sum of each block, shuffled order",
                  "xxhash.xxh3_64 of each block, shuffled order"):
        if floor in times:
            goals.add(floor, f"{times[floor] / ours:.2f}x", "(same order, a block at a time)")
    goals.add("PyTorch path", f"{times['PyTorch path, shuffled block ids'] / ours:.2f}x", "")
    goals.add("transfer floor (re-check / copy)",
              f"{ours / times['transfer floor: copy of the blocks']:.2f}x", "(cost, lower is better)")
    return table, goals


_STARTUP = """
import sys, time
sys.path.insert(0, {root!r})
import torch  # a worker has it already
start = time.perf_counter()
import numba
imported = time.perf_counter()
from vllm_kvchecksum.core.kernels import numba_path  # compiles or loads the pass
print("numba", imported - start)
print("pass", time.perf_counter() - imported)
"""


def numba_startup() -> Table:
    """Seconds a fresh process spends making the pass ready (what a worker
    pays once at start-up, when its first view chooses the pass): importing
    numba, then compiling the pass for its three piece widths with an empty
    disk cache, or loading what a first start cached."""
    import subprocess
    import tempfile
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = _STARTUP.format(root=root)
    table = Table("Numba pass startup, once per worker process",
                  ["disk cache", "import numba, s", "compile or load the pass (3 piece widths), s"])
    with tempfile.TemporaryDirectory(prefix="kvcs-numba-cache-") as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        for label in ("empty (compiles)", "left by a first start (loads)"):
            done = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                  capture_output=True, text=True)
            took = dict(line.split() for line in done.stdout.splitlines())
            table.add(label, f"{float(took['numba']):.2f}", f"{float(took['pass']):.3f}")
    return table


# (c) cuda --------------------------------------------------------------------

def cuda_time(fn, reps: int) -> float:
    """Median seconds per call, by CUDA events."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def bench_cuda(quick: bool) -> Table | None:
    if not torch.cuda.is_available():
        return None
    reps = 10 if quick else 50
    table = Table(f"(c) CUDA ({torch.cuda.get_device_name()})",
                  ["case", "path", "ms", "GB/s of KV read", "vs copy"])
    cases = [
        ("attention: 2048 blocks x 8 heads x 16 tokens x 128, bf16 K and V",
         layer_kv(2048, 8, 16, 128, "cuda"), 16),
        ("state rows: 256 rows of 1 MB", [torch.randint(
            -2**62, 2**62, (256, 1, 1, 128 * 1024), device="cuda", dtype=torch.int64)], 1),
    ]
    for name, caches, block_size in cases:
        num_blocks = caches[0].shape[0]
        nbytes = sum(c.numel() * c.element_size() for c in caches)
        ids = torch.randperm(num_blocks, device="cuda")
        t0 = torch.arange(num_blocks, device="cuda", dtype=torch.int64) * block_size
        valid = torch.full((num_blocks,), block_size, device="cuda", dtype=torch.int64)
        dests = [torch.empty_like(c) for c in caches]
        copy_s = cuda_time(lambda: [d.copy_(c) for d, c in zip(dests, caches)], reps)
        results = {}
        for path in ("triton", "torch"):
            view = LayerView(caches, block_size=block_size, layer=3, first_head=8, path=path)
            view.warm_up()
            out = torch.zeros(num_blocks, 1, dtype=torch.int64, device="cuda")

            def run():
                out.zero_()
                view.accumulate(out, 0, ids, t0, valid)
            seconds = cuda_time(run, reps)
            results[path] = out.clone()
            table.add(name, path, f"{seconds * 1e3:.3f}", f"{nbytes / seconds / 1e9:.0f}",
                      f"{copy_s / seconds:.2f}x")
        table.add(name, "device copy (read rate)", f"{copy_s * 1e3:.3f}",
                  f"{nbytes / copy_s / 1e9:.0f}", "1.00x")
        assert torch.equal(results["triton"], results["torch"]), f"paths disagree: {name}"
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
    parser.add_argument("--only", default="rows,cpu,cuda",
                        help="comma-separated sections: rows, cpu, cuda")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for the CPU path (zlib and numpy use one)")
    parser.add_argument("--markdown", metavar="FILE", help="append the tables as markdown")
    args = parser.parse_args()
    sections = set(args.only.split(","))
    tables = []
    if "rows" in sections:
        tables.append(bench_rows(args.quick))
    if "cpu" in sections:
        tables.extend(bench_cpu(args.quick, args.threads))
        tables.append(numba_startup())
    if "cuda" in sections:
        table = bench_cuda(args.quick)
        if table is None:
            print("(c) CUDA: skipped, no CUDA device")
        else:
            tables.append(table)
    header = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs "
              f"(vector flags: {cpu_vector_flags()}; {built_for()}), "
              f"torch {torch.__version__}, numpy {np.__version__}"
              f"{', quick' if args.quick else ''}")
    print(header)
    for table in tables:
        print()
        print(table.text())
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(f"\n{header}\n")
            for table in tables:
                f.write("\n" + table.markdown() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
