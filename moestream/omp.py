"""torch's OpenMP workers sleep as soon as a parallel op ends, in this process only.

With its default wait policy libgomp (torch's OpenMP runtime in the Linux wheels) keeps each worker spinning after
a parallel op: about 10 ms of CPU per op on the 2-core test VM. The spinning worker holds a core that the native
kernels' thread pool (kernels/_cpu.c) needs for the call right after a torch op, and the caller then runs that call
alone: a q3m_med 128-row bf16 batch step took 0.39 s that way and 0.27 s with the passive policy, its fused GLU calls
0.33 and 0.22 ms an expert; warm one-stream decode runs no OpenMP region and is unchanged (docs/performance.md,
"The batch step's GLU calls" and "torch's OpenMP workers sleep").

libgomp reads OMP_WAIT_POLICY once, in its constructor, when the library is loaded. `load_passive_openmp` sets
OMP_WAIT_POLICY=PASSIVE, loads the libgomp that torch's own libraries will link to (the one in the torch package,
found without importing torch) and removes the variable again: torch, imported later, finds that library loaded
(the dynamic loader matches it by its soname) and uses it with the passive policy, and child processes (llama.cpp
peers, Ray's processes, subprocesses) start with the environment they would have had without moestream. Loading
torch itself instead would cost every `import moestream` 1-5 s on the test VM and about 200 MB of RSS, torch-free
tools (a small child under a memory cap importing moestream.cgroup) included.

It does nothing where the choice is not ours or could no longer take effect: torch already imported or an OpenMP
runtime already loaded, the user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT, MOESTREAM_OMP_PASSIVE=0 (the switch for
A/B runs), or no single libgomp inside the torch package (e.g. a build on LLVM's libomp, which reads its
environment later, at its first parallel region). Other libraries that link libgomp.so.1 later in the same process
(e.g. llama-cpp-python's ggml) share the loaded runtime and so its policy.
"""
from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import sys

OPT_OUT_ENV = "MOESTREAM_OMP_PASSIVE"
USER_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # the user's own choice of libgomp's waiting
_RUNTIMES = ("libgomp", "libiomp", "libomp")  # OpenMP runtimes whose constructor would already have run

passive_set: bool | None = None  # whether load_passive_openmp set the policy (None: not called)
runtime_path: str | None = None  # the libgomp it loaded


def _openmp_loaded() -> bool:
    try:
        with open("/proc/self/maps") as f:
            return any(name in line for line in f for name in _RUNTIMES)
    except OSError:  # no /proc: nothing known to be loaded
        return False


def torch_libgomp() -> str | None:
    """The libgomp shipped inside the installed torch package (torch/lib, or torch.libs beside it in wheels whose
    libraries were renamed), found without importing torch; None unless there is exactly one."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    found = set()
    for pkg in spec.submodule_search_locations:
        for pattern in (os.path.join(pkg, "lib", "libgomp*.so*"),
                        os.path.join(os.path.dirname(pkg), "torch.libs", "libgomp*.so*")):
            found.update(os.path.realpath(p) for p in glob.glob(pattern))
    return found.pop() if len(found) == 1 else None


def load_passive_openmp() -> bool:
    """Load torch's libgomp with OMP_WAIT_POLICY=PASSIVE in the environment for the load only, where that choice is
    ours and can still reach the runtime (see the module docstring). True when the policy was set; the environment
    is as it was found either way."""
    global passive_set, runtime_path
    passive_set = False
    if (not sys.platform.startswith("linux") or "torch" in sys.modules
            or os.environ.get(OPT_OUT_ENV, "1") == "0" or any(k in os.environ for k in USER_SETTINGS)
            or _openmp_loaded()):
        return False
    path = torch_libgomp()
    if path is None:
        return False
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        ctypes.CDLL(path)  # its constructor reads the policy now; the handle stays loaded for torch
    except OSError:
        return False
    finally:
        os.environ.pop("OMP_WAIT_POLICY", None)
    passive_set, runtime_path = True, path
    return True
