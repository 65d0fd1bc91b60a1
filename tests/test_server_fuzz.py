"""Fuzzed request bodies for every endpoint through a real server on loopback (bench/fuzz_server.py's strategies
and checks, a few hundred bodies): only 2xx or OpenAI-shaped 4xx answers, well-formed streams, and after each burst
no sequence, state or resident byte left beyond the baseline."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("hypothesis")
pytest.importorskip("openai")

from moestream.server.app import ServerConfig  # noqa: E402

from test_server import LiveServer, build_model  # noqa: E402

FUZZ = Path(__file__).resolve().parents[1] / "bench" / "fuzz_server.py"


def _fuzz_module():
    spec = importlib.util.spec_from_file_location("fuzz_server", FUZZ)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def short_context_model(tmp_path_factory):
    """A valid body without max_tokens generates to the end of the context: keep it short."""
    path = tmp_path_factory.mktemp("fuzz_model")
    build_model(path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | {"max_position_embeddings": 40}))
    return path


def test_fuzzed_bodies_get_clear_answers_and_leak_nothing(short_context_model):
    fuzz = _fuzz_module()
    s = LiveServer(ServerConfig(str(short_context_model), max_batch=4, max_body="1MiB", prefix_cache="4MiB",
                                threads=1))
    try:
        report = fuzz.fuzz(s.url, s.model, n=200, burst=100, seed=0)
    finally:
        s.close()
    assert report["requests"] >= 150, report  # hypothesis may stop a little early once it runs out of new cases
    assert all(200 <= status < 300 or 400 <= status < 500 for status in report["by_status"]), report
    assert report["outside_error_shape"] == 0, report
    assert report["leaked_bytes_max"] == 0, report
    assert {200, 400, 404, 413} <= set(report["by_status"]), report
