"""The crc32 the packed format and the SSD tier check: ISA-L's (`isal`, a dependency) where installed, zlib's
otherwise; the same values either way, and both release the GIL. ISA-L's runs at 24.5 GB/s on this project's
2-core build machine against zlib's 5.9, which matters where every expert read of a packed checkpoint is verified:
a 256-sequence batch step reading 3 GB spent about 0.5 s of CPU in zlib's (docs/performance.md, "b12")."""
try:
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib keeps a broken install working
    from zlib import crc32

__all__ = ["crc32"]
