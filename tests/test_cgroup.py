"""The kernel-enforced budget: real children in real memory cgroups (skipped where none is writable).
A child under its cap finishes and the kernel's peak stays under the cap; one that outgrows it is OOM-killed and
reported as such, with where its memory peaked; `bench --cap` gives the same tokens as an uncapped run."""
from __future__ import annotations

import json
import sys
import textwrap

import pytest

from conftest import synth_tiny
from moestream.bench import BenchOptions, bench
from moestream.cgroup import CgroupError, find_controller, run_capped
from moestream.cli import main

CONTROLLER, WHY = find_controller()
needs_cgroup = pytest.mark.skipif(CONTROLLER is None, reason=f"no writable memory cgroup: {WHY}")
MiB = 1 << 20


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


@needs_cgroup
def test_child_under_the_cap_succeeds():
    run = run_capped(_python("x = b'\\x01' * (96 << 20); print(len(x))"), 256 * MiB, "under")
    assert run.returncode == 0 and run.stdout.strip() == str(96 * MiB)
    assert not run.oom_killed and run.oom_kills == 0
    assert 96 * MiB <= run.peak_bytes <= run.cap_bytes == 256 * MiB


@needs_cgroup
def test_child_beyond_the_cap_is_oom_killed_and_says_where():
    child = """
        import time
        from moestream.cgroup import watch_peak
        watch_peak(interval=0.005)
        def grow():
            held = []
            for _ in range(40):  # 40 x 16 MiB against a 160 MiB cap, slowly enough to be sampled
                held.append(b'\\x01' * (16 << 20))
                time.sleep(0.03)
        grow()
        print("survived")
    """
    run = run_capped(_python(child), 160 * MiB, "beyond")
    assert run.oom_killed and run.returncode != 0 and "survived" not in run.stdout
    assert run.peak_bytes <= run.cap_bytes and run.failcnt > 0
    text = run.describe()
    assert "OOM-KILLED" in text and "cap 160.00 MiB" in text
    assert run.peak_stack is not None and any("grow" in frame for frame in run.peak_stack["stack"])


@needs_cgroup
def test_unlimited_group_only_measures():
    run = run_capped(_python("x = b'\\x01' * (64 << 20)"), None, "measure")
    assert run.returncode == 0 and run.cap_bytes is None and run.peak_bytes >= 64 * MiB
    assert "no cap" in run.describe()


@needs_cgroup
def test_bench_cap_gives_the_uncapped_tokens(tmp_path_factory, capsys):
    path = synth_tiny(tmp_path_factory, "qwen3_moe")
    opts = BenchOptions(ram_budget=64 * MiB, prompt_len=12, gen_len=6, probe=False)
    want = bench(path, opts)["generated_ids"]
    assert main(["bench", str(path), "--ram-budget", "64MiB", "--prompt-len", "12", "--gen-len", "6", "--no-probe",
                 "--cap", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    cg = report["cgroup"]
    assert report["generated_ids"] == want and len(want) == 6
    assert not cg["oom_killed"] and 0 < cg["peak_bytes"] <= cg["cap_bytes"]
    assert cg["cap_bytes"] >= 64 * MiB + 512 * MiB  # budget + interpreter RSS + the default allowance


def test_cap_needs_a_budget(tmp_path_factory, capsys):
    path = synth_tiny(tmp_path_factory, "qwen3_moe")
    assert main(["bench", str(path), "--no-probe", "--cap"]) == 2
    assert "--cap needs --ram-budget" in capsys.readouterr().err


def test_no_controller_is_a_clear_error(monkeypatch, tmp_path):
    """Where no memory controller is writable the run is refused with the reason, not a traceback."""
    import moestream.cgroup as cg

    monkeypatch.setattr(cg, "V1_ROOT", tmp_path / "nope")
    monkeypatch.setattr(cg, "V2_ROOTS", (tmp_path,))
    ctl, why = cg.find_controller()
    assert ctl is None and why
    with pytest.raises(CgroupError, match="cannot enforce a memory cap"):
        cg.run_capped(_python("pass"), 1 << 30)


def test_memory_available_is_the_nearer_of_the_machine_and_the_own_cgroup(tmp_path):
    """MemAvailable, or less where the process's memory cgroup (v2 or v1), or a group above it, is nearer its limit;
    no limit ("max", or no memory controller) leaves MemAvailable."""
    from moestream.cgroup import memory_available

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:    2000000 kB\n")
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    (v2 / "box").mkdir(parents=True)
    (v2 / "box" / "memory.max").write_text("1073741824\n")
    (v2 / "box" / "memory.current").write_text("268435456\n")
    (v1 / "job").mkdir(parents=True)
    (v1 / "job" / "memory.limit_in_bytes").write_text("536870912\n")
    (v1 / "job" / "memory.usage_in_bytes").write_text("134217728\n")
    groups = tmp_path / "cgroup"

    def avail(text: str) -> int | None:
        groups.write_text(text)
        return memory_available(meminfo, groups, v2, v1)

    assert avail("0::/box\n") == (1 << 30) - (1 << 28)
    assert avail("4:memory:/job\n0::/\n") == (1 << 29) - (1 << 27)
    (v2 / "box" / "memory.max").write_text("max\n")
    assert avail("0::/box\n") == 2_000_000 * 1024
    assert avail("4:cpu,cpuacct:/job\n") == 2_000_000 * 1024  # no memory controller there
    assert memory_available(meminfo, tmp_path / "none", v2, v1) == 2_000_000 * 1024
    assert memory_available(tmp_path / "none", groups, v2, v1) is None
    (v2 / "box" / "job").mkdir()  # a group with no limit of its own under a limited one: the parent's room
    (v2 / "box" / "job" / "memory.max").write_text("max\n")
    (v2 / "box" / "job" / "memory.current").write_text("1\n")
    (v2 / "box" / "memory.max").write_text("1073741824\n")
    assert avail("0::/box/job\n") == (1 << 30) - (1 << 28)

