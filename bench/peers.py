"""Peer engines for the serving comparison: llama.cpp's llama-server, built from source here.

The llama.cpp sources come from the `llama-cpp-python` sdist on PyPI (it vendors llama.cpp at a pinned
commit), so the build needs nothing but PyPI, cmake and a C++ compiler. Everything lives under `bench/.peers/`
(gitignored): never commit its code or binaries.

    python bench/peers.py build                 # ~10-20 min on 2 cores, cached afterwards
    python bench/peers.py serve --gguf M.gguf   # run llama-server by hand (Ctrl-C stops it)
    python bench/peers.py quantize IN.gguf OUT.gguf Q8_0
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "src") not in sys.path:  # run as a script without installing the package
    sys.path.insert(0, str(REPO / "src"))

from edgeinfer.bench.process import ServerProcess, start_server  # noqa: E402

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
PEERS_DIR = REPO / "bench" / ".peers"
TARGETS = ("llama-server", "llama-quantize", "llama-imatrix")

# The UI and TLS are switched off because the build has no network and the benchmark needs neither. The CPU
# features come from `cpu_cmake_flags`, not GGML_NATIVE: on an Intel Xeon with AMX, GGML_NATIVE=ON built
# AMX code paths that died with an illegal instruction at model load.
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
)


# ggml's CMake switch for each /proc/cpuinfo flag it can use (GGML_AVX512 also wants BW, DQ and VL).
_GGML_FEATURES = {
    "GGML_SSE42": ("sse4_2",),
    "GGML_AVX": ("avx",),
    "GGML_AVX2": ("avx2",),
    "GGML_FMA": ("fma",),
    "GGML_F16C": ("f16c",),
    "GGML_BMI2": ("bmi2",),
    "GGML_AVX_VNNI": ("avx_vnni",),
    "GGML_AVX512": ("avx512f", "avx512bw", "avx512dq", "avx512vl"),
    "GGML_AVX512_VBMI": ("avx512_vbmi",),
    "GGML_AVX512_VNNI": ("avx512_vnni",),
    "GGML_AVX512_BF16": ("avx512_bf16",),
}


def cpuinfo_field(name: str) -> str:
    """The first `name : value` of /proc/cpuinfo ("" where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace")
    except OSError:
        return ""
    return next((ln.partition(":")[2].strip() for ln in text.splitlines() if ln.startswith(name)), "")


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    return frozenset(cpuinfo_field("flags").split())


def cpu_family() -> str:
    """`intel`, `amd` or the machine's architecture (`aarch64`, ...): each kind of CPU keeps its own
    tables and plots in docs/benchmarks.md, as a later machine may be another kind."""
    vendor = cpuinfo_field("vendor_id")
    return {"GenuineIntel": "intel", "AuthenticAMD": "amd"}.get(vendor, platform.machine().lower() or "cpu")


def cpu_cmake_flags(flags: frozenset[str]) -> tuple[str, ...]:
    """ggml's instruction-set switches for a CPU with these flags; AMX always off (see CMAKE_FLAGS)."""
    switches = [f"-D{name}={'ON' if set(need) <= flags else 'OFF'}" for name, need in _GGML_FEATURES.items()]
    return (*switches, "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF")


def build_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """Where cmake builds the given llama-cpp-python version's vendored llama.cpp."""
    return PEERS_DIR / f"build-{version}"


def binary(name: str, version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """Path of a built llama.cpp tool (may not exist yet: call build() first)."""
    return build_dir(version) / "bin" / name


def _download_sdist(version: str) -> Path:
    sdist_dir = PEERS_DIR / "sdist"
    found = sorted(sdist_dir.glob(f"llama_cpp_python-{version}.tar.gz"))
    if found:
        return found[0]
    sdist_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    subprocess.run([*cmd, f"llama-cpp-python=={version}", "-d", str(sdist_dir)], check=True)
    return sdist_dir / f"llama_cpp_python-{version}.tar.gz"


def _unpack(sdist: Path, version: str) -> Path:
    src_root = PEERS_DIR / "src"
    llama_dir = src_root / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if not (llama_dir / "CMakeLists.txt").exists():
        src_root.mkdir(parents=True, exist_ok=True)
        with tarfile.open(sdist) as tar:
            tar.extractall(src_root, filter="data")
    if not (llama_dir / "CMakeLists.txt").exists():
        raise RuntimeError(f"{sdist.name} has no vendor/llama.cpp/CMakeLists.txt")
    return llama_dir


def build(version: str = LLAMA_CPP_PYTHON_VERSION, jobs: int = 2) -> Path:
    """Download, configure and build the TARGETS; return the bin directory (cached)."""
    if all(binary(t, version).exists() for t in TARGETS):
        return binary(TARGETS[0], version).parent
    if shutil.which("cmake") is None:
        raise RuntimeError("cmake not found: install cmake and a C++ compiler to build llama.cpp")
    llama_dir = _unpack(_download_sdist(version), version)
    out = build_dir(version)
    configure = ["cmake", "-S", str(llama_dir), "-B", str(out), *CMAKE_FLAGS, *cpu_cmake_flags(cpu_flags())]
    subprocess.run(configure, check=True)
    for target in TARGETS:  # one target at a time keeps peak memory low on a small machine
        subprocess.run(["cmake", "--build", str(out), "--target", target, f"-j{jobs}"], check=True)
    return binary(TARGETS[0], version).parent


def llama_server_argv(gguf: Path, port: int, n_parallel: int, ctx: int, threads: int) -> list[str]:
    """Command line for llama-server with continuous batching on and `ctx` tokens of KV per slot.

    llama-server splits `--ctx-size` evenly across its `-np` slots, so the total is ctx * n_parallel. Flash
    attention is forced on (its default is "auto") and the prompt cache is left at its defaults, as a user
    would run it.
    """
    return [
        str(binary("llama-server")),
        "--model", str(gguf),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--parallel", str(n_parallel),
        "--ctx-size", str(ctx * n_parallel),
        "--threads", str(threads),
        "--threads-batch", str(threads),
        "--cont-batching",
        "--flash-attn", "on",
        "--no-webui",
        "--log-disable",
    ]  # fmt: skip


def start_llama_server(
    gguf: Path, port: int, n_parallel: int = 1, ctx: int = 2048, threads: int | None = None
) -> ServerProcess:
    """Start llama-server on 127.0.0.1:`port` and wait for /health (the caller must .stop() it)."""
    if not binary("llama-server").exists():
        raise RuntimeError("llama-server is not built: run `python bench/peers.py build` first")
    threads = threads or os.cpu_count() or 1
    argv = llama_server_argv(Path(gguf), port, n_parallel, ctx, threads)
    log = PEERS_DIR / "logs" / f"llama-server-{port}.log"
    return start_server(argv, f"http://127.0.0.1:{port}", log, health_path="/health")


@contextlib.contextmanager
def llama_server(
    gguf: Path, port: int, n_parallel: int = 1, ctx: int = 2048, threads: int | None = None
) -> Iterator[ServerProcess]:
    """Context manager: a running llama-server that is always killed on exit."""
    server = start_llama_server(gguf, port, n_parallel, ctx, threads)
    try:
        yield server
    finally:
        server.stop()


def quantize(src: Path, dst: Path, qtype: str, extra: tuple[str, ...] = ()) -> Path:
    """Convert a GGUF with llama-quantize: every tensor is dequantized to fp32, then written as `qtype`.

    `--allow-requantize` is needed because the source is already quantized. To BF16 this is exact up to bf16
    rounding (the same values our engine gets by dequantizing the Q4_K_M file); to Q8_0 it re-quantizes.
    `extra`: more llama-quantize flags (`--pure`, `--token-embedding-type q8_0`, ...).
    """
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(".partial")
    cmd = [str(binary("llama-quantize")), "--allow-requantize", *extra, str(src), str(tmp), qtype]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    tmp.replace(dst)  # only a complete file gets the final name, so a cached file is never truncated
    return dst


def importance_matrix(model: Path, text: Path, dst: Path, tokens: int, threads: int) -> Path:
    """llama.cpp's importance matrix (`llama-imatrix`: per input channel, the mean squared activation of
    every matrix's input) of `model` over the first `tokens` tokens of `text`, in chunks of 512, for
    `llama-quantize --imatrix`: its weighted rounding, llama.cpp's answer to activation-aware quantization."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(".partial.gguf")
    cmd = [str(binary("llama-imatrix")), "-m", str(model), "-f", str(text), "-o", str(tmp), "-c", "512"]
    cmd += ["--chunks", str(tokens // 512), "-t", str(threads), "--no-ppl"]
    log = PEERS_DIR / "logs" / "llama-imatrix.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode:
            raise RuntimeError(f"llama-imatrix failed: see {log}")
    tmp.replace(dst)
    return dst


# Our precision → the llama.cpp weight type of the same class. int4 uses the shipped Q4_K_M file itself.
PEER_WEIGHT_TYPES: dict[str, str | None] = {"int4": None, "int8": "Q8_0", "bf16": "BF16"}


def peer_gguf(precision: str, source: Path) -> Path:
    """The GGUF llama-server should load to match our engine at `precision`, made from `source` (cached)."""
    if precision not in PEER_WEIGHT_TYPES:
        raise ValueError(f"unknown precision {precision!r}; expected one of {', '.join(PEER_WEIGHT_TYPES)}")
    qtype = PEER_WEIGHT_TYPES[precision]
    if qtype is None:
        return source
    dst = PEERS_DIR / "models" / f"{source.stem}.{qtype}.gguf"
    return dst if dst.exists() else quantize(source, dst, qtype)


def compare_weights(source: Path, converted: Path) -> dict[str, float]:
    """How exactly `converted` (a BF16 GGUF) holds `source`'s weights as our engine loads them: each tensor of
    `source` dequantized to fp32 by the `gguf` package and rounded to bf16 by torch, against the file's bf16.
    Returns the fraction of equal elements and the largest absolute difference over all 2-D tensors.
    """
    ours = {t.name: t for t in GGUFReader(source).tensors}
    equal = total = 0
    max_diff = 0.0
    for t in GGUFReader(converted).tensors:
        if len(t.shape) < 2 or t.tensor_type != GGMLQuantizationType.BF16:
            continue
        src = ours[t.name]
        expected = torch.from_numpy(dequantize(src.data, src.tensor_type).astype(np.float32)).bfloat16()
        got = torch.from_numpy(np.asarray(t.data).view(np.int16).copy()).view(torch.bfloat16)
        got = got.reshape(expected.shape)
        equal += int((got == expected).sum())
        total += got.numel()
        max_diff = max(max_diff, float((got.float() - expected.float()).abs().max()))
    if not total:
        raise ValueError(f"{converted} has no BF16 matrices to compare")
    return {"equal_fraction": equal / total, "elements": total, "max_abs_diff": max_diff}


def _main() -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build llama-server, llama-quantize, llama-imatrix under bench/.peers/")
    b.add_argument("--jobs", type=int, default=2)
    s = sub.add_parser("serve", help="run llama-server in the foreground until Ctrl-C")
    s.add_argument("--gguf", type=Path, required=True)
    s.add_argument("--port", type=int, default=8090)
    s.add_argument("--parallel", type=int, default=1)
    s.add_argument("--ctx", type=int, default=2048, help="KV tokens per slot")
    s.add_argument("--threads", type=int, default=None)
    q = sub.add_parser("quantize", help="llama-quantize IN OUT TYPE")
    q.add_argument("src", type=Path)
    q.add_argument("dst", type=Path)
    q.add_argument("qtype")
    c = sub.add_parser("check-bf16", help="compare a BF16 GGUF with the source as our engine loads it")
    c.add_argument("source", type=Path)
    c.add_argument("converted", type=Path)
    args = parser.parse_args()
    # SIGTERM (e.g. from `timeout`) must unwind the context managers too, or llama-server would outlive us.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.cmd == "build":
        started = time.monotonic()
        print(f"built into {build(jobs=args.jobs)} in {time.monotonic() - started:.0f} s")
    elif args.cmd == "serve":
        with llama_server(args.gguf, args.port, args.parallel, args.ctx, args.threads) as server:
            print(f"llama-server ready at {server.base_url} (log {server.log_path}); Ctrl-C to stop")
            with contextlib.suppress(KeyboardInterrupt):
                server.process.wait()
    elif args.cmd == "quantize":
        print(quantize(args.src, args.dst, args.qtype))
    else:
        print(compare_weights(args.source, args.converted))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
