"""moestream/omp.py: `import moestream` gives this process's OpenMP workers the passive wait policy and leaves the
environment (and so child processes) as it found it; a user's own setting and MOESTREAM_OMP_PASSIVE=0 win.

Each case runs in a fresh interpreter: libgomp reads its policy once, when it is loaded (this pytest process has
imported torch already, in conftest.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import moestream
from moestream import omp

ROOT = str(Path(moestream.__file__).resolve().parent.parent)
VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MOESTREAM_OMP_PASSIVE")

# The child: imports moestream (first, or after torch), reports the OpenMP runtimes mapped once torch is in use, the
# policy's variables as it sees them (Python's environ and the C library's) and as children of its own see them,
# and -- with SPIN -- the CPU time its OpenMP workers take while the main thread sleeps after parallel ops
# (per-thread ns from /proc/self/task/*/schedstat).
CHILD = r"""
import ctypes, json, os, subprocess, sys, threading, time
if TORCH_FIRST:
    import torch
import moestream, moestream.omp
torch_by_moestream = "torch" in sys.modules and not TORCH_FIRST
import torch
VARS = %r
getenv = ctypes.CDLL(None).getenv
getenv.restype = ctypes.c_char_p
x = torch.ones(4) + 1  # torch's libraries are all loaded now
runtimes = None
if os.path.exists("/proc/self/maps"):
    with open("/proc/self/maps") as f:
        runtimes = sorted({ln.split()[-1] for ln in f if "libgomp" in ln or "libomp" in ln})
out = {"torch_by_moestream": torch_by_moestream, "passive_set": moestream.omp.passive_set,
       "runtime_path": moestream.omp.runtime_path, "runtimes": runtimes,
       "environ": {k: os.environ.get(k) for k in VARS},
       "c_getenv": {k: (getenv(k.encode()) or b"").decode() or None for k in VARS}}
grand = subprocess.run([sys.executable, "-c", "import json, os; print(json.dumps({k: os.environ.get(k) for k in %r}))"],
                       capture_output=True, text=True, check=True)
out["grandchild"] = json.loads(grand.stdout)
env_out = subprocess.run(["env"], capture_output=True, text=True, check=True).stdout.splitlines()
out["env_lines"] = [ln for ln in env_out if ln.split("=", 1)[0] in VARS]
if SPIN:
    torch.set_num_threads(2)
    me = threading.get_native_id()
    def workers_ns():
        total = 0
        for t in os.listdir("/proc/self/task"):
            if int(t) != me:
                try:
                    with open(f"/proc/self/task/{t}/schedstat") as f:
                        total += int(f.read().split()[0])
                except OSError:
                    pass  # a thread that ended
        return total
    x = torch.randn(1024, 1024)
    x @ x
    spun = 0
    for _ in range(5):
        x @ x          # parallel ops (matmul and an elementwise op over 1M floats)
        x.exp()
        before = workers_ns()
        time.sleep(0.2)
        spun += workers_ns() - before
    out["workers_ms_asleep"] = spun / 1e6
print(json.dumps(out))
""" % (VARS, VARS)


def run_child(env_set: dict[str, str], *, torch_first: bool = False, spin: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in VARS and k != "OMP_NUM_THREADS"}
    env.update(env_set)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    code = f"TORCH_FIRST = {torch_first}\nSPIN = {spin}\n" + CHILD
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def seen_everywhere(out: dict, name: str) -> set:
    """The values of `name` in the child's Python environ, its C environ, its own child and `env`'s output."""
    in_env = {ln.split("=", 1)[1] for ln in out["env_lines"] if ln.split("=", 1)[0] == name} or {None}
    return {out["environ"][name], out["c_getenv"][name], out["grandchild"][name]} | in_env


needs_two_cpus = pytest.mark.skipif(
    not os.path.exists("/proc/self/schedstat") or len(os.sched_getaffinity(0)) < 2,
    reason="the spin check needs Linux's /proc schedstat and two CPUs (libgomp barely spins on an oversubscribed one)")


@needs_two_cpus
@pytest.mark.skipif(omp.torch_libgomp() is None, reason="this torch ships no libgomp of its own (nothing to set)")
def test_policy_takes_in_process_and_does_not_reach_children():
    out = run_child({}, spin=True)
    assert out["passive_set"] is True and not out["torch_by_moestream"]  # `import moestream` stays torch-free
    assert out["runtimes"] == [out["runtime_path"]], out  # torch uses the very libgomp that was loaded early
    assert seen_everywhere(out, "OMP_WAIT_POLICY") == {None}, out
    # PASSIVE: the workers sleep as soon as an op ends. libgomp's default spins ~10 ms of CPU after an op (about
    # 50 ms over these five sleeps; the opt-out test below checks that it does), so a policy that did not take shows.
    assert out["workers_ms_asleep"] < 3.0, out


@needs_two_cpus
def test_opt_out_keeps_the_default_spinning_and_the_environment():
    out = run_child({"MOESTREAM_OMP_PASSIVE": "0"}, spin=True)
    assert out["passive_set"] is False
    assert seen_everywhere(out, "OMP_WAIT_POLICY") == {None}, out
    assert seen_everywhere(out, "MOESTREAM_OMP_PASSIVE") == {"0"}, out
    # The default policy's workers spin after each op; 1 s of sleeps leaves them room even on a loaded machine.
    assert out["workers_ms_asleep"] > 3.0, out


@pytest.mark.parametrize("name,value", [("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "12345")])
def test_a_users_own_setting_is_left_alone(name, value):
    out = run_child({name: value})
    assert out["passive_set"] is False
    assert seen_everywhere(out, name) == {value}, out
    for other in VARS:
        if other != name:
            assert seen_everywhere(out, other) == {None}, out


def test_torch_imported_first_is_left_alone():
    out = run_child({}, torch_first=True)
    assert out["passive_set"] is False
    assert seen_everywhere(out, "OMP_WAIT_POLICY") == {None}, out
