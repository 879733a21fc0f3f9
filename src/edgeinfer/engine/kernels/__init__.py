"""Our CPU kernels (cpu_gemv.cpp, bf16_gemv.cpp, decode_ops.cpp, dense_step.cpp, ...): built at first use,
picked by CPU feature at run time.

A leaf room: torch, the standard library and the cache dir's location only (tests/test_rooms.py). The
model room switches its layers onto the kernels (model/decode_ops.py, model/kernel_forms.py); every room
calls them through the typed wrappers of `ops.py`, which load the extension where nothing has yet.

`load()` builds the extension with torch's C++ toolchain (a C++ compiler and ninja; once, then cached per
source under `$TORCH_EXTENSIONS_DIR` or our cache dir) and registers `torch.ops.edgeinfer_cpu.*`. The
matmuls have fake implementations, so they run inside `torch.compile` graphs as library calls.

The build targets plain x86-64; each fast variant carries its own target attribute (isa.h) and runs only
where the CPU reports its features (AVX512-BF16, AVX512-VNNI, AVX-512, AVX2), else the next one down, so
a build cache shared between machines never runs an instruction a CPU lacks. `isa()` names the level in
use; `EDGEINFER_CPU_ISA` (scalar, avx2, avx512, avx512_vnni) caps it, for tests of the fallbacks.

- `int8_gemv(xq, x_scale, w, w_scale)`: per-token int8 codes x row-major int8 weights -> fp32, bit for bit
  the `_int_mm` path's result (quant/int8.py); `int8_gemv_out(..., out)` writes a contiguous fp32 `out`;
  `int8_gemv_kn` takes the weight stored `[K, N]` (int8 layers with more inputs than outputs).
- `int4_gemv(x, codes, scales, zero_terms, group)`: W4A8 on the tiled layout of `int4_pack` (quant/int4.py),
  for any number of rows (the int8 dot products outrun a bf16 GEMM on the dequantized weight even at 512
  rows).
- `bf16_gemv(x, w)` / `bf16_gemv_out(x, w, out)`: bf16 `[M, K]` x bf16 weight `[N, K]` (row-major, as
  stored) with fp32 sums, into bf16 or fp32 (bf16.py: float models' linear layers and lm_head at few rows).
- `lossless_gemv(x, *form)` / `lossless_gemv_out`: the same sums, bit for bit, with the weight in the
  lossless resident form (lossless.py: ~70 % of bf16's bytes, decoded inside the loop); `lossless_decode`
  and `lossless_rows` give the matrix or some of its rows back.
- `rms_norm`, `rope`, `gated_act`, `paged_decode_one` and `paged_decode`: the small ops of a decode step, one
  call each (switched on by model/decode_ops.py); eager only (a compiled graph fuses the torch ops itself),
  so they have no fakes. The paged attention reads a bf16 cache or an int8 / float8 one with its scales
  where it lies (kv_codes.h); `kv_write` stores a step's K or V in either, quantized as quant/kv.py does.
  `mla_decode`: latent attention's absorbed decode (attention/mla.py); `packed_attention`: a packed
  encoder batch's attention (model/bert.py).
- `lora_add`: a step's LoRA deltas on one module, every adapter's tokens in one call (lora.cpp;
  engine/lora/apply.py, and the fused decode step below); eager only, like the small ops.
- `torch.classes.edgeinfer_cpu.MoeBlock`: a sparse MoE block in one call (moe_block.cpp; model/moe.py).
- `torch.classes.edgeinfer_cpu.DenseDecodeStep`: every layer of a dense model's one-sequence decode step in
  one call, through the kernels above (dense_step.cpp; built by model/fused_decode.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import shutil
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE_NAMES = (
    "isa.cpp",
    "cpu_gemv.cpp",
    "bf16_gemv.cpp",
    "bf16_tiles.cpp",
    "lossless_gemv.cpp",
    "decode_ops.cpp",
    "kv_write.cpp",
    "mla_decode.cpp",
    "moe_block.cpp",
    "dense_step.cpp",
    "encoder_attention.cpp",
    "lora.cpp",
)
_SOURCES = [Path(__file__).with_name(name) for name in _SOURCE_NAMES]
# int8 inputs of up to this many rows take `int8_gemv` (wider ones `_int_mm`): at a few rows it runs at the
# memory's pace, where `_int_mm` costs about as much at one row as at many; by this many the two meet.
GEMV_ROWS = 16
# The same for int8 weights stored `[K, N]` (`int8_gemv_kn`), which interleaves the weight in registers for
# every 4 rows: past one such pass `_int_mm`'s blocked GEMM is the faster.
GEMV_KN_ROWS = 4
TILE = 16  # int4 rows per tile (cpu_gemv.cpp kTile)
SLAB = 8  # int4 inputs per 64-byte slab (kSlab)
METHODS = ("int8", "int4")  # weight methods with a form the kernels read (`WeightMethod.gemv_form`)
KERNELS = ("cpu_gemv", "cpu_w4a8")  # `PreparedWeight.kernel` of those forms
# isa.h's levels, lowest first; `EDGEINFER_CPU_ISA` caps the kernels at one of them
ISA_LEVELS = ("scalar", "avx2", "avx512", "avx512_vnni", "avx512_bf16")
ISA_ENV = "EDGEINFER_CPU_ISA"


class KernelBuildError(RuntimeError):
    """The extension could not be compiled or loaded here."""


# Whether `load()` has returned in this process. `ops.py` checks it on every call: a global read, which
# `torch.compile` folds into a guard, where calling `load()` would have it trace into the build code.
loaded = False


@cache
def load() -> None:
    """Build (or reuse) and load the extension; raises KernelBuildError with the compiler's reason."""
    global loaded
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise KernelBuildError(f"the CPU GEMV kernels are x86-only, this machine is {platform.machine()}")
    cap = os.environ.get(ISA_ENV, "")
    if cap and cap not in ISA_LEVELS:
        raise KernelBuildError(f"{ISA_ENV}={cap!r} is not one of {', '.join(ISA_LEVELS)}")
    build = _build_dir()
    if not _load_finished(build):
        with _building(build):
            if not _load_finished(build):  # another process may have built it while this one waited
                _build(build)
                (build / _FINISHED).touch()
    _register_fakes()
    loaded = True
    log.info("CPU GEMV kernels loaded (instruction set: %s)", torch.ops.edgeinfer_cpu.isa())


_NAME = "edgeinfer_cpu_kernels"
# Written after a build succeeds. The directory is keyed by everything the build reads (_build_dir), so
# a finished one is loaded as it is: torch's loader would import setuptools and run ninja to find that
# nothing changed, a cost paid again on every start.
_FINISHED = "finished"


def _load_finished(build: Path) -> bool:
    """Load the library of a finished build; False (and the build's output removed, so that ninja links
    it again) where there is none or it does not load."""
    library = build / f"{_NAME}.so"
    if not (build / _FINISHED).exists():
        return False
    try:
        torch.ops.load_library(str(library))
        return True
    except OSError as e:
        log.warning("rebuilding the CPU GEMV kernels: %s does not load (%s)", library, e)
        (build / _FINISHED).unlink(missing_ok=True)
        library.unlink(missing_ok=True)
        return False


@contextlib.contextmanager
def _building(build: Path) -> Iterator[None]:
    """One process builds at a time, under a lock the kernel releases when its holder dies. torch's own
    lock is a file that a build killed midway (a first start stopped with Ctrl-C) leaves behind, and every
    later start would then wait for it forever; under ours, any such file is a dead build's."""
    with open(build / "build.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (build / "lock").unlink(missing_ok=True)
        yield


def _build(build: Path) -> None:
    from torch.utils import cpp_extension

    try:
        cpp_extension.load(
            name=_NAME,
            sources=[str(s) for s in _SOURCES],
            # no -march: the fast variants carry target attributes and are chosen at run time (isa.h)
            extra_cflags=_CFLAGS,
            build_directory=str(build),
            is_python_module=False,
            verbose=False,
        )
    except Exception as e:  # compiler missing, ninja missing, a build error
        raise KernelBuildError(
            f"could not build the CPU GEMV kernels: {str(e).strip().splitlines()[-1]}"
        ) from e


# -fopenmp: at::parallel_for is inline OpenMP in ATen's headers; without it every product runs on one thread
_CFLAGS = ["-O3", "-fopenmp"]


def _build_dir() -> Path:
    """A build directory of this source, flags and torch, under `$TORCH_EXTENSIONS_DIR` or our cache dir.
    torch's own default keeps one build per extension name, so two installs with different sources
    would rebuild over each other on every start. The sources' paths are hashed too: torch's build file
    names them, so two checkouts of the same source in one directory would rebuild over each other as
    well. So is the `ninja` on PATH that torch runs: ninja 1.12 changed the hash its log keeps of each
    command, so the pip package's ninja (in an activated venv) and the system's (the same install run by
    path) would each take the other's build as stale and rebuild it on every switch."""
    from edgeinfer.engine.cache_dir import cache_root

    ninja = shutil.which("ninja") or ""
    digest = hashlib.sha256(" ".join(_CFLAGS).encode() + torch.__version__.encode() + ninja.encode())
    for source in [*_SOURCES, *sorted(Path(__file__).parent.glob("*.h"))]:
        digest.update(str(source.resolve()).encode() + source.read_bytes())
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cache_root() / "extensions")
    path = root / f"edgeinfer_cpu_kernels-{digest.hexdigest()[:16]}"
    path.mkdir(parents=True, exist_ok=True)
    return path


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux's /proc/cpuinfo lists them (empty where it cannot be read), known
    without building: the default (`cpu_gemv` auto) leaves a kernel off where it would run as plain loops."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
        return frozenset(line.partition(":")[2].split())
    except OSError:
        return frozenset()


def cpu_has_bf16_matmul() -> bool:
    """AVX512-BF16 or AMX-BF16: bf16 matmuls in hardware. Without them (AVX2-only x86) oneDNN emulates
    bf16, several times slower than fp32."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def cpu_has_vnni() -> bool:
    """AVX512-VNNI: the int8 / int4 kernels' fastest variant (AVX2 runs the same sums at half the width)."""
    return "avx512_vnni" in cpu_flags()


def cpu_has_avx2() -> bool:
    """AVX2 and FMA: the least our kernels need to beat torch's (x86 only): at half AVX-512's width the
    int8 and int4 products of a decode step still outrun torch's kernels (docs/quantization.md)."""
    return platform.machine().lower() in ("x86_64", "amd64") and {"avx2", "fma"} <= cpu_flags()


def count_bf16_linears(model: torch.nn.Module) -> int:
    """bf16 `nn.Linear` layers on CPU that `bf16.use_bf16_gemv` would replace."""
    from edgeinfer.engine.kernels.bf16 import fits

    return sum(type(m) is torch.nn.Linear and fits(m.weight) for m in model.modules())


def _register_fakes() -> None:
    @torch.library.register_fake("edgeinfer_cpu::int8_gemv")
    def _int8(
        xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor
    ) -> torch.Tensor:
        return xq.new_empty((xq.shape[0], w.shape[0]), dtype=torch.float32)

    @torch.library.register_fake("edgeinfer_cpu::int8_gemv_out")
    def _int8_out(
        xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor
    ) -> None:
        return None

    @torch.library.register_fake("edgeinfer_cpu::int8_gemv_kn")
    def _int8_kn(
        xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor
    ) -> torch.Tensor:
        return xq.new_empty((xq.shape[0], w.shape[1]), dtype=torch.float32)

    @torch.library.register_fake("edgeinfer_cpu::bf16_gemv")
    def _bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], w.shape[0]))

    @torch.library.register_fake("edgeinfer_cpu::bf16_gemv_out")
    def _bf16_out(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        return None

    @torch.library.register_fake("edgeinfer_cpu::lossless_gemv")
    def _lossless(x: torch.Tensor, low_bytes: torch.Tensor, *form: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], low_bytes.shape[0]))

    @torch.library.register_fake("edgeinfer_cpu::lossless_gemv_out")
    def _lossless_out(x: torch.Tensor, *form_and_out: torch.Tensor) -> None:
        return None

    @torch.library.register_fake("edgeinfer_cpu::int4_gemv")
    def _int4(
        x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zero_terms: torch.Tensor, group: int
    ) -> torch.Tensor:
        return x.new_empty((x.shape[0], codes.shape[0] * TILE))


def int4_pack(
    q: torch.Tensor, zero_term: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """uint8 codes `[N, K]` in [0, 15] and bf16 zero terms and scales `[N, K/G]` (the weight is
    `(q - 8) * scale + zero_term`, as in torch's int4 CPU layout) -> `int4_gemv`'s layout.

    Codes: `[N/16, K/8, 64]`, byte `4r + j` of slab `s` of a tile = row `r`'s input `8s + j` (low nibble)
    and `8s + 4 + j` (high). Scales and zero terms: `[N/16, K/G, 16]`, one lane per row of the tile.
    """
    n, k = q.shape
    if n % TILE or k % SLAB:
        raise ValueError(f"int4_pack needs rows a multiple of {TILE} and inputs of {SLAB}, got {n}x{k}")
    t = q.to(torch.uint8).reshape(n // TILE, TILE, k // SLAB, 2, 4)
    slabs = (t[..., 0, :] | (t[..., 1, :] << 4)).permute(0, 2, 1, 3)  # [tile, slab, row, j]
    codes = slabs.reshape(n // TILE, k // SLAB, 64).contiguous()

    def lanes(v: torch.Tensor) -> torch.Tensor:
        return v.to(torch.bfloat16).reshape(n // TILE, TILE, -1).transpose(1, 2).contiguous()

    return codes, lanes(scale), lanes(zero_term)
