"""moestream: run Mixture-of-Experts checkpoints far larger than RAM.

Weights stay in the checkpoint's safetensors shards; the routed experts a token needs are paged into a
byte-budgeted RAM cache. The public entry point is `Engine`.
"""
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "Engine":
        from moestream.engine.engine import Engine

        return Engine
    raise AttributeError(name)
