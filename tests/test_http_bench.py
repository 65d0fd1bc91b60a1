"""bench/netshape.py's checks and bench/http_stream.py's refusal without them (no root, no tc needed: the shaped
link itself is a benchmark facility, measured by hand)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import netshape  # noqa: E402


def test_kernel_shaping_says_why_it_cannot_run(monkeypatch):
    monkeypatch.setattr(netshape.os, "geteuid", lambda: 1000)
    assert "root" in netshape.available()
    with pytest.raises(netshape.ShapingUnavailable, match="root"):
        netshape.ShapedLink(200e6).open()
    monkeypatch.setattr(netshape.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netshape.shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/" + tool)
    assert "`tc`" in netshape.available()


def test_shaped_link_names_and_rate():
    link = netshape.ShapedLink(200e6)
    assert link.ns.startswith(netshape.PREFIX) and len(link.host_dev) <= 15 and len(link.peer_dev) <= 15
    assert link.exec_argv(["python", "x"]) == ["ip", "netns", "exec", link.ns, "python", "x"]
    assert 1.04 < netshape.WIRE_PER_PAYLOAD < 1.05  # a 1500-byte MTU's headers, paid on the wire
    link.close()  # never opened: nothing to remove, no error


def test_bench_refuses_kernel_shaping_with_a_clear_error(tmp_path):
    """Without root the benchmark stops before starting anything and names the alternative."""
    code = ("import os, runpy, sys; os.geteuid = lambda: 1000; sys.argv = ['http_stream.py', sys.argv[1]]; "
            f"sys.path.insert(0, {str(ROOT / 'bench')!r}); runpy.run_path({str(ROOT / 'bench' / 'http_stream.py')!r}, "
            "run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin:/usr/sbin:/sbin"})
    assert r.returncode != 0 and "--shaping userspace" in r.stderr and "root" in r.stderr
