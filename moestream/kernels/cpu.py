"""Native CPU kernels for small-batch work straight from stored weights: bf16 and MXFP4 times fp32 activations, the
grouped fused GLU experts of a layer step, rms_norm, GQA decode attention and the KDA decode step; and the opt-in
bf16 compute path for many rows (_cpu_bf16.c: bf16 weights times bf16-rounded activations, fp32 sums).

`_cpu.c` is compiled at first use with the system gcc (-O3 -march=native), cached under
$XDG_CACHE_HOME/moestream/kernels/ keyed by a hash of the source, the flags and the CPU (built to a temporary file
and renamed, so concurrent builds are safe), and loaded with ctypes, which releases the GIL during each call.
Without gcc, when the build fails, or with MOESTREAM_NATIVE=0, `available()` is False, `reason()` says why in one
line, and the callers (blocks.linear, quant.mxfp4_linear, latent_moe) keep their torch paths, which compute the
same values up to fp32 summation order. MOESTREAM_NATIVE_THREADS sets the threads per call (default below; the
engine sets it from --threads), MOESTREAM_NATIVE_SPIN_US how long idle pool threads poll before sleeping.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Iterator, Sequence

import torch
from torch import Tensor

# Up to this many activation rows the native kernels beat upcast/decode + torch.mm (bench/kernels.py,
# docs/performance.md); above it the torch paths are compute-efficient and are kept.
MAX_TOKENS_BF16 = 16
MAX_TOKENS_MXFP4 = 32
# Threads per call (the caller included) unless set: as many as torch's intra-op pool (all cores by default), so
# that without --threads torch's small ops and the native kernels agree (one native thread next to a torch pool
# of all cores left the other cores idle in the kernels that do most of a decode step's work). Two threads won on
# expert-sized matrices in bench/kernels.py; small matrices stay on one (below MIN_ROWS_PER_THREAD rows per
# thread the wake-up costs more than it saves).
def default_threads() -> int:
    return max(1, torch.get_num_threads())

MIN_ROWS_PER_THREAD = 256
# How long a pool worker polls for the next call before it sleeps (MOESTREAM_NATIVE_SPIN_US): a decode step's
# Python between two native calls takes tens to hundreds of microseconds (more on a busy machine), and a sleeping
# worker costs a wake-up per call: tens of microseconds on an idle machine, but on a VM whose other vCPU runs
# another process the woken worker often lands on the caller's CPU and the call runs on one thread (measured:
# 300 us of polling left decode steps flipping between ~25 and 85-110 ms on the peer model). Past the first 300 us
# the poll yields the CPU every 50 us (_cpu.c POOL_HOT_NS), so a longer poll does not starve other threads.
SPIN_US = 3000

FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-pthread")
_ABI = 22
_SOURCE = Path(__file__).with_name("_cpu.c")
# _cpu.c #includes the others
_SOURCES = (_SOURCE, *(Path(__file__).with_name(n)
                       for n in ("_cpu_exp.c", "_cpu_panel.c", "_cpu_b12.c", "_cpu_step.c", "_cpu_paged.c", "_cpu_layer.c", "_cpu_bf16.c",
                                 "_cpu_fixed.c", "_cpu_fp8.c")))
_LAYOUTS = {"low_first": 0, "gguf": 1}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_path: Path | None = None  # the file _lib was loaded from
_why = ""
_loaded = False
_forced_off = 0


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    from moestream.config import default_cache_dir
    return default_cache_dir() / "kernels"


def library_path() -> Path:
    """Where the compiled library for this source, these flags and this CPU lives (built or not)."""
    key = hashlib.sha256()
    for part in (*(f.read_bytes() for f in _SOURCES), " ".join(FLAGS).encode(), platform.machine().encode(), _cpu_flags().encode()):
        key.update(part)
        key.update(b"\0")
    return _cache_dir() / f"moestream_cpu-{key.hexdigest()[:16]}.so"


def _build(target: Path) -> None:
    gcc = shutil.which("gcc")
    if gcc is None:
        raise RuntimeError("gcc not found on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([gcc, *FLAGS, "-o", tmp, str(_SOURCE), "-lm"], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["no output"])[0]
            raise RuntimeError(f"gcc failed ({done.returncode}): {first}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)  # atomic: a concurrent builder's identical file is replaced whole
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _declare(lib: ctypes.CDLL) -> None:
    i64, p = ctypes.c_int64, ctypes.c_void_p
    lib.ms_abi.restype = ctypes.c_int
    lib.ms_simd.restype = ctypes.c_int
    lib.ms_find_byte.argtypes = [p, i64, ctypes.c_int]
    lib.ms_find_byte.restype = i64
    lib.ms_linear_bf16.argtypes = [p, i64, i64, p, i64, p, i64]
    lib.ms_linear_bf16.restype = ctypes.c_int
    lib.ms_linear_bf16_many.argtypes = [p, i64, i64, i64, p, p, p, i64]
    lib.ms_linear_bf16_many.restype = ctypes.c_int
    lib.ms_linear_bf16_heads.argtypes = [p, i64, i64, i64, p, i64, i64, p, i64]
    lib.ms_linear_bf16_heads.restype = ctypes.c_int
    lib.ms_linear_mxfp4.argtypes = [i64, p, p, p, p, p, i64, i64, ctypes.c_int, i64, ctypes.c_int]
    lib.ms_linear_mxfp4.restype = ctypes.c_int
    lib.ms_linear_mxfp4_bf16.argtypes = lib.ms_linear_mxfp4.argtypes
    lib.ms_linear_mxfp4_bf16.restype = ctypes.c_int
    lib.ms_mxfp4_situ_group1.argtypes = [i64, p, p, p, p, p, p, i64, i64, ctypes.c_int, ctypes.c_float,
                                         ctypes.c_float, i64, p, p]
    lib.ms_mxfp4_situ_group1.restype = ctypes.c_int
    lib.ms_set_threads.argtypes = [ctypes.c_int]
    lib.ms_get_threads.restype = ctypes.c_int
    lib.ms_set_spin_us.argtypes = [i64]
    lib.ms_set_spin_us.restype = None
    lib.ms_pool_stats.argtypes = [p]
    lib.ms_pool_stats.restype = None
    lib.ms_moe_glu_bf16.argtypes = [i64, p, p, p, p, i64, i64, i64, p, i64, p, p, i64, p, ctypes.c_int,
                                    ctypes.c_float, ctypes.c_float]
    lib.ms_moe_glu_bf16.restype = ctypes.c_int
    lib.ms_router_softmax_topk.argtypes = [p, i64, i64, p, i64, i64, ctypes.c_int, p, p]
    lib.ms_router_softmax_topk.restype = ctypes.c_int
    lib.ms_rms_norm.argtypes = [p, i64, i64, p, ctypes.c_int, ctypes.c_float, p]
    lib.ms_rms_norm.restype = None
    lib.ms_kv_quantize.argtypes = [p, i64, i64, ctypes.c_int, i64, p, p, p]
    lib.ms_kv_quantize.restype = None
    lib.ms_gqa_attend.argtypes = [i64, i64, i64, i64, i64, p, p, p, i64, p, p, ctypes.c_int, ctypes.c_float, p,
                                  ctypes.c_float, ctypes.c_float, i64, p]
    lib.ms_gqa_attend.restype = ctypes.c_int
    lib.ms_gqa_decode_paged.argtypes = [i64, i64, i64, i64, i64, p, p, p, p, p, p, p, i64, ctypes.c_int, i64, i64,
                                        p, p, ctypes.c_int, ctypes.c_float, p, ctypes.c_float, ctypes.c_float, p]
    lib.ms_gqa_decode_paged.restype = ctypes.c_int
    lib.ms_conv_decode.argtypes = [i64, i64, i64, p, p, p, p]
    lib.ms_conv_decode.restype = None
    lib.ms_kda_decode.argtypes = [i64, i64, i64, i64, p, p, p, p, p, p, p]
    lib.ms_kda_decode.restype = None
    lib.ms_gqa_decode_block.argtypes = [p, p, p, p, p, i64, i64, p, p, p, p]
    lib.ms_gqa_decode_block.restype = ctypes.c_int
    lib.ms_gqa_decode_layers.argtypes = [i64, p, p, p, p, p]
    lib.ms_gqa_decode_layers.restype = i64
    lib.ms_gqa_rows_block.argtypes = [p, p, i64, p, p, p, i64, i64, p, p, p, p]
    lib.ms_gqa_rows_block.restype = ctypes.c_int
    lib.ms_prefetch_async.argtypes = [p]
    lib.ms_prefetch_async.restype = None
    lib.ms_layer_times.argtypes = [ctypes.c_int, ctypes.c_int, p]
    lib.ms_layer_times.restype = None
    lib.ms_bf16dp.restype = ctypes.c_int
    lib.ms_mxfp4_int.restype = ctypes.c_int
    lib.ms_situ_glu.argtypes = [p, p, i64, ctypes.c_float, ctypes.c_float, p]
    lib.ms_situ_glu.restype = None
    lib.ms_bf16_panel.restype = ctypes.c_int
    lib.ms_bf16dot_row_limit.restype = ctypes.c_int
    lib.ms_bf16dot_set_row_limit.argtypes = [ctypes.c_int]
    lib.ms_bf16dot_set_row_limit.restype = ctypes.c_int
    lib.ms_bf16dot_linear.argtypes = [p, i64, i64, i64, p, p, p]
    lib.ms_bf16dot_linear.restype = ctypes.c_int
    lib.ms_bf16dot_linear_ws.argtypes = [p, i64, i64, i64, p, p, p, p, i64]
    lib.ms_bf16dot_linear_ws.restype = ctypes.c_int
    lib.ms_bf16dot_linear_scratch.argtypes = [i64, i64]
    lib.ms_bf16dot_linear_scratch.restype = i64
    lib.ms_bf16dot_glu.argtypes = lib.ms_moe_glu_bf16.argtypes
    lib.ms_bf16dot_glu.restype = ctypes.c_int
    lib.ms_bf16dot_glu_ws.argtypes = [*lib.ms_moe_glu_bf16.argtypes, p, i64]
    lib.ms_bf16dot_glu_ws.restype = ctypes.c_int
    lib.ms_moe_glu_bf16_pairs.argtypes = lib.ms_moe_glu_bf16.argtypes
    lib.ms_moe_glu_bf16_pairs.restype = ctypes.c_int
    lib.ms_b12_decode.argtypes = [p, i64, i64, p]
    lib.ms_b12_decode.restype = None
    lib.ms_b12_decode_rows.argtypes = [p, i64, i64, i64, i64, p]
    lib.ms_b12_decode_rows.restype = None
    lib.ms_b12_check.argtypes = [p, i64, i64, i64]
    lib.ms_b12_check.restype = ctypes.c_int
    lib.ms_linear_fp8.argtypes = [p, i64, i64, p, i64, p, i64, i64, p, i64]
    lib.ms_linear_fp8.restype = ctypes.c_int
    lib.ms_linear_fp8_heads.argtypes = [p, i64, i64, i64, p, i64, i64, p, i64, i64, i64, p, i64]
    lib.ms_linear_fp8_heads.restype = ctypes.c_int
    lib.ms_linear_int4.argtypes = [p, i64, i64, p, p, ctypes.c_int, i64, p, i64]
    lib.ms_linear_int4.restype = ctypes.c_int
    lib.ms_linear_fp8_ptrs.argtypes = [i64, p, p, p, p, p, i64, i64, i64, i64, i64]
    lib.ms_linear_fp8_ptrs.restype = ctypes.c_int
    lib.ms_linear_int4_ptrs.argtypes = [i64, p, p, p, p, ctypes.c_int, p, i64, i64, i64]
    lib.ms_linear_int4_ptrs.restype = ctypes.c_int
    lib.ms_linear_fixed.argtypes = [p, i64, i64, p, ctypes.c_int, i64, p]
    lib.ms_linear_fixed.restype = ctypes.c_int
    lib.ms_softmax_topk.argtypes = [p, i64, i64, i64, ctypes.c_int, p, p]
    lib.ms_softmax_topk.restype = ctypes.c_int
    lib.ms_combine_slots.argtypes = [p, i64, i64, i64, p, p]
    lib.ms_combine_slots.restype = None


def _load() -> None:
    global _lib, _lib_path, _why, _loaded
    with _lock:
        if _loaded:
            return
        try:
            if os.environ.get("MOESTREAM_NATIVE", "1") == "0":
                raise RuntimeError("disabled by MOESTREAM_NATIVE=0")
            path = library_path()
            if not path.exists():
                _build(path)
            lib = ctypes.CDLL(str(path))
            _declare(lib)
            if lib.ms_abi() != _ABI:
                raise RuntimeError(f"{path.name} has ABI {lib.ms_abi()}, want {_ABI}")
            lib.ms_set_threads(int(os.environ.get("MOESTREAM_NATIVE_THREADS") or default_threads()))
            lib.ms_set_spin_us(int(os.environ.get("MOESTREAM_NATIVE_SPIN_US") or SPIN_US))
            _lib, _lib_path, _why = lib, path, ""
        except Exception as exc:  # any failure means: use the torch paths
            _lib, _lib_path, _why = None, None, f"native kernels off: {exc}".splitlines()[0]
        _loaded = True


def lib() -> ctypes.CDLL | None:
    """The loaded library, or None when the torch paths must be used."""
    if not _loaded:
        _load()
    return None if _forced_off else _lib


def required() -> ctypes.CDLL:
    """The loaded library; RuntimeError (saying why) when the native kernels are off."""
    handle = lib()
    if handle is None:
        raise RuntimeError(reason())
    return handle


def available() -> bool:
    return lib() is not None


def loaded_path() -> Path | None:
    """The file of the library in use (its name carries library_path's hash of sources, flags and CPU), or None."""
    return _lib_path if lib() is not None else None


def reason() -> str:
    """One line: why the native kernels are not in use ('' when they are)."""
    if not _loaded:
        _load()
    if _forced_off:
        return "native kernels off: disabled by moestream.kernels.cpu.disabled()"
    return _why


def reset() -> None:
    """Forget the load result (re-reads MOESTREAM_NATIVE and MOESTREAM_NATIVE_THREADS at the next use)."""
    global _loaded, _lib, _lib_path, _why
    with _lock:
        _loaded, _lib, _lib_path, _why = False, None, None, ""


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within the block every caller takes its torch path (for tests and A/B measurements)."""
    global _forced_off
    _forced_off += 1
    try:
        yield
    finally:
        _forced_off -= 1


def set_threads(n: int) -> None:
    """Threads per call, the caller included (a small persistent pool; 1 = the calling thread alone)."""
    if (handle := lib()) is not None:
        handle.ms_set_threads(int(n))


def set_spin_us(us: int) -> None:
    """How long a pool worker polls for the next call before sleeping, in microseconds (0: sleep at once)."""
    if (handle := lib()) is not None:
        handle.ms_set_spin_us(int(us))


def pool_stats() -> dict[str, int]:
    """Counters of the native thread pool since load: multi-threaded calls, calls whose caller slept waiting for
    a worker, times a worker slept between calls (each cost a wake-up), and calls whose caller polled longer than
    2000 pauses (~40 us), background prefetches posted (fused.prefetch), how many the next call cut short, and the
    bytes they read, and the parts of threaded calls the caller ran (or, for chunked work, dropped) itself because
    their worker had not started them by the time the caller's own part was done, and polls cut short because the
    two threads found themselves on one CPU, and the nanoseconds the caller spent waiting for parts a worker had
    started (the calls' tails); zeros without the library."""
    out = (ctypes.c_int64 * 10)()
    if (handle := lib()) is not None:
        handle.ms_pool_stats(out)
    return {"runs": out[0], "caller_sleeps": out[1], "worker_sleeps": out[2], "long_waits": out[3],
            "prefetches": out[4], "prefetches_cut": out[5], "prefetch_bytes": out[6], "taken": out[7],
            "shared_cpu": out[8], "wait_ns": out[9]}


LAYER_PHASES = ("prep", "q/k/v", "q/k norm, rope, attention", "o_proj", "post norm, router", "experts",
                "prefetch posted")


def layer_times(enable: bool, reset: bool = True) -> dict[str, int]:
    """The native decode layer's phase clocks (fused.DecodeBlock's call, _cpu_layer.c): wall ns spent in each of
    LAYER_PHASES since the last reset, plus "calls". Then zeroes them (reset) and turns them on or off (off at
    load; each phase costs a clock read while on). For benchmarks: one set of counters for the process. {} without
    the library."""
    handle = lib()
    if handle is None:
        return {}
    out = (ctypes.c_int64 * (len(LAYER_PHASES) + 1))()
    handle.ms_layer_times(int(enable), int(reset), out)
    return {**dict(zip(LAYER_PHASES, out[:-1])), "calls": out[-1]}


def threads() -> int:
    handle = lib()
    return handle.ms_get_threads() if handle is not None else 0


_SIMD_NAMES = {0: "", 1: "avx2", 2: "avx512"}


def simd() -> str:
    """The vector code the library was built with: "avx512", "avx2", or "" for its portable scalar code."""
    handle = lib()
    return _SIMD_NAMES.get(handle.ms_simd(), "") if handle is not None else ""


def rows(x: Tensor, in_features: int) -> Tensor:
    """x [..., in_features] as contiguous float32 [tokens, in_features] (ValueError on a width mismatch)."""
    if x.shape[-1] != in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the weight expects {in_features}")
    if x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():
        return x  # already that (a layer step's activations): no reshape / to / contiguous dispatch
    tokens = math.prod(x.shape[:-1])
    return x.reshape(tokens, in_features).to(torch.float32).contiguous()


def linear_bf16(x: Tensor, w: Tensor, min_rows_per_thread: int = MIN_ROWS_PER_THREAD) -> Tensor:
    """x [..., K] @ w[N, K]^T for a bf16 w, fp32 accumulate, float32 [..., N]. Needs available()."""
    handle = required()
    if w.dtype != torch.bfloat16 or w.dim() != 2:
        raise ValueError(f"linear_bf16 wants a 2-D bfloat16 weight, got {tuple(w.shape)} {w.dtype}")
    n, k = w.shape
    x2 = rows(x, k)
    if not w.is_contiguous():
        w = w.contiguous()
    out = torch.empty(x2.shape[0], n, dtype=torch.float32)
    if handle.ms_linear_bf16(x2.data_ptr(), x2.shape[0], k, w.data_ptr(), n, out.data_ptr(), min_rows_per_thread):
        raise MemoryError("native bf16 kernel could not allocate its input scratch")
    return out if x2 is x else out.view(*x.shape[:-1], n)


def fixed_weight(w: Tensor, k_in: int) -> bool:
    """Whether `linear_fixed` takes w for inputs of width k_in: a plain contiguous 2-D bf16 or fp32 [N, k_in]."""
    return (type(w) is torch.Tensor and w.dtype in (torch.bfloat16, torch.float32) and w.dim() == 2
            and w.is_contiguous() and w.shape[1] == k_in and not w.requires_grad)


def fixed_scratch(tokens: int, k_in: int) -> int:
    """An upper bound of the bytes ms_linear_fixed mallocs for `tokens` rows of width k_in: the rows in panels of
    up to 32 tokens (_cpu_panel.c's PANEL on any instruction set) and a packing buffer per thread."""
    return 4 * (-(-tokens // 32) * 32 * k_in + max(1, threads()) * 6 * (k_in + 32)) + 64


def linear_fixed(x: Tensor, w: Tensor) -> Tensor:
    """x [..., K] @ w[N, K]^T (w contiguous bf16 or fp32: fixed_weight), float32 [..., N], each output one fp32 sum
    over K in order whatever the number of rows (_cpu_fixed.c): the batch-invariant product. Needs available()."""
    handle = required()
    n, k = w.shape
    if not fixed_weight(w, k):
        raise ValueError(f"linear_fixed wants a contiguous 2-D bf16 or fp32 weight, got {tuple(w.shape)} {w.dtype}")
    x2 = rows(x, k)
    out = torch.empty(x2.shape[0], n, dtype=torch.float32)
    if handle.ms_linear_fixed(x2.data_ptr(), x2.shape[0], k, w.data_ptr(), int(w.dtype == torch.bfloat16), n,
                              out.data_ptr()):
        raise MemoryError("native fixed-order kernel could not allocate its input panels")
    return out if x2 is x else out.view(*x.shape[:-1], n)


def combine_slots(pairs: Tensor, weights: Tensor) -> Tensor:
    """sum_j weights[t, j] * pairs[t, j] over the slots in order, fp32 [T, D], natively in one pass (pairs fp32
    [T, k, D] and weights [T, k], made contiguous fp32). Needs available()."""
    handle = required()
    t, k, d = pairs.shape
    pairs = pairs.float().contiguous()
    w = weights.float().contiguous()
    out = torch.empty(t, d, dtype=torch.float32)
    handle.ms_combine_slots(pairs.data_ptr(), t, k, d, w.data_ptr(), out.data_ptr())
    return out


def softmax_topk(logits: Tensor, k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """softmax over each row of logits [T, E] (fp32) and its top k, best first, renormalised when asked, one row at a
    time natively (the same bits for a row whatever T). Returns (ids int64 [T, k], weights fp32 [T, k])."""
    handle = required()
    lg = logits.to(torch.float32).contiguous().clone()
    t, e = lg.shape
    ids = torch.empty(t, k, dtype=torch.int64)
    wts = torch.empty(t, k, dtype=torch.float32)
    if handle.ms_softmax_topk(lg.data_ptr(), t, e, k, int(renormalize), ids.data_ptr(), wts.data_ptr()):
        raise MemoryError("native softmax top-k could not allocate its scratch")
    return ids, wts


def dense_operand(w: Tensor) -> tuple[int, int, int]:
    """(address, N, K) of a contiguous 2-D bf16 weight, or of a b12-coded one (kernels/b12.py's B12Weight: its
    tagged address), as ms_linear_bf16_many takes them; ValueError for anything else."""
    tagged = getattr(w, "tagged_address", None)
    if tagged is not None:
        return tagged, w.out_features, w.in_features
    if w.dtype != torch.bfloat16 or w.dim() != 2 or not w.is_contiguous() or type(w) is not torch.Tensor:
        raise ValueError(f"native dense products want contiguous 2-D bfloat16 (or b12-coded) weights, got "
                         f"{type(w).__name__} {tuple(w.shape)} {w.dtype}")
    return w.data_ptr(), w.shape[0], w.shape[1]


def linear_bf16_many(x: Tensor, ws: Sequence[Tensor], min_rows_per_thread: int = MIN_ROWS_PER_THREAD) -> list[Tensor]:
    """[x @ w^T for w in ws] in one native call (x prepared once, all the rows split over the threads): x [T, K]
    fp32, each w a contiguous 2-D bf16 [N_i, K] or a b12-coded one (B12Weight: the coded bytes are read, the sums
    are the bf16 matrix's bit for bit). Returns float32 [T, N_i] each. Needs available()."""
    handle = required()
    ops = [dense_operand(w) for w in ws]
    k = ops[0][2]
    if any(o[2] != k for o in ops):
        raise ValueError(f"linear_bf16_many wants weights of one width [N, {k}]")
    x2 = rows(x, k)  # ValueError on a width mismatch
    outs = [torch.empty(x2.shape[0], n, dtype=torch.float32) for _, n, _ in ops]
    if handle.ms_linear_bf16_many(x2.data_ptr(), x2.shape[0], k, len(ws), _addresses([a for a, _, _ in ops]),
                                  _addresses([n for _, n, _ in ops]), _addresses([o.data_ptr() for o in outs]),
                                  min_rows_per_thread):
        raise MemoryError("native bf16 kernel could not allocate its scratch")
    return outs


def b12_decode_rows(codes: Tensor, n: int, k: int, start: int, stop: int, out: Tensor | None = None) -> Tensor:
    """bf16 rows [start, stop) of the b12-coded n x k matrix in `codes` (uint8, kernels/b12.py), exactly the
    stored values, into `out` (bf16 [stop - start, k]) or a new tensor. Needs available()."""
    handle = required()
    if out is None:
        out = torch.empty(stop - start, k, dtype=torch.bfloat16)
    if not (0 <= start <= stop <= n) or out.shape != (stop - start, k) or out.dtype != torch.bfloat16 \
            or not out.is_contiguous():
        raise ValueError(f"b12_decode_rows: rows [{start}, {stop}) of {n} into {tuple(out.shape)} {out.dtype}")
    handle.ms_b12_decode_rows(codes.data_ptr(), n, k, start, stop, out.data_ptr())
    return out


def b12_check(codes: Tensor, n: int, k: int) -> int:
    """ms_b12_check over the b12-coded n x k matrix in `codes` (uint8, contiguous): 0 when the kernels may read it,
    1 too short, 2 a row stored whole points outside it, 3 its exception table is damaged. Needs available()."""
    return required().ms_b12_check(codes.data_ptr(), codes.numel(), n, k)


def situ_glu(gate: Tensor, up: Tensor, beta: float, linear_beta: float) -> Tensor:
    """Kimi K3's SiTU-GLU of fp32 gate and up of one shape in one native call (ms_situ_glu: tanh and sigmoid from the
    kernels' own exponential, within a few ulp of float64; threads over long rows), a new fp32 tensor. Needs
    available()."""
    handle = required()
    if gate.shape != up.shape:
        raise ValueError(f"situ_glu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    g, u = gate.float().contiguous(), up.float().contiguous()
    out = torch.empty_like(g)
    handle.ms_situ_glu(g.data_ptr(), u.data_ptr(), g.numel(), beta, linear_beta, out.data_ptr())
    return out


def mxfp4_int() -> bool:
    """Whether one-token MXFP4 products (a decode step's; ms_linear_mxfp4 with every entry at one token) take the
    library's integer path (AVX-512 VNNI: x held per 8 inputs as a 23-bit fixed-point integer, exact integer
    products, _cpu_step.c mxv_row); False: the fp32 tiles, or no library."""
    handle = lib()
    return bool(handle.ms_mxfp4_int()) if handle is not None else False


def bf16dot() -> bool:
    """Whether the library's bf16 compute path (ms_bf16dot_*) uses the CPU's AVX-512 BF16 dot products (vdpbf16ps);
    False: its portable code (the same bf16-rounded inputs, widened and summed with fp32 FMAs), or no library."""
    handle = lib()
    return bool(handle.ms_bf16dp()) if handle is not None else False


_BF16_PANEL: list[int] = []  # the library's answer, asked once (a build constant; the GLU grouping prices every expert)


def bf16_panel() -> int:
    """Tokens per panel of the bf16 compute path (_cpu_bf16.c's BP: 64 with AVX-512 BF16); 64 without the library."""
    handle = lib()
    if handle is None:
        return 64
    if not _BF16_PANEL:
        _BF16_PANEL.append(handle.ms_bf16_panel())
    return _BF16_PANEL[0]


BF16DOT_DECODE_ROWS = 8  # at least the bf16 tile's rows (BPR): a coded weight's rows each thread decodes at a time


def bf16dot_scratch(rows: int, k_in: int, coded: bool = False) -> int:
    """Bytes of a bf16 product's scratch for `rows` rows of K inputs: the rows rounded to bf16, padded to a panel
    (the panels `linear_bf16dot_many` takes, fresh or a step's kept buffer), and the call's small index; with
    `coded` weights, each thread's decoded row block too."""
    panel = bf16_panel()
    decoded = threads() * BF16DOT_DECODE_ROWS * k_in * 2 if coded else 0
    return -(-rows // panel) * panel * k_in * 2 + 64 + 8 * 64 + decoded


# ---- a step's reused buffers ------------------------------------------------------------------------------
_STEP = threading.local()
# torch's count of references to a tensor's storage (views included): a kept buffer is free again when only the
# pool holds it. A private torch function: without it nothing is kept (every buffer is fresh, as before).
_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def _use_count(t: Tensor) -> int:
    return _USE_COUNT(t.untyped_storage()._cdata)


class StepBuffers:
    """Buffers that a step's many-row products write into (the bf16 dense products' outputs and input panels, one
    set a layer), kept while the step runs and handed out again to a later layer asking for the same shape once
    nothing references the earlier one: every layer of a step asks for the same shapes, so their pages fault in once
    a step instead of once a layer (with the engine's fixed 64 KiB mmap threshold each fresh tensor of a large step
    is a mapping of its own; a 2,560-row prompt step of q3m_med faulted ~230 k pages a step in those products alone,
    docs/performance.md). Given out as views, so a caller's reference (or a view of it) keeps a buffer busy; dropped
    when the step ends (`step_buffers`)."""

    def __init__(self):
        self.kept: dict[tuple, list[tuple[Tensor, int]]] = {}  # (shape, dtype) -> [(buffer, its idle use count)]

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        key = (tuple(shape), dtype)
        bufs = self.kept.setdefault(key, [])
        for buf, idle in bufs:
            if _use_count(buf) == idle:
                return buf.view(buf.shape)
        buf = torch.empty(shape, dtype=dtype)
        bufs.append((buf, _use_count(buf)))
        return buf.view(buf.shape)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for bufs in self.kept.values() for b, _ in bufs)


@contextlib.contextmanager
def step_buffers(on: bool = True) -> Iterator[StepBuffers | None]:
    """Within the block (this thread), `step_buffer` keeps and reuses buffers (StepBuffers); an enclosing block's
    buffers serve a nested one. Everything kept is dropped at the end (tensors handed out stay valid: they hold
    their own storage)."""
    outer = getattr(_STEP, "buffers", None)
    if not on or outer is not None or _USE_COUNT is None:
        yield outer
        return
    _STEP.buffers = StepBuffers()
    try:
        yield _STEP.buffers
    finally:
        _STEP.buffers = None


def step_buffer(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> Tensor:
    """An uninitialised tensor: a kept one of the running step's (`step_buffers`) when one is free, else fresh."""
    kept = getattr(_STEP, "buffers", None)
    return torch.empty(shape, dtype=dtype) if kept is None else kept.take(shape, dtype)


def linear_bf16dot_many(x: Tensor, ws: Sequence[Tensor]) -> list[Tensor]:
    """[bf16(x) @ w^T for w in ws] in one native call: x [T, K] fp32 rounded to bf16 once (round to nearest even),
    each w a contiguous 2-D bf16 [N_i, K] or a b12-coded one (B12Weight: each block of rows decoded into a thread's
    scratch, then the bf16 rows' sums bit for bit), K even; products summed in fp32 (the opt-in bf16 compute path,
    EngineOptions.compute_dtype). Each output row depends on its own input row only (not on T or on the other
    rows). Returns float32 [T, N_i] each; within `step_buffers` the outputs and the input panels are the running
    step's kept buffers. Needs available()."""
    handle = required()
    ops = [dense_operand(w) for w in ws]  # ValueError for anything but bf16 or b12-coded matrices
    k = ops[0][2]
    if any(o[2] != k for o in ops):
        raise ValueError(f"linear_bf16dot_many wants weights of one width [N, {k}]")
    if k % 2:
        raise ValueError(f"linear_bf16dot_many wants an even K, got {k}")
    x2 = rows(x, k)
    outs = [step_buffer((x2.shape[0], n)) for _, n, _ in ops]
    panels = step_buffer((handle.ms_bf16dot_linear_scratch(x2.shape[0], k),), torch.uint8)
    if handle.ms_bf16dot_linear_ws(x2.data_ptr(), x2.shape[0], k, len(ws), _addresses([a for a, _, _ in ops]),
                                   _addresses([n for _, n, _ in ops]), _addresses([o.data_ptr() for o in outs]),
                                   panels.data_ptr(), panels.numel()):
        raise MemoryError("native bf16 kernel could not allocate its input scratch")
    return outs


def linear_bf16_heads(x: Tensor, w: Tensor, first: int, stride: int, n: int,
                      min_rows_per_thread: int = MIN_ROWS_PER_THREAD) -> Tensor:
    """Per-head products in one native call: out[h] = x[h] @ W_h^T for x fp32 [H, T, K], where W_h is the bf16
    [n, K] block of contiguous rows starting `first + h * stride` elements into the contiguous bf16 tensor w (so
    MLA's kv_b value halves are read in place). Returns float32 [H, T, n]. Needs available()."""
    handle = required()
    h, t, k = x.shape
    if w.dtype != torch.bfloat16 or not w.is_contiguous():
        raise ValueError(f"linear_bf16_heads wants a contiguous bfloat16 weight, got {w.dtype}")
    if h and first + (h - 1) * stride + n * k > w.numel():
        raise ValueError(f"linear_bf16_heads: {h} heads of [{n}, {k}] at {first} + h * {stride} overrun the weight")
    x = _f32(x)
    out = torch.empty(h, t, n, dtype=torch.float32)
    if handle.ms_linear_bf16_heads(x.data_ptr(), h, t, k, w.data_ptr() + 2 * first, stride, n, out.data_ptr(),
                                   min_rows_per_thread):
        raise MemoryError("native bf16 kernel could not allocate its input scratch")
    return out


def find_byte(t: Tensor, value: int) -> int:
    """Flat index of the first byte equal to value in a contiguous uint8 tensor, or -1 (a memchr)."""
    handle = required()
    return int(handle.ms_find_byte(t.data_ptr(), t.numel(), value))


def _addresses(values: Sequence[int]) -> ctypes.Array:
    return (ctypes.c_int64 * len(values))(*values)


def _mxfp4_entry(handle: ctypes.CDLL, bf16: bool):
    """The MXFP4 call: fp32 activations, or (bf16) activations rounded to bf16 first (ms_linear_mxfp4_bf16: the
    bf16 compute path's precision)."""
    return handle.ms_linear_mxfp4_bf16 if bf16 else handle.ms_linear_mxfp4


def linear_mxfp4_many(xs: Sequence[Tensor], weights: Sequence[tuple[Tensor, Tensor]], layout: str = "low_first",
                      min_rows_per_thread: int = MIN_ROWS_PER_THREAD, bf16: bool = False) -> list[Tensor]:
    """[x_e @ W_e^T] for MXFP4 weights W_e = (packed uint8 [N, K/2], scales uint8 [N, K/32]) of one shape, in
    one native call; x_e float32 [T_e, K] (rounded to bf16 first with `bf16`). The caller has checked the operands
    (quant._mxfp4_operands) and that no scale byte is 255. Consecutive entries passing the same x tensor share its
    reordering."""
    handle = required()
    n, k = weights[0][0].shape[0], weights[0][0].shape[1] * 2
    rows = [x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous() for x in xs]
    for x in rows:
        if x.dim() != 2 or x.shape[1] != k:
            raise ValueError(f"x has shape {tuple(x.shape)}, the weights expect [T, {k}]")
    for p, s in weights:
        if p.shape != (n, k // 2) or s.shape != (n, k // 32) or not (p.is_contiguous() and s.is_contiguous()):
            raise ValueError("linear_mxfp4_many wants contiguous weights of one shape")
    outs = [torch.empty(x.shape[0], n, dtype=torch.float32) for x in rows]
    count = len(rows)
    code = _mxfp4_entry(handle, bf16)(count, _addresses([x.data_ptr() for x in rows]),
                                      _addresses([x.shape[0] for x in rows]),
                                      _addresses([p.data_ptr() for p, _ in weights]),
                                      _addresses([s.data_ptr() for _, s in weights]),
                                      _addresses([o.data_ptr() for o in outs]), n, k, _LAYOUTS[layout],
                                      min_rows_per_thread, 0)
    if code != 0:
        raise MemoryError("native MXFP4 kernel could not allocate its input scratch")
    return outs


def linear_mxfp4(x: Tensor, packed: Tensor, scales: Tensor, layout: str = "low_first",
                 min_rows_per_thread: int = MIN_ROWS_PER_THREAD, bf16: bool = False) -> Tensor:
    """x [T, K] @ W^T for one checked, contiguous MXFP4 weight (see linear_mxfp4_many), float32 [T, N]."""
    handle = required()
    n, k = packed.shape[0], packed.shape[1] * 2
    x2 = rows(x, k)
    if not (packed.is_contiguous() and scales.is_contiguous()) or scales.shape != (n, k // 32):
        raise ValueError("linear_mxfp4 wants contiguous packed [N, K/2] and scales [N, K/32]")
    out = torch.empty(x2.shape[0], n, dtype=torch.float32)
    one = ctypes.c_int64
    if _mxfp4_entry(handle, bf16)(1, ctypes.byref(one(x2.data_ptr())), ctypes.byref(one(x2.shape[0])),
                                  ctypes.byref(one(packed.data_ptr())), ctypes.byref(one(scales.data_ptr())),
                                  ctypes.byref(one(out.data_ptr())), n, k, _LAYOUTS[layout], min_rows_per_thread,
                                  0):
        raise MemoryError("native MXFP4 kernel could not allocate its input scratch")
    return out


def linear_fp8(x: Tensor, weight: Tensor, scale_inv: Tensor, block: tuple[int, int],
               min_rows_per_thread: int = MIN_ROWS_PER_THREAD) -> Tensor:
    """x [T, K] @ W^T for a block-FP8 weight read as stored (_cpu_fp8.c): weight float8_e4m3fn [N, K] (or its
    uint8 bytes), scale_inv [ceil(N / block[0]), ceil(K / block[1])], W = code * its block's scale_inv; K and
    block[1] multiples of 64. float32 [T, N]. Needs available()."""
    handle = required()
    n, k = weight.shape
    x2 = rows(x, k)
    codes = weight.view(torch.uint8)
    scales = _f32(scale_inv)
    want = (-(-n // block[0]), -(-k // block[1]))
    if not codes.is_contiguous() or tuple(scales.shape) != want:
        raise ValueError(f"linear_fp8 wants contiguous codes [N, K] and scale_inv {want}, got {tuple(scales.shape)}")
    out = torch.empty(x2.shape[0], n, dtype=torch.float32)
    _fp8_code(handle.ms_linear_fp8(x2.data_ptr(), x2.shape[0], k, codes.data_ptr(), n, scales.data_ptr(),
                                   block[0], block[1], out.data_ptr(), min_rows_per_thread), "linear_fp8", k, block)
    return out


def _quant_code(code: int, what: str, wants: str) -> None:
    """Raise for a native FP8 / int4 call's return code (_cpu_fp8.c: 0 done, -1 out of memory, -2 bad widths)."""
    if code == -1:
        raise MemoryError(f"native kernel ({what}) could not allocate its input scratch")
    if code:
        raise ValueError(f"{what} wants {wants}")


def _fp8_code(code: int, what: str, k: int, block: tuple[int, int]) -> None:
    _quant_code(code, what, f"K ({k}) and the column block ({block[1]}) multiples of 64")


def linear_fp8_heads(x: Tensor, codes: Tensor, scales: Tensor, head_rows: int, row0: int, rows: int,
                     block: tuple[int, int], min_rows_per_thread: int = MIN_ROWS_PER_THREAD) -> Tensor:
    """x [H, T, K] -> [H, T, rows]: head h's x times rows [h * head_rows + row0, ... + rows) of one block-FP8 weight
    (codes [H * head_rows, K] float8_e4m3fn or uint8, scale_inv [ceil(H * head_rows / block[0]), ceil(K /
    block[1])]), all heads in one threaded call (MLA's per-head products from a stored kv_b). head_rows and row0
    multiples of block[0]; K and block[1] multiples of 64. Needs available()."""
    handle = required()
    h, t, k = x.shape
    codes8 = codes.view(torch.uint8)
    s32 = _f32(scales)
    br, bc = block
    if codes8.shape[1] != k or codes8.shape[0] < h * head_rows or not codes8.is_contiguous() \
            or head_rows % br or row0 % br or row0 + rows > head_rows or not s32.is_contiguous():
        raise ValueError(f"linear_fp8_heads: {h} heads of {head_rows} rows (rows {row0}+{rows}) of "
                         f"{tuple(codes8.shape)} in blocks {block}")
    x3 = x.to(torch.float32).contiguous()
    out = torch.empty(h, t, rows, dtype=torch.float32)
    sk = -(-k // bc)
    code = handle.ms_linear_fp8_heads(x3.data_ptr(), h, t, k, codes8.data_ptr() + row0 * k, head_rows * k, rows,
                                      s32.data_ptr() + 4 * (row0 // br) * sk, (head_rows // br) * sk, br, bc,
                                      out.data_ptr(), min_rows_per_thread)
    _fp8_code(code, "linear_fp8_heads", k, block)
    return out


def linear_fp8_ptrs(xs: Sequence[int], tokens: Sequence[int], codes: Sequence[int], scales: Sequence[int],
                    outs: Sequence[int], n: int, k: int, block: tuple[int, int],
                    min_rows_per_thread: int = MIN_ROWS_PER_THREAD) -> None:
    """The raw batched call: for each entry e, outs[e] [tokens[e], n] = xs[e] [tokens[e], k] @ W_e^T, every
    argument but the counts a data_ptr (contiguous float32 x and out, the weight's e4m3 codes [n, k], its float32
    scale_inv [ceil(n / block[0]), ceil(k / block[1])]); k and block[1] multiples of 64. All entries' rows split
    over the threads together; each (row, token) the same bits as linear_fp8 gives it. The caller keeps the
    tensors alive."""
    _fp8_code(required().ms_linear_fp8_ptrs(len(xs), _addresses(xs), _addresses(tokens), _addresses(codes),
                                            _addresses(scales), _addresses(outs), n, k, block[0], block[1],
                                            min_rows_per_thread), "linear_fp8_ptrs", k, block)


def linear_int4_ptrs(xs: Sequence[int], tokens: Sequence[int], packed: Sequence[int], scales: Sequence[int],
                     bf16_scales: bool, outs: Sequence[int], n: int, k: int,
                     min_rows_per_thread: int = MIN_ROWS_PER_THREAD) -> None:
    """The raw batched call: for each entry e, outs[e] [tokens[e], n] = xs[e] [tokens[e], k] @ W_e^T, every
    argument but the counts a data_ptr (contiguous float32 x and out, int32 packed [n, k/8], scales [n, k/32],
    bf16 when `bf16_scales` else float32); k a multiple of 32. Each (row, token) the same bits as linear_int4
    gives it. The caller keeps the tensors alive."""
    _quant_code(required().ms_linear_int4_ptrs(len(xs), _addresses(xs), _addresses(tokens), _addresses(packed),
                                               _addresses(scales), int(bf16_scales), _addresses(outs), n, k,
                                               min_rows_per_thread), "linear_int4_ptrs", f"K ({k}) a multiple of 32")


def linear_int4(x: Tensor, packed: Tensor, scale: Tensor, min_rows_per_thread: int = MIN_ROWS_PER_THREAD) -> Tensor:
    """x [T, K] @ W^T for a compressed-tensors int4 weight read as stored (_cpu_fp8.c): packed int32 [N, K/8]
    (element 8j + i in bits 4i..4i+3 of word j, stored as value + 8), scale [N, K/32] bf16 or float32, one per
    group of 32; K a multiple of 32, every stored element a real one. float32 [T, N]. Needs available()."""
    handle = required()
    n, k = packed.shape[0], packed.shape[1] * 8
    x2 = rows(x, k)
    if packed.dtype != torch.int32 or scale.dtype not in (torch.bfloat16, torch.float32) \
            or not (packed.is_contiguous() and scale.is_contiguous()) or tuple(scale.shape) != (n, k // 32):
        raise ValueError(f"linear_int4 wants contiguous int32 packed [N, K/8] and bf16 or float32 scale "
                         f"[N, K/32], got {tuple(packed.shape)} {packed.dtype}, {tuple(scale.shape)} {scale.dtype}")
    out = torch.empty(x2.shape[0], n, dtype=torch.float32)
    _quant_code(handle.ms_linear_int4(x2.data_ptr(), x2.shape[0], k, packed.data_ptr(), scale.data_ptr(),
                                      int(scale.dtype == torch.bfloat16), n, out.data_ptr(), min_rows_per_thread),
                "linear_int4", f"K ({k}) a multiple of 32")
    return out


def linear_mxfp4_ptrs(xs: Sequence[int], tokens: Sequence[int], packed: Sequence[int], scales: Sequence[int],
                      outs: Sequence[int], n: int, k: int, layout: str = "low_first",
                      min_rows_per_thread: int = MIN_ROWS_PER_THREAD, bf16: bool = False) -> int:
    """The raw batched call: for each entry e, outs[e] [tokens[e], n] = xs[e] [tokens[e], k] @ W_e^T, every
    argument a data_ptr (contiguous float32 x and out, packed uint8 [n, k/2], scales uint8 [n, k/32]); with
    `bf16` x is rounded to bf16 first. The caller keeps the tensors alive. Looks for 0xFF scale bytes first:
    returns -1 when all is done, else the index of the first entry with one (nothing computed; raise with quant's
    error)."""
    handle = required()
    code = _mxfp4_entry(handle, bf16)(len(xs), _addresses(xs), _addresses(tokens), _addresses(packed),
                                      _addresses(scales), _addresses(outs), n, k, _LAYOUTS[layout],
                                      min_rows_per_thread, 1)
    if code < 0:
        raise MemoryError("native MXFP4 kernel could not allocate its input scratch")
    return code - 1


def mxfp4_situ_group1(x: int, w13: Sequence[tuple[int, int]], w2: Sequence[tuple[int, int]], weights: int, inter: int,
                      latent: int, beta: float, linear_beta: float, scratch: int, out: int,
                      layout: str = "low_first", min_rows_per_thread: int = MIN_ROWS_PER_THREAD) -> int:
    """One token x [latent] through E MXFP4 SiTU-GLU experts in one call (ms_mxfp4_situ_group1): out [latent] +=
    weights[e] * W2_e SiTU-GLU(W1_e x, W3_e x), e in order, with the bits of linear_mxfp4_ptrs, situ_glu and torch's
    `out += y * w` row by row. w13: (packed, scales) addresses of w1_0, w3_0, w1_1, ...; w2: those of w2_e; weights:
    E float32; scratch: 2 E inter + E latent float32; every argument an address the caller keeps alive. Returns -1
    when done, else the index of the first weight with a 0xFF scale byte (in w13, then w2 at 2E + e), nothing
    computed."""
    handle = required()
    code = handle.ms_mxfp4_situ_group1(len(w2), x, _addresses([p for p, _ in w13]), _addresses([s for _, s in w13]),
                                       _addresses([p for p, _ in w2]), _addresses([s for _, s in w2]), weights, inter,
                                       latent, _LAYOUTS[layout], beta, linear_beta, min_rows_per_thread, scratch, out)
    if code < 0:
        raise MemoryError("native MXFP4 group kernel could not allocate its input scratch")
    return code - 1


def _f32(t: Tensor) -> Tensor:
    return t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous()


def conv_decode(windows: Sequence[Tensor], xs: Sequence[Tensor], taps: Tensor) -> Tensor:
    """One token of a short causal depthwise conv for each of B sequences: windows[b] fp32 [K-1, C] (updated in
    place: shifted, x appended), xs[b] [C], taps [C, K] (tap K-1 multiplies the new token). Returns fp32 [B, C]
    before any activation."""
    handle = required()
    c, k = taps.shape
    taps = _f32(taps)
    xs = [_f32(x) for x in xs]
    for w, x in zip(windows, xs):
        if w.dtype != torch.float32 or not w.is_contiguous() or w.shape != (k - 1, c) or x.numel() != c:
            raise ValueError(f"conv_decode wants fp32 contiguous windows [{k - 1}, {c}] and inputs [{c}]")
    y = torch.empty(len(xs), c, dtype=torch.float32)
    handle.ms_conv_decode(len(xs), c, k, _addresses([w.data_ptr() for w in windows]),
                          _addresses([x.data_ptr() for x in xs]), taps.data_ptr(), y.data_ptr())
    return y


def kda_decode(states: Sequence[Tensor], q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """One delta-rule step for B sequences, each state fp32 [H, dk, dv] updated in place (models/kda.py's
    kda_recurrent for one token): q, k, g [B, H, dk], v [B, H, dv], beta [B, H]. Returns o fp32 [B, H, dv]."""
    handle = required()
    b, h, dk = q.shape
    dv = v.shape[-1]
    q, k, v, g, beta = (_f32(t) for t in (q, k, v, g, beta))
    if k.shape != (b, h, dk) or g.shape != (b, h, dk) or v.shape != (b, h, dv) or beta.shape != (b, h):
        raise ValueError("kda_decode: q, k, g [B, H, dk], v [B, H, dv], beta [B, H]")
    for s in states:
        if s.dtype != torch.float32 or not s.is_contiguous() or s.shape != (h, dk, dv):
            raise ValueError(f"kda_decode wants fp32 contiguous states [{h}, {dk}, {dv}]")
    out = torch.empty(b, h, dv, dtype=torch.float32)
    handle.ms_kda_decode(b, h, dk, dv, _addresses([s.data_ptr() for s in states]), q.data_ptr(), k.data_ptr(),
                         v.data_ptr(), g.data_ptr(), beta.data_ptr(), out.data_ptr())
    return out


def bf16_native(w: torch.Tensor, x: torch.Tensor | None = None, tokens: int | None = None) -> bool:
    """Whether `linear` computes x @ w^T with the native bf16 kernel (x, or just its row count `tokens`)."""
    if w.dtype != torch.bfloat16 or w.dim() != 2 or type(w) is not torch.Tensor:
        return False
    if x is not None:
        if x.requires_grad:
            return False
        tokens = x.numel() // max(1, x.shape[-1])
    return tokens is not None and tokens <= MAX_TOKENS_BF16 and available()
