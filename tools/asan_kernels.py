"""Build the native kernels (moestream/kernels/_cpu.c) with AddressSanitizer where kernels/cpu.py will load them.

cpu.py loads `library_path()` (under $XDG_CACHE_HOME/moestream/kernels/) and builds it only when it is missing, so
compiling the same source with the same FLAGS plus -fsanitize=address to that path, under a private
XDG_CACHE_HOME, makes every later import use the ASan build: no hook in cpu.py. Run python with libasan preloaded
(`make asan` does both). Prints the library's path.
    XDG_CACHE_HOME=/tmp/asan-cache python tools/asan_kernels.py
"""
from __future__ import annotations

import os
import subprocess
import sys

from moestream.kernels import cpu

ASAN_FLAGS = ("-fsanitize=address", "-fno-omit-frame-pointer", "-g", "-O1")


def main() -> None:
    if "XDG_CACHE_HOME" not in os.environ:
        sys.exit("set XDG_CACHE_HOME to a scratch directory: the ASan build replaces the cached kernels there")
    target = cpu.library_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    flags = [f for f in cpu.FLAGS if not f.startswith("-O")] + list(ASAN_FLAGS)
    subprocess.run(["gcc", *flags, "-o", str(target), str(cpu._SOURCE), "-lm"], check=True)
    symbols = subprocess.run(["nm", "-D", str(target)], capture_output=True, text=True, check=True).stdout
    if "__asan_" not in symbols:
        sys.exit(f"{target}: built without AddressSanitizer symbols")
    print(target)


if __name__ == "__main__":
    main()
