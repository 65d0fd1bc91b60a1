"""moestream: run Mixture-of-Experts checkpoints far larger than RAM.

Weights stay in the checkpoint's safetensors shards; the routed experts a token needs are paged into a
byte-budgeted RAM cache. The public entry point is `Engine`.
"""
from moestream.omp import load_passive_openmp as _load_passive_openmp

__version__ = "0.1.0"

# torch's OpenMP workers (once torch is imported) sleep when a parallel op ends instead of spinning: the runtime is
# loaded now with that policy, and the variable that sets it is gone from the environment again before any child
# process can inherit it (moestream/omp.py).
_load_passive_openmp()


def __getattr__(name: str):
    if name == "Engine":
        from moestream.engine.engine import Engine

        return Engine
    raise AttributeError(name)
