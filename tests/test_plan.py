"""`moestream plan`: predictions from headers (tiny checkpoint, config-only dir, Kimi K3's real config), the JSON
keys, monotonic sanity, errors on bad input, the skew arithmetic and the calibration cache. Nothing is timed:
rates are seeded into the cache (except the one test that measures them, asserting only the cache's reuse)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import smaps_mappings, synth_tiny
from moestream.cli import main
from moestream.memory.state import BLOCK_HOST_BYTES, host_bytes_of
from moestream.planner import calibrate
from moestream.planner.plan import PlanOptions, make_plan
from moestream.planner.skew import Skew, distinct, fit_exponent, hit_rate, selection, top_share
from moestream.weights import pages

K3_CONFIG = Path(__file__).parent / "data" / "kimi_k3_config.json"
_SEEDED_KINDS = (*calibrate.KINDS, calibrate.MXFP4_BF16)
RATES = {"gemv": {k: 8e9 for k in _SEEDED_KINDS}, "expand": {k: 4e9 for k in _SEEDED_KINDS},
         "gemm_flops": 5e10, "memory": 1e10, "page_faults": 2e9, "hot_bytes": 0.0, "deep_faults": 0.0,
         "glu_kernels": {"bf16": 1.6e10},
         # the dense probe's seconds a call for any shape (a 1024 x 1024-sized weight), fp32 and bf16 compute
         "dense_rows": {"bf16": {"fp32": {"1": 2e-4, "16": 1e-3, "64": 3e-3, "256": 1e-2},
                                 "bf16": {"16": 5e-4, "64": 1e-3, "256": 3e-3}}},
         "overhead": {t: {"decode_s": 3e-4, "decode_row_s": 5e-5, "prefill_s": 5e-3, "source": "seeded by the test",
                          "miss_s": 1e-3, "general_s": 5e-4, "lookahead_s": 1e-4}
                      for t in ("qwen3_moe", "kimi_k3", "kimi_linear", "mixtral")}}
# the cache file's --kv-dtype storage work for any model (seeded so that plans with bf16 / int8 / int4 caches do not
# probe)
SEEDED_KV = {d: {"decode_s": 1e-6, "decode_row_s": 1e-9, "batch_s": 1e-6, "batch_row_s": 1e-9, "prefill_token_s": 1e-7}
             for d in ("bf16", "int8", "int4")}
# the cache file's fused GLU many-row times for any shape (seconds an expert, fp32 and bf16 compute): seeded so that
# plans of bf16 experts do not probe them
SEEDED_GLU_ROWS = {"bf16": {"group": {"2": 2e-5, "16": 8e-5, "64": 3e-4},
                            "single": {"2": 3e-5, "16": 9e-5, "64": 3.2e-4},
                            "group_bf16": {"2": 4e-5, "16": 6e-5, "64": 1.5e-4},
                            "single_bf16": {"2": 5e-5, "16": 7e-5, "64": 1.7e-4}}}


MiB = 1 << 20


@pytest.fixture(autouse=True)
def seeded_cache(tmp_path, monkeypatch):
    """A private cache dir holding fixed rates for this machine's key (no probe runs unless a test clears it)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path = calibrate.cache_path()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"machines": {calibrate.machine_key(): {**RATES, "glu_rows": SEEDED_GLU_ROWS,
                                                                        "kv": SEEDED_KV}}}))
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return synth_tiny(tmp_path_factory, "qwen3_moe")


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("k3_plan")
    shutil.copy(K3_CONFIG, d / "config.json")
    return d


def plan_json(*argv: str, capsys) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def budget_of(path: Path, share: float) -> int:
    from moestream.info import model_info

    i = model_info(path)
    return int(i.all_resident_budget + share * i.expert_bytes)


def test_tiny_checkpoint_json_keys(tiny, capsys):
    out = plan_json(str(tiny), "--ram-budget", str(budget_of(tiny, 0.5)), "--batch", "4", "--disk-bandwidth",
                    "1GB", "--price-per-hour", "2", "--skew", "0", "--prompt-len", "16", "--gen-len", "8",
                    capsys=capsys)
    for key in ("decode_tokens_per_s", "prefill_tokens_per_s", "ttft_s", "max_sequences", "batch_tokens_per_s",
                "cost_per_million_tokens", "assumptions", "rates", "model"):
        assert key in out, key
    assert out["decode_tokens_per_s"] > 0 and out["prefill_tokens_per_s"] > 0 and out["ttft_s"] > 0
    assert out["max_sequences"] >= 4 and out["batch_sequences"] == 4
    assert out["cost_per_million_tokens"] == pytest.approx(2 / 3600 / out["decode_tokens_per_s"] * 1e6)
    assert out["rates"]["disk"] == 1e9
    assert any("uniform popularity" in a for a in out["assumptions"])
    assert 0.3 < out["expert_hit_rate"] < 0.7  # half the experts cached, uniform routing


def test_text_output_states_assumptions(tiny, capsys):
    assert main(["plan", str(tiny), "--disk-bandwidth", "2e9", "--ram-budget", str(budget_of(tiny, 0.25))]) == 0
    text = capsys.readouterr().out
    assert "decode:" in text and "ttft" in text and "assumptions:" in text and "Zipf-like" in text


@pytest.mark.parametrize("family", ["kimi_k3", "deepseek_v3"])
def test_config_only_dir(tmp_path_factory, tmp_path, capsys, family):
    """A family with a tensor inventory (K3, DeepSeek-V3 / Kimi K2) plans from config.json alone, as it would from
    its shards."""
    k3 = synth_tiny(tmp_path_factory, family)
    d = tmp_path / "cfg"
    d.mkdir()
    shutil.copy(k3 / "config.json", d / "config.json")
    args = ("--disk-bandwidth", "1GB", "--ram-budget", str(budget_of(k3, 0.5)), "--prompt-len", "16", "--gen-len", "8")
    out = plan_json(str(d), *args, capsys=capsys)
    full = plan_json(str(k3), *args, capsys=capsys)
    assert out["model"]["config_only"] and not full["model"]["config_only"]
    assert out["decode_tokens_per_s"] == pytest.approx(full["decode_tokens_per_s"], rel=0.05)


def test_kimi_k3_real_config_reference_machines(k3_dir, capsys):
    out = plan_json(str(k3_dir), "--ram-budget", "64GB", "--disk-bandwidth", "3GB", "--reference", "--batch", "4",
                    capsys=capsys)
    assert out["model"]["model_type"] == "kimi_k3" and out["model"]["config_only"]
    assert out["model"]["cold_expert_bytes_per_token"] == 16 * 92 * 17_547_264
    assert "MLA latent" in out["model"]["state"] and "KDA state" in out["model"]["state"]
    refs = {r["machine"].split(":")[0]: r for r in out["reference_machines"]}
    assert set(refs) == {"desktop-64g", "server-512g"}
    assert refs["server-512g"]["decode_tokens_per_s"] > refs["desktop-64g"]["decode_tokens_per_s"]
    assert refs["server-512g"]["max_sequences"] > 0


def test_a_streamed_heads_slabs_at_the_stream_bandwidth(k3_dir, capsys):
    """Streamed dense weights (here the lm_head's slabs) are priced at --stream-bandwidth (probed by default:
    bench.probe_stream); with --disk-bandwidth alone, at the disk's rate."""
    args = ("--ram-budget", "64GB", "--disk-bandwidth", "3GB", "--prompt-len", "16", "--gen-len", "8")
    disk_only = plan_json(str(k3_dir), *args, capsys=capsys)
    same = plan_json(str(k3_dir), *args, "--stream-bandwidth", "3GB", capsys=capsys)
    slow = plan_json(str(k3_dir), *args, "--stream-bandwidth", "0.1GB", capsys=capsys)
    assert same["decode_tokens_per_s"] == pytest.approx(disk_only["decode_tokens_per_s"], rel=1e-9)
    assert slow["rates"]["disk_stream"] == 0.1e9 and disk_only["rates"]["disk_stream"] == 0.0
    assert slow["decode_tokens_per_s"] < 0.9 * disk_only["decode_tokens_per_s"]
    assert any("streamed dense layers and lm_head slabs at 0.1 GB/s" in a for a in slow["assumptions"])


def test_monotonic(tiny):
    def decode(budget_share: float, disk: float, batch: int | None = None) -> dict:
        opts = PlanOptions(budget_of(tiny, budget_share), batch, 8, 4, disk, skew=Skew(0.0, "test"))
        return make_plan(tiny, opts)

    small, big = decode(0.1, 1e8), decode(0.9, 1e8)
    assert big["decode_tokens_per_s"] >= small["decode_tokens_per_s"]
    assert big["ttft_s"] <= small["ttft_s"]
    fast = decode(0.1, 1e10)
    assert fast["decode_tokens_per_s"] >= small["decode_tokens_per_s"]
    assert decode(0.5, 1e8, batch=2)["batch_sequences"] == 2


def test_batch_shares_reads_when_io_bound(tiny):
    """At the same cache, N rows of one step read the union of their experts once: tokens/s >= one stream's."""
    from moestream.planner.facts import model_facts, open_plan
    from moestream.planner.predict import Scenario

    p = open_plan(tiny)
    try:
        facts = model_facts(tiny, p)
        fit = facts.fit(p, budget_of(tiny, 0.25))
        rates = calibrate.Rates.from_json({**RATES, "disk": 1e6})  # a slow disk: I/O-bound
        for skew in (0.0, 1.0):
            sc = Scenario(facts, fit, rates, Skew(skew, "test"))
            one, four = sc.decode(1, 32), sc.decode(4, 32)
            assert one.io_s > one.compute_s
            assert 4 / four.seconds >= 1 / one.seconds
            assert four.expert_reads < 4 * one.expert_reads
    finally:
        p.store.close()


@pytest.mark.parametrize("argv, message", [
    (["--disk-bandwidth", "fast"], "--disk-bandwidth must be auto or bytes per second"),
    (["--disk-bandwidth", "0"], "--disk-bandwidth must be"),
    (["--stream-bandwidth", "fast"], "--stream-bandwidth must be auto or bytes per second"),
    (["--stream-bandwidth", "0"], "--stream-bandwidth must be"),
    (["--ram-budget", "1KB"], "too small"),
    (["--batch", "0"], "--batch must be at least 1"),
    (["--skew", "-1"], "--skew must be"),
    (["--reuse", "2"], "--reuse must be a probability"),
])
def test_bad_options(tiny, capsys, argv, message):
    assert main(["plan", str(tiny), *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_budget_too_small_fails_before_the_calibration(tiny, capsys, monkeypatch):
    """A user's typo in --ram-budget is an error at once, not after the calibration's probes (seconds to a minute
    on a machine without a saved calibration, and `--skew-from model`'s trace)."""
    from moestream.planner import plan as planmod

    def no_probes(*a, **k):
        raise AssertionError("calibrated before checking the budget")

    monkeypatch.setattr(planmod, "Calibrator", no_probes)
    monkeypatch.setattr(planmod, "measured_skew", no_probes)
    assert main(["plan", str(tiny), "--ram-budget", "1KB", "--skew-from", "model"]) == 2
    assert "too small" in capsys.readouterr().err


def test_bad_model_dirs(tmp_path, capsys):
    assert main(["plan", str(tmp_path / "missing")]) == 2
    assert "no such model directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["plan", str(tmp_path / "empty"), "--disk-bandwidth", "1GB"]) == 2
    assert "config.json" in capsys.readouterr().err
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text(json.dumps({"model_type": "no_such_family"}))
    assert main(["plan", str(tmp_path / "odd"), "--disk-bandwidth", "1GB"]) == 2
    assert "no_such_family" in capsys.readouterr().err


def test_skew_arithmetic():
    q = selection(64, 8, 0.0)
    assert sum(q) == pytest.approx(8) and max(q) == pytest.approx(8 / 64)
    assert hit_rate(64, 8, 0.0, 16) == pytest.approx(0.25)
    skewed = selection(64, 8, 1.5)
    assert sum(skewed) == pytest.approx(8) and max(skewed) <= 1.0 + 1e-12
    assert hit_rate(64, 8, 1.0, 16) > hit_rate(64, 8, 0.0, 16)
    used, outside = distinct(64, 8, 0.0, 1, 16)
    assert used == pytest.approx(8) and outside == pytest.approx(6)
    assert distinct(64, 8, 0.0, 1000)[0] == pytest.approx(64)
    s = fit_exponent(0.19, 64, 4)
    assert top_share(64, 4, s) == pytest.approx(0.19, abs=1e-3)
    assert fit_exponent(0.05, 64, 4) == 0.0
    # reuse of the last token's experts beyond chance (8/64) adds hits once the cache can hold them
    assert hit_rate(64, 8, 0.0, 16, reuse=0.125) == pytest.approx(0.25)
    assert hit_rate(64, 8, 0.0, 16, reuse=0.5) == pytest.approx(1 - 0.75 * (1 - 0.375 / 0.875))
    assert distinct(64, 8, 0.0, 1, 16, reuse=0.5)[1] == pytest.approx(8 * (1 - hit_rate(64, 8, 0.0, 16, 0.5)))


def test_calibration_is_cached(seeded_cache, tiny):
    seeded_cache.unlink()  # measure for real (briefly), then reuse
    first = calibrate.Calibrator(seconds=0.05)
    rates = first.rates({"bf16"}, "qwen3_moe")
    assert first.measured and rates.gemv["bf16"] > 0 and rates.overhead["qwen3_moe"].decode_s > 0
    assert rates.page_faults > 0 and rates.overhead["qwen3_moe"].miss_s >= 0  # the miss probe ran
    assert "deep_faults" in rates.source  # the fresh-memory probe ran (briefly: no slowdown need show)
    assert rates.overhead["qwen3_moe"].general_s >= 0 and rates.overhead["qwen3_moe"].lookahead_s > 0
    assert "off the warm path" in rates.overhead["qwen3_moe"].source
    again = calibrate.Calibrator(seconds=0.05)
    assert again.rates({"bf16"}, "qwen3_moe").to_json() == rates.to_json() and not again.measured
    bw, _ = again.disk([f for f in tiny.iterdir() if f.suffix == ".safetensors"], tiny)
    assert bw > 0 and again.measured
    cached = calibrate.Calibrator(seconds=0.05)
    assert cached.disk([], tiny)[0] == bw and not cached.measured
    scratch = tiny.parent / "probe-here"  # a config-only or remote model: a scratch file where shards would go
    assert calibrate.disk_rate_at(scratch, 0.05, 16 << 20) > 0 and not list(scratch.iterdir())
    fresh = calibrate.Calibrator(fresh=True, seconds=0.05)
    fresh.rates({"bf16"}, "qwen3_moe")
    assert fresh.measured
    shaped = calibrate.Calibrator(seconds=0.05, rounds=2)  # another matrix shape: its own probe, in rounds
    r = shaped.rates({"bf16"}, "qwen3_moe", shapes={"bf16": (96, 64)})
    assert shaped.measured and "bf16 96x64" in r.source["shapes"]
    assert "median of 2 rounds" in r.source["gemv bf16"]


def test_calibration_rounds_keep_the_median_and_the_spread():
    values = iter([(1.0, 10.0), (5.0, 30.0), (3.0, 20.0)])
    (first, second), spread = calibrate.rounds(lambda: next(values), 3)
    assert (first, second) == (3.0, 20.0) and spread == "median of 3 rounds (spread 1-5)"


def test_remote_checkpoint_headers_only(tiny, tmp_path, monkeypatch, capsys):
    """hf://: plan from the stub (config, index, shard headers) a real loopback hub serves; no tensor data."""
    from hfserver import CheckpointServer
    from moestream.weights import remote

    with CheckpointServer({"org/tiny": tiny}) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        for k, v in vars(remote.RemoteSettings()).items():
            monkeypatch.setattr(remote.SETTINGS, k, v)
        args = ("--disk-bandwidth", "1GB", "--ram-budget", str(budget_of(tiny, 0.5)), "--prompt-len", "16",
                "--gen-len", "8", "--skew", "0")
        out = plan_json("hf://org/tiny", *args, capsys=capsys)
        served = server.bytes_served()
    local = plan_json(str(tiny), *args, capsys=capsys)
    assert out["decode_tokens_per_s"] == pytest.approx(local["decode_tokens_per_s"])
    shards = sum(f.stat().st_size for f in tiny.glob("*.safetensors"))
    assert served < shards / 4  # headers and JSON, not the weights


@pytest.mark.parametrize("family", ["qwen3_moe", "kimi_linear"])
def test_kv_dtype_state_matches_engine(tmp_path_factory, family):
    """The planner's state per sequence is what the scheduler reserves for a served sequence at that context (its
    bookkeeping included; the engine books no more), for each --kv-dtype: bf16 halves the KV / latent rows, the
    recurrent state stays fp32."""
    from moestream import Engine
    from moestream.planner.facts import model_facts, open_plan
    from moestream.server.prefix import StateProfile

    path = synth_tiny(tmp_path_factory, family)
    shapes = {}
    for dtype in ("fp32", "bf16", "int8", "int4"):
        p = open_plan(path)
        try:
            shapes[dtype] = model_facts(path, p, dtype).state
        finally:
            p.store.close()
        eng = Engine.open(path, kv_dtype=dtype)
        try:
            s = eng.new_sequence()
            s.account_host()  # as the scheduler books each sequence it runs
            eng.step([(s, list(range(3, 19)))])  # a 16-token prompt in one chunk
            for i in range(8):
                eng.step([(s, [5 + i])])
            # what the scheduler reserves for it (whole blocks; the books follow the pages the rows take, no more)
            prof = StateProfile()
            prof.learn(s)
            assert prof.reserve(16, 24, 256) == shapes[dtype].at(16, 24, 256), dtype
            assert eng.memory.state_bytes <= shapes[dtype].at(16, 24, 256), dtype
        finally:
            eng.close()
    assert shapes["bf16"].bytes_per_token * 2 == shapes["fp32"].bytes_per_token > 0
    assert shapes["bf16"].fixed_bytes == shapes["fp32"].fixed_bytes == shapes["int8"].fixed_bytes
    assert shapes["bf16"].bytes_per_token / 2 < shapes["int8"].bytes_per_token < shapes["bf16"].bytes_per_token
    assert shapes["int8"].bytes_per_token / 2 < shapes["int4"].bytes_per_token < shapes["int8"].bytes_per_token
    assert shapes["int4"].fixed_bytes == shapes["fp32"].fixed_bytes


def test_kv_dtype_option(tiny, k3_dir, capsys):
    args = ("--ram-budget", str(budget_of(tiny, 0.5)), "--disk-bandwidth", "1GB", "--prompt-len", "200",
            "--gen-len", "56")
    f32, b16 = (plan_json(str(tiny), *args, "--kv-dtype", d, capsys=capsys) for d in ("fp32", "bf16"))
    host = host_bytes_of(json.loads((tiny / "config.json").read_text())["num_hidden_layers"])
    # GQA only: all of the state halves but the bookkeeping booked for each sequence and each block (the same
    # blocks in both dtypes)
    left = (b16["state_bytes_per_sequence"] - host) * 2 - (f32["state_bytes_per_sequence"] - host)
    assert left > 0 and left % BLOCK_HOST_BYTES == 0
    assert b16["max_sequences"] > 1.5 * f32["max_sequences"] > 0
    i8 = plan_json(str(tiny), *args, "--kv-dtype", "int8", capsys=capsys)
    assert i8["max_sequences"] > b16["max_sequences"] and "int8 KV" in i8["model"]["state"]
    i4 = plan_json(str(tiny), *args, "--kv-dtype", "int4", capsys=capsys)
    assert i4["state_bytes_per_sequence"] < i8["state_bytes_per_sequence"] and "int4 KV" in i4["model"]["state"]
    assert i4["max_sequences"] >= i8["max_sequences"]
    assert "bf16 KV" in b16["model"]["state"]
    k3 = [plan_json(str(k3_dir), "--ram-budget", "64GB", "--disk-bandwidth", "3GB", "--kv-dtype", d, capsys=capsys)
          for d in ("fp32", "bf16")]
    assert k3[0]["state_bytes_per_sequence"] > k3[1]["state_bytes_per_sequence"] > k3[0]["state_bytes_per_sequence"] / 2
    with pytest.raises(SystemExit) as exc:  # argparse's choices: exit status 2, naming the valid ones
        main(["plan", str(tiny), "--kv-dtype", "fp16"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--kv-dtype" in err and "bf16" in err


def _scenario(path, share: float, rates: dict, model_type: str | None = None):
    from moestream.planner.facts import model_facts, open_plan
    from moestream.planner.predict import Scenario

    p = open_plan(path)
    try:
        facts = model_facts(path, p)
        if model_type:
            facts.model_type = model_type
        return Scenario(facts, facts.fit(p, budget_of(path, share)), calibrate.Rates.from_json(rates),
                        Skew(0.3, "test", 0.1))
    finally:
        p.store.close()


def test_miss_cost_grows_with_misses_and_is_per_family(tiny):
    """Each expert read on a miss of a one-row decode step costs the family's per-miss work plus the one-expert
    kernel's multiply beyond the fused call's, and its layer step leaves the warm path; none once everything is
    cached, and more as the budget shrinks. A multi-row step is not charged."""
    fast_disk = {**RATES, "disk": 1e12, "page_faults": 1e15}
    steps = [_scenario(tiny, share, fast_disk).decode(1, 32) for share in (0.1, 0.3, 0.6, 1.0)]
    costs = [s.parts["misses_s"] for s in steps]
    assert costs == sorted(costs, reverse=True) and costs[0] > 0 and costs[-1] == 0
    sc = _scenario(tiny, 0.1, fast_disk)
    o = RATES["overhead"]["qwen3_moe"]
    f = sc.facts
    fused = f.expert_bytes / sc.expert_rate()  # the fused call where measured, else the one-row kernel
    assert sc.miss_cost() == pytest.approx(o["miss_s"] + f.expert_bytes / RATES["gemv"]["bf16"] - fused)
    one = sc.decode(1, 32)
    # every layer step misses here: each leaves the warm path (beyond the lookahead router, counted apart)
    general = (o["general_s"] - o["lookahead_s"]) * f.moe_layers * (1 - (1 - one.expert_reads / f.moe_layers
                                                                          / f.top_k) ** f.top_k)
    assert one.parts["misses_s"] == pytest.approx(one.expert_reads * sc.miss_cost() + general, rel=1e-6)
    # family-aware: the planned family's own per-miss cost (seeded 10x for kimi_k3 here)
    k3_rates = {**fast_disk, "overhead": {**RATES["overhead"], "kimi_k3": {**o, "miss_s": 10 * o["miss_s"]}}}
    k3 = _scenario(tiny, 0.1, k3_rates, model_type="kimi_k3")
    assert k3.miss_cost() - sc.miss_cost() == pytest.approx(9 * o["miss_s"])
    # a multi-row step (a batch) lands its reads while other experts compute: not charged the one-row per-miss
    # cost; its length is its layer-by-layer timeline
    for rows in (2, 64):
        many = sc.decode(rows, 32)
        assert many.expert_reads > 0 and many.parts["misses_s"] == 0 and many.timeline_s is not None


def test_layer_step_waits_for_its_own_reads(tiny):
    """A one-row step's layer steps wait for their reads beyond what they compute meanwhile: one miss in a layer
    step hides behind its hits only, several behind each other's work; so the same mean number of misses waits
    longer spread thin (one per layer step) than bunched, and the wait is the reads' page faults + bytes at the
    disk rate + the last expert's work, less the layer step's work."""
    sc = _scenario(tiny, 0.3, {**RATES, "disk": 1e6})  # a slow disk for the tiny experts: reads take ms
    f, r = sc.facts, sc.rates
    o = r.overhead_for(f.model_type, f.top_k)
    read, pages = f.expert_bytes / r.disk, f.expert_bytes / r.page_faults
    hit = f.expert_bytes / sc.expert_rate()
    for m in (1, 2, f.top_k):
        cpu, wait = sc.layer_waits({m: 1.0}, partial=True)
        work = o.general_s + f.top_k * hit + m * sc.miss_cost()
        assert wait == pytest.approx(f.moe_layers * max(0.0, pages + m * read + sc.miss_cost() + hit - work))
        assert cpu == pytest.approx(f.moe_layers * (o.general_s - o.lookahead_s + m * sc.miss_cost()))
    thin = sc.layer_waits({0: 0.5, 1: 0.5}, partial=True)[1]
    bunched = sc.layer_waits({0: 0.75, 2: 0.25}, partial=True)[1]
    assert thin > bunched > 0
    # no misses: no wait, no extra work; the step is its compute (and no reads)
    assert sc.layer_waits({0: 1.0}, partial=True) == (0.0, 0.0)
    full = _scenario(tiny, 1.0, {**RATES, "disk": 1e9}).decode(1, 32)
    assert full.expert_reads == 0 and full.wait_s == 0 and full.seconds == pytest.approx(
        full.overhead_s + full.compute_s)


def test_page_faults_only_for_reads_into_free_room(tiny):
    """A read that evicts reuses the evicted expert's buffer (no page faults); one into free room faults a fresh
    buffer in first: the wait counts the first buffer's faults by the share of misses that fill free room, which
    the replay counts (everything fits: all of them; a cache smaller than the prompt's experts: none)."""
    from moestream.planner.skew import replay_decode

    sc = _scenario(tiny, 0.3, {**RATES, "disk": 1e6})
    f, r = sc.facts, sc.rates
    pages = f.expert_bytes / r.page_faults
    full, none = sc.layer_waits({2: 1.0}, True, fill=1.0)[1], sc.layer_waits({2: 1.0}, True, fill=0.0)[1]
    assert full - none == pytest.approx(f.moe_layers * pages)
    tokens = [[[t % 6, (t + 1) % 6]] for t in range(16)]
    fills: list[float] = []
    replay_decode([tokens], 100, 4, 4, fills=fills)  # everything fits: each miss fills free room
    assert fills == [1.0]
    fills.clear()
    replay_decode([tokens], 2, 4, 4, fills=fills)  # two experts' room: full after the prompt, each miss evicts
    assert fills == [0.0]


def test_deep_memory_from_the_probes_chunks():
    """The fresh-memory probe's answer from its chunks' rates: where they fall under half the first chunks' rate,
    all it took (the next process's hot memory) and the median rate from there; a one-chunk dip leaves that median
    near the hot rate; no slowdown: nothing."""
    chunk = 64 << 20
    hot, deep, seen = calibrate.deep_summary([2.7e9] * 40 + [0.4e9] * 8, chunk)
    assert hot == 48 * chunk and deep == pytest.approx(0.4e9) and "2.5 GiB at 2.7 GB/s" in seen
    assert calibrate.deep_summary([2.7e9] * 10, chunk)[:2] == (0.0, 0.0)
    assert calibrate.deep_summary([2.7e9] * 10 + [0.4e9] + [2.6e9] * 7, chunk)[1] == pytest.approx(2.6e9)
    assert calibrate.deep_split([1, 1, 1, 1, 0.6, 0.4]) == 5 and calibrate.deep_split([1, 1, 1]) is None
    hot, deep, _ = calibrate.deep_fault_rates(limit=4 * chunk, seconds=5)  # a real probe, too small to slow
    assert (hot, deep) == (0.0, 0.0)


def test_reads_into_free_room_beyond_hot_memory_fault_at_the_deep_rate(tiny):
    """A read into free room faults its buffer at the fresh-page rate while the process holds less than the
    machine's hot memory, at the deep-memory rate from twice that, linear between; a cold decode that fills the
    cache pays it once the budget's memory is past the hot bytes."""
    rates = {**RATES, "disk": 1e6, "deep_faults": 1e8}
    shallow, deep = (_scenario(tiny, 1.0, {**rates, "hot_bytes": h}) for h in (1e15, 1.0))
    f = shallow.facts
    per = [shallow.fault_seconds_per_byte(t) for t in (5e14, 1e15, 1.5e15, 2e15, 4e15)]
    assert per[0] == per[1] == pytest.approx(1 / 2e9) and per[3] == per[4] == pytest.approx(1 / 1e8)
    assert per[2] == pytest.approx((1 / 2e9 + 1 / 1e8) / 2)
    near = shallow.layer_waits({1: 1.0}, True, fill=1.0, taken=1e14)[1]
    far = shallow.layer_waits({1: 1.0}, True, fill=1.0, taken=2e15)[1]
    assert far - near == pytest.approx(f.moe_layers * f.expert_bytes * (1 / 1e8 - 1 / 2e9))
    assert shallow.layer_waits({1: 1.0}, True, fill=0.0, taken=2e15)[1] < near  # a read that evicts: no faults
    cold = [s.decode(1, 32, since_open=(16, 8)) for s in (shallow, deep)]
    assert cold[1].wait_s > cold[0].wait_s and cold[1].seconds > cold[0].seconds
    assert _scenario(tiny, 1.0, {**rates, "deep_faults": 0.0, "hot_bytes": 0.0}).decode(
        1, 32, since_open=(16, 8)).seconds == pytest.approx(cold[0].seconds)  # not measured: the fresh-page rate


def test_dense_weights_on_huge_pages_leave_the_hot_memory_to_read_buffers(tiny):
    """With the engine's resident dense weights on huge pages (which take the deep memory themselves), a read into
    free room faults against the fresh memory held less those pages: each matrix's whole 2 MiB stretches, their
    share of the dense matrices' bytes applied to the resident dense bytes; a cold decode then waits less."""
    rates = {**RATES, "disk": 1e6, "deep_faults": 1e8}
    plain, huge = (_scenario(tiny, 1.0, {**rates, "hot_bytes": 1.0}) for _ in range(2))
    huge.huge_pages = True
    for sc in (plain, huge):  # two 3 MiB matrices (one whole 2 MiB stretch each) and a head of 1 MiB (none)
        sc.facts.dense_shapes, sc.facts.head_shape, sc.facts.head_kind = {("bf16", 1536, 1024): 2}, (512, 1024), "bf16"
    resident = huge.residency.resident_dense_bytes
    assert plain.huge_dense_bytes() == 0.0 and resident > 0
    assert huge.huge_dense_bytes() == pytest.approx(resident * (2 * 2 * MiB) / (2 * 3 * MiB + MiB))
    taken = {}
    for name, sc in (("plain", plain), ("huge", huge)):  # the fresh memory each decode faults its reads against
        waits = sc.layer_waits
        sc.layer_waits = lambda *a, _w=waits, _n=name, **k: (taken.__setitem__(_n, a[3]), _w(*a, **k))[1]
        sc.decode(1, 32, since_open=(16, 8))
        sc.layer_waits = waits
    assert taken["huge"] == pytest.approx(taken["plain"] - huge.huge_dense_bytes())
    huge.rates.hot_bytes = plain.rates.hot_bytes = taken["plain"] / 2  # past twice the hot memory without them
    cold = [s.decode(1, 32, since_open=(16, 8)) for s in (plain, huge)]
    assert cold[1].wait_s < cold[0].wait_s and cold[1].seconds < cold[0].seconds


def test_one_row_step_is_its_reads_or_its_layers(tiny):
    """A one-row step lasts the longer of all its reads (experts and streamed dense bytes share the disk) and its
    compute plus the layer steps' waits; a slower disk only lengthens it."""
    steps = [_scenario(tiny, 0.2, {**RATES, "disk": d}).decode(1, 32) for d in (1e6, 1e7, 1e8)]  # tiny experts
    for s in steps:
        assert s.seconds == pytest.approx(s.overhead_s + max(s.io_s, s.compute_s + s.wait_s))
        assert s.seconds >= s.overhead_s + s.io_s  # never shorter than its reads
    assert steps[0].seconds > steps[1].seconds >= steps[2].seconds


def _advised_huge(address: int) -> bool:
    """Whether the mapping holding `address` is advised onto transparent huge pages (VmFlags "hg" in smaps)."""
    return any(m["start"] <= address < m["end"] and "hg" in m.get("flags", []) for m in smaps_mappings())


@pytest.mark.skipif(not pages.enabled(), reason="no transparent huge pages here")
def test_dense_probes_stream_weights_from_where_the_engine_keeps_them():
    """The dense probes' copies sit in weights.pages.weight_bytes memory (huge pages, as the engine's resident dense
    weights); the expert probes' in plain memory (as a read expert's buffer)."""
    dense, _, _, _ = calibrate._weights("bf16", 2048, 1024, 8 << 20, resident=True)
    plain, _, _, _ = calibrate._weights("bf16", 2048, 1024, 8 << 20)
    assert len(dense) == len(plain) == 2 and all(torch.equal(w, dense[0]) for w in dense + plain)
    assert all(_advised_huge(w.data_ptr()) for w in dense)
    assert not any(_advised_huge(w.data_ptr()) for w in plain)
    fp8, _, _, _ = calibrate._weights("fp8", 2048, 1024, 8 << 20, resident=True)  # codes and their scales
    assert all(_advised_huge(codes.data_ptr()) for codes, _ in fp8)


def test_binomial_spread_and_replayed_spread():
    """Without a recorded routing a layer's misses spread binomially around the mean; the replay reports the
    share of layer steps with each number of misses, whose mean is its misses per layer step."""
    from moestream.planner.skew import binomial_spread, replay_decode

    b = binomial_spread(8, 2.0)
    assert sum(b.values()) == pytest.approx(1.0) and sum(m * p for m, p in b.items()) == pytest.approx(2.0)
    assert binomial_spread(4, 0.0) == {0: 1.0, 1: 0.0, 2: 0.0, 3: 0.0, 4: 0.0}
    tokens = [[[t % 6, (t + 1) % 6], [(t * 5) % 7, (t * 5 + 2) % 7]] for t in range(24)]
    spread: dict[int, float] = {}
    per_token, _, _ = replay_decode([tokens], 5, 4, 4, spread=spread)
    assert sum(spread.values()) == pytest.approx(1.0) and set(spread) <= {0, 1, 2}
    assert sum(m * p for m, p in spread.items()) * 2 == pytest.approx(per_token)  # two layers a token


def test_plan_states_the_miss_cost(tiny, capsys):
    out = plan_json(str(tiny), "--ram-budget", str(budget_of(tiny, 0.2)), "--disk-bandwidth", "1e9",
                    capsys=capsys)
    assert any("each expert read on a miss" in line for line in out["assumptions"])
    assert out["decode_step"]["compute_parts"]["misses_s"] > 0


def test_overhead_probe_widths_of_mla_families():
    """An MLA family's probe takes qk_nope_head_dim as its head width (K3's config has no head_dim; Kimi Linear's
    head_dim is the rope width); a GQA family keeps its head_dim."""
    k3 = json.loads(K3_CONFIG.read_text())
    assert calibrate.model_widths(k3) == {"hidden": 7168, "heads": 96, "kv_heads": 96, "head_dim": 128}
    linear = {"hidden_size": 64, "num_attention_heads": 4, "head_dim": 8, "qk_nope_head_dim": 16}
    assert calibrate.model_widths({"text_config": linear})["head_dim"] == 16
    gqa = {"hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64}
    assert calibrate.model_widths(gqa) == {"hidden": 1024, "heads": 16, "kv_heads": 4, "head_dim": 64}


def test_overhead_probe_stays_small_at_full_width(tmp_path, monkeypatch):
    """At Kimi K3's published widths the probe checkpoint would take GBs (MLA / KDA projections): it keeps the
    heads' widths at the tiny hidden size instead, and says so; a small model is probed at its own widths."""
    from dataclasses import replace

    from moestream.synth.families import preset

    widths = calibrate.model_widths(json.loads(K3_CONFIG.read_text()))
    full = replace(preset("tiny"), name="plan-overhead", top_k=8, experts=64, moe_intermediate=32, **widths)
    assert calibrate.probe_bytes("kimi_k3", full) > calibrate.PROBE_MAX_BYTES
    written = []
    monkeypatch.setattr("moestream.synth.writer.write_checkpoint",
                        lambda fam, shape, out, *a: written.append(shape))
    what = calibrate._tiny("kimi_k3", tmp_path / "m", 8, 896, widths)
    assert written[-1].hidden == preset("tiny").hidden and written[-1].head_dim == 128 and written[-1].heads == 96
    assert "hidden" not in what and "head_dim 128" in what
    small = {"hidden": 128, "heads": 4, "kv_heads": 4, "head_dim": 32}
    what = calibrate._tiny("kimi_k3", tmp_path / "s", 4, 16, small)
    assert written[-1].hidden == 128 and "hidden 128" in what


def test_plan_accuracy_records_other_load_and_spin(monkeypatch):
    """bench/plan_accuracy.py: the machine's busy CPU seconds and its children's CPU seconds (the other processes'
    load during a bench is their difference over the wall time), and --spin-us reaching every measuring run's
    environment."""
    import importlib.util
    import subprocess

    spec = importlib.util.spec_from_file_location("plan_accuracy", Path(__file__).parents[1] / "bench" /
                                                  "plan_accuracy.py")
    acc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(acc)
    busy, children = acc.cpu_busy()
    assert busy > 0 and children >= 0
    seen = {}

    class Done:
        returncode, stdout, stderr = 0, "{}", ""

    def fake_run(cmd, capture_output, text, env):
        seen.update(env)
        return Done()

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setitem(acc.SPIN_ENV, "MOESTREAM_NATIVE_SPIN_US", "3000")
    assert acc._run(["true"], Path("cal.json")) == {}
    assert seen["MOESTREAM_NATIVE_SPIN_US"] == "3000" and seen["MOESTREAM_PLAN_CALIBRATION"] == "cal.json"
    calls = []
    monkeypatch.setattr(acc, "plan", lambda run, disk, calibrate=False, batch=None: calls.append(calibrate) or {})
    out: dict = {}
    acc.calibrate(out, {"model": "/m/q3m"})  # the calibration's own other load is kept per model
    assert calls == [True] and out["calibration_other_cpu_load"]["q3m"] >= 0


def test_measured_popularity_and_first_use():
    """A measured popularity (most popular first) replaces the Zipf law; a cold start's first-use misses vanish
    once every cached expert has been used and are the cached experts' selection share when nothing has been."""
    from moestream.planner.skew import first_use

    w = tuple([8.0, 4.0, 2.0, 1.0] + [0.5] * 12)
    q = selection(16, 2, w)
    assert sum(q) == pytest.approx(2) and list(q) == sorted(q, reverse=True)
    assert selection(16, 2, tuple(reversed(w))) == q  # sorted, whatever the order given
    assert hit_rate(16, 2, w, 4) > hit_rate(16, 2, 0.0, 4)
    with pytest.raises(ValueError):
        selection(8, 2, w)
    assert Skew(0.5, "t", 0.1, w).law(16) == w and Skew(0.5, "t", 0.1, w).law(32) == 0.5
    assert first_use(16, 2, w, 16, 0) == pytest.approx(2.0)  # nothing seen: every routed expert is new
    assert first_use(16, 2, w, 16, 10_000) == pytest.approx(0.0, abs=1e-9)
    assert first_use(16, 2, w, 4, 8) < first_use(16, 2, w, 16, 8)  # only the cached set counts
    assert first_use(16, 2, w, 16, 8) < first_use(16, 2, w, 16, 2)


def test_skew_from_routing_and_trace_files(tmp_path):
    """`moestream trace --save` lines, `trace --json` reports and routing_report's own report give one Skew."""
    from moestream.planner.skew import from_report, from_trace_file, routing_report

    # 2 layers, 8 experts, top-2: expert 0 in every token, 1 in most; consecutive tokens reuse expert 0
    prompt = [[[0, 1 if t % 4 else 2 + t % 6], [0, 3]] for t in range(40)]
    rep = routing_report([prompt], 8, 2)
    assert rep["tokens"] == 40 and len(rep["usage"]) == 2 and len(rep["usage"][0]["shares"]) == 8
    assert rep["usage"][1]["shares"][:2] == [0.5, 0.5] and rep["reuse"][1] == pytest.approx(1.0)
    sk = from_report(rep, "test")
    assert sk.weights is not None and len(sk.weights) == 8 and sk.weights[0] > sk.weights[-1] > 0
    assert sum(sk.weights) == pytest.approx(1.0) and 0.5 < sk.reuse <= 1.0 and sk.exponent > 0.5
    lines = tmp_path / "trace.jsonl"  # `moestream trace --save`'s format
    lines.write_text("\n".join([json.dumps({"layers": [1, 2], "num_experts": 8, "top_k": 2})] +
                               [json.dumps({"prompt": 0, "pos": t, "token": 5, "experts": row})
                                for t, row in enumerate(prompt)]) + "\n")
    got = from_trace_file(lines)
    assert got.weights == pytest.approx(sk.weights) and got.reuse == sk.reuse and "40 tokens" in got.source
    report = tmp_path / "report.json"  # `moestream trace --json` without shares: the Zipf fit alone
    report.write_text(json.dumps({"tokens": 40, "num_experts": 8, "top_k": 2, "reuse": [0.5, 1.0],
                                  "usage": [{"top10_share": 0.5}, {"top10_share": 0.5}]}))
    z = from_trace_file(report)
    assert z.weights is None and z.reuse == 0.75 and z.exponent > 0
    bad = tmp_path / "bad.json"
    bad.write_text("{}\n")
    with pytest.raises(ValueError):
        from_trace_file(bad)


def test_plan_skew_from(tiny, tmp_path, capsys):
    """--skew-from model traces the local router (and --save-skew keeps it); --skew-from FILE reads it back to the
    same prediction; the assumption says where the routing came from. A cold start's first-use misses make the
    one-stream decode no faster than the steady state."""
    saved = tmp_path / "skew.json"
    args = ("--ram-budget", str(budget_of(tiny, 1.0)), "--disk-bandwidth", "1GB", "--prompt-len", "16",
            "--gen-len", "8")
    live = plan_json(str(tiny), *args, "--skew-from", "model", "--skew-tokens", "64", "--save-skew", str(saved),
                     capsys=capsys)
    assert "measured popularity" in live["assumptions"][0] and "own router" in live["assumptions"][0]
    # independent prompts (a batch's sequences do not share one sequence's skew), each a replay window of its own
    routing = json.loads(saved.read_text())["routing"]
    assert len(routing) == 8 and all(len(p) == 8 for p in routing) and "8 prompts of 8" in live["assumptions"][0]
    again = plan_json(str(tiny), *args, "--skew-from", str(saved), capsys=capsys)
    assert again["decode_tokens_per_s"] == pytest.approx(live["decode_tokens_per_s"])
    assert live["decode_steady_tokens_per_s"] >= live["decode_tokens_per_s"]
    assert live["decode_step"]["experts_read"] > 0  # everything fits, yet the first uses miss
    reuse = plan_json(str(tiny), *args, "--skew-from", str(saved), "--reuse", "0.9", capsys=capsys)
    assert "reuse 0.9" in reuse["assumptions"][0]
    for bad, msg in ((["--skew", "0.5"], "not both"), (["--save-skew", str(saved)], "--save-skew")):
        extra = ["--skew-from", str(saved)] + bad if bad[0] == "--skew" else bad
        assert main(["plan", str(tiny), *args, *extra]) != 0
        assert msg in capsys.readouterr().err
    assert main(["plan", str(tiny), *args, "--skew-from", str(tmp_path / "missing.json")]) != 0
    assert "--skew-from" in capsys.readouterr().err


def test_glu_rate_probe():
    """The fused GLU probe: a positive byte rate; Rates keeps it through JSON."""
    from moestream.kernels import cpu

    if not cpu.available():
        pytest.skip("no native kernels")
    assert calibrate.glu_rate((32, 64), 4, 0.05) > 0
    r = calibrate.Rates.from_json({**RATES, "glu": 1.5e10})
    assert r.glu == 1.5e10 and calibrate.Rates.from_json(r.to_json()).glu == 1.5e10


def _fake_caches(root: Path, caches: list[tuple[int, str, str]]) -> Path:
    """A sysfs cpu0/cache directory listing (level, type, size) per index."""
    for i, (level, kind, size) in enumerate(caches):
        d = root / f"index{i}"
        d.mkdir(parents=True)
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    return root


def test_kernel_probes_stream_past_the_last_level_cache(tmp_path, monkeypatch):
    """The one-row kernel probes (the fused GLU call, each format's linear) cycle through distinct buffers of at
    least STREAM_LLC_MULTIPLE x the last-level cache sysfs states (and at least STREAM_MIN_BYTES), as a decode token
    streams its weights from DRAM; a probe that fits in the cache times the cache, not the token."""
    from moestream.kernels import cpu, fused
    from moestream.models import blocks

    root = _fake_caches(tmp_path / "cache", [(1, "Data", "48K"), (1, "Instruction", "32K"), (2, "Unified", "1024K"),
                                             (3, "Unified", "2M"), (4, "Instruction", "64M")])
    assert calibrate.llc_bytes(root) == 2 << 20  # the highest data / unified level, not an instruction cache
    assert calibrate.llc_bytes(tmp_path / "none") == 0
    assert calibrate._cache_size("32768K") == 32 << 20 and calibrate._cache_size("512") == 512
    monkeypatch.setattr(calibrate, "CACHE_SYSFS", root)
    monkeypatch.setattr(calibrate, "STREAM_MIN_BYTES", 1 << 20)
    want = calibrate.stream_bytes()
    assert want == calibrate.STREAM_LLC_MULTIPLE * (2 << 20)
    monkeypatch.setattr(calibrate, "CACHE_SYSFS", tmp_path / "none")  # no cache stated: the minimum
    assert calibrate.stream_bytes() == 1 << 20
    monkeypatch.setattr(calibrate, "CACHE_SYSFS", root)

    seen: dict[int, int] = {}  # address -> bytes of every weight buffer a probe multiplied
    real_linear = blocks.linear

    def linear(x, w, *a, **kw):
        seen[w.data_ptr()] = w.numel() * w.element_size()
        return real_linear(x, w, *a, **kw)

    monkeypatch.setattr(blocks, "linear", linear)
    calibrate.weight_rates("bf16", 0.02, (64, 128), wide=False)
    assert sum(seen.values()) >= want and len(seen) >= 2
    seen.clear()
    calibrate.weight_rates("bf16", 0.02, (64, 128), wide=False, nbytes=64 << 10)  # the overhead probe's own size
    assert sum(seen.values()) < want
    if not cpu.available():
        return
    seen.clear()
    real_glu = fused.moe_glu_bf16

    def glu(x, experts, parts, inter, out, *a, **kw):
        for p in parts:
            seen[p[0]] = 3 * inter * x.shape[1] * 2  # gate, up, down of one expert
        return real_glu(x, experts, parts, inter, out, *a, **kw)

    monkeypatch.setattr(fused, "moe_glu_bf16", glu)
    calibrate.glu_rate((32, 64), 4, 0.02)
    assert sum(seen.values()) >= want
    seen.clear()
    calibrate.glu_rows_times((32, 64), 0.02, rows=(2,))
    assert sum(seen.values()) >= want


def test_replay_decode_counts_cold_misses():
    """A stream's cold start replayed through the engine's cache: everything fits, so only first uses miss; a
    cache of one layer step's experts misses whatever the last token did not use."""
    from moestream.planner.skew import replay_decode

    # 1 layer, top-2, experts cycle through 0..5: tokens 0-3 as the prompt, 4-7 generated, per window
    tokens = [[[t % 6, (t + 1) % 6]] for t in range(16)]
    per_token, hit, what = replay_decode([tokens], 100, 4, 4)
    # windows [0, 8) and [8, 16): the prompt uses 5 experts, the 4 generated tokens bring in the sixth once
    assert what.startswith("2 windows of 4 prompt + 4 generated") and per_token == pytest.approx(1 / 4)
    assert hit == pytest.approx(1 - 2 / 16)
    tight, hit2, _ = replay_decode([tokens], 2, 4, 4)  # each token shares one expert with the last: one miss,
    assert 1.0 < tight < 2.0 and hit2 == pytest.approx(1 - tight / 2)  # more on the first (the prompt's leftovers)
    short, _, what = replay_decode([tokens[:6]], 100, 8, 8)  # shorter than a window: half and half
    assert what.startswith("1 windows of 3 prompt + 3 generated") and short > 0


def test_scanning_batch_step_hits_the_resident_share(tiny):
    """A batch step routing to most of every layer's experts (a scan) evicts nothing to read: its hit rate is the
    cache's share of all experts (less the read window), not the popular set's."""
    from moestream.experts.dispatch import scan_window

    sc = _scenario(tiny, 0.3, {**RATES, "disk": 1e9})
    f = sc.facts
    step = sc.decode(64, 32)
    capacity = int(sc.cached_per_layer() * f.moe_layers)
    share = (capacity - scan_window(1, f.num_experts, f.top_k, f.moe_layers, capacity)) / (f.num_experts * f.moe_layers)
    assert step.hit_rate == pytest.approx(share, rel=1e-6) and 0 < share < 0.3


def test_one_stream_replays_a_measured_routing(tiny, tmp_path):
    """With a recorded routing that matches the model, one stream's decode misses are the replay's."""
    from moestream.planner.facts import model_facts, open_plan
    from moestream.planner.predict import Scenario
    from moestream.planner.skew import from_report, replay_decode, routing_report

    p = open_plan(tiny)
    try:
        facts = model_facts(tiny, p)
        fit = facts.fit(p, budget_of(tiny, 0.5))
    finally:
        p.store.close()
    e, k, layers = facts.num_experts, facts.top_k, facts.moe_layers
    tokens = [[[(t * 3 + j + i) % e for i in range(k)] for j in range(layers)] for t in range(64)]
    skew = from_report(routing_report([tokens], e, k), "test")
    sc = Scenario(facts, fit, calibrate.Rates.from_json({**RATES, "disk": 1e9}), skew)
    step = sc.decode(1, 20, since_open=(16, 8))
    capacity = int(sc.cached_per_layer() * layers)
    per_token, _, what = replay_decode([tokens], capacity, 16, 8)
    assert sc.replayed == what and step.expert_reads == pytest.approx(min(k, per_token / layers) * layers)


def test_batch_timeline_reads_beside_compute():
    """A multi-row step's layer-by-layer timeline: without reads it is its main-thread work; with reads it is never
    shorter than the disk's or the main thread's share; more misses only lengthen it; a fast disk leaves it the
    main thread's (compute-bound), a slow one the disk's plus what cannot overlap; a scanning step's read-ahead of
    the next layer into its window shortens a disk-bound step; a window of one read serialises read and compute."""
    from moestream.planner.predict import batch_timeline

    layers, front, hits, miss, tail = 8, 2e-3, 3e-3, 1e-3, 4e-3
    total, cpu, busy = batch_timeline(layers, 0.0, front, hits, 5e-3, miss, None, tail=tail)
    assert total == pytest.approx(layers * (front + hits) + tail) == cpu and busy == 0
    prev = total
    for m in (2.0, 5.5, 12.0):  # more misses: longer, and at least the disk's time and the main thread's
        t, c, b = batch_timeline(layers, m, front, hits, 5e-3, miss, None, tail=tail)
        assert t > prev and t >= b and t >= c and b == pytest.approx(layers * m * 5e-3)
        prev = t
    fast = batch_timeline(layers, 12.0, front, hits, 1e-6, miss, None, tail=tail)  # compute-bound
    assert fast[0] == pytest.approx(fast[1], rel=0.01)
    slow = batch_timeline(layers, 12.0, front, hits, 5e-2, miss, None, tail=tail)  # disk-bound
    assert slow[0] >= slow[2] > slow[1]
    # a scan: room for 2 layers' reads, the next layer read ahead while this one computes: shorter than without
    ahead = batch_timeline(layers, 12.0, front, hits, 5e-3, miss, 24, tail=tail)
    plain = batch_timeline(layers, 12.0, front, hits, 5e-3, miss, None, tail=tail)
    assert ahead[0] < plain[0] and ahead[2] == pytest.approx(plain[2])
    # a window of one read: each read waits for the previous expert's compute
    one = batch_timeline(layers, 12.0, 0.0, 0.0, 5e-3, miss, 1)
    assert one[0] == pytest.approx(layers * 12 * (5e-3 + miss))
    # streamed dense reads share the disk and the layer waits for its own: slower, never faster
    dense = batch_timeline(layers, 12.0, front, hits, 5e-3, miss, 24, dense_s=2e-2, tail=tail)
    assert dense[0] > ahead[0] and dense[2] == pytest.approx(ahead[2] + layers * 2e-2)


def test_batch_step_uses_the_many_row_kernel(tiny):
    """The batch step prices bf16 GLU experts by the fused call's measured many-row times (grouped hits, each read
    expert alone); slower many-row times make it slower; fully cached it is compute-bound (no reads, no wait);
    a smaller budget reads more and is slower; without the many-row times it falls back to fp32 expansion + GEMM,
    and says so."""
    rows = {"group": {"2": 2e-5, "4": 3e-5, "16": 8e-5, "64": 3e-4},
            "single": {"2": 3e-5, "4": 4e-5, "16": 9e-5, "64": 3.2e-4}}
    rates = {**RATES, "disk": 1e8, "glu_rows": rows}
    sc = _scenario(tiny, 0.3, rates)
    f = sc.facts
    step = sc.decode(16, 32)
    d = step.detail
    assert d["expert_rates"] == "fused GLU many-row probe" and step.timeline_s == step.seconds
    r = d["rows_per_expert"]
    assert r == pytest.approx(16 * f.top_k / d["experts_per_layer_step"])
    assert d["hit_expert_s"] == pytest.approx(sc.expert_time(r, True))
    lo, hi = max(k for k in (2, 4, 16, 64) if k <= r), min(k for k in (2, 4, 16, 64) if k >= r)
    assert rows["group"][str(lo)] <= d["hit_expert_s"] <= rows["group"][str(hi)]
    assert step.parts["experts_s"] == pytest.approx(
        f.moe_layers * ((d["experts_per_layer_step"] - d["reads_per_layer_step"]) * d["hit_expert_s"]
                        + d["reads_per_layer_step"] * (d["read_expert_s"] + d["read_engine_s"])))
    assert d["read_engine_s"] == RATES["overhead"]["qwen3_moe"]["miss_s"]  # each read's engine work
    costly = {**rates, "overhead": {k: {**v, "miss_s": 10 * v["miss_s"]} for k, v in RATES["overhead"].items()}}
    assert _scenario(tiny, 0.3, costly).decode(16, 32).seconds > step.seconds
    assert step.seconds >= max(step.io_s, step.compute_s + step.overhead_s) - 1e-12
    slower = {k: {n: 3 * v for n, v in t.items()} for k, t in rows.items()}
    assert _scenario(tiny, 0.3, {**rates, "glu_rows": slower}).decode(16, 32).seconds > step.seconds
    full = _scenario(tiny, 1.0, rates).decode(16, 32)
    assert full.expert_reads == 0 and full.wait_s == pytest.approx(0, abs=1e-12)
    assert full.seconds == pytest.approx(full.overhead_s + full.compute_s)
    tight = _scenario(tiny, 0.1, rates).decode(16, 32)
    assert tight.expert_reads > step.expert_reads and tight.seconds > step.seconds
    plain = _scenario(tiny, 0.3, {**RATES, "disk": 1e8}).decode(16, 32)
    assert plain.detail["expert_rates"] == "fp32 expansion + GEMM"


def test_plan_states_the_batch_step(tiny, capsys):
    """`plan --batch` gives the batch step's layer terms and states the model in its assumptions."""
    got = plan_json(str(tiny), "--batch", "8", "--ram-budget", str(budget_of(tiny, 0.6)), "--disk-bandwidth", "1e8",
                    "--prompt-len", "8", "--gen-len", "4",
                    capsys=capsys)
    assert got["batch_sequences"] > 1, got["assumptions"]
    assert "read_window_experts" in got["batch_step"]["layer_step"]
    text = " ".join(got["assumptions"])
    assert "a multi-row step, layer by layer" in text and "OVERLAP" not in text


def _facts_scenario(path, share: float, rates: dict, kv_dtype: str = "fp32", compute_dtype: str = "fp32"):
    from moestream.planner.facts import model_facts, open_plan
    from moestream.planner.predict import Scenario

    p = open_plan(path)
    try:
        facts = model_facts(path, p, kv_dtype)
        return Scenario(facts, facts.fit(p, budget_of(path, share)), calibrate.Rates.from_json(rates),
                        Skew(0.3, "test", 0.1), compute_dtype=compute_dtype)
    finally:
        p.store.close()


GLU_ROWS_FP32 = {"group": {"2": 2e-5, "4": 3e-5, "16": 8e-5, "64": 3e-4, "256": 1.2e-3},
                 "single": {"2": 3e-5, "4": 4e-5, "16": 9e-5, "64": 3.2e-4, "256": 1.3e-3}}
DENSE = {"bf16 64x64": {"fp32": {"1": 1e-5, "16": 4e-5, "64": 1.6e-4, "256": 6.4e-4},
                        "bf16": {"16": 2e-5, "64": 5e-5, "256": 1.6e-4}}}


def test_bf16_compute_prices_many_row_steps_at_the_bf16_probes(tiny):
    """--compute-dtype bf16 changes nothing below blocks.BF16_MIN_ROWS rows (one-token decode, small batches);
    from BF16_MIN_ROWS rows a step its bf16 dense weights take the bf16 dense probe's times, from
    BF16_GLU_MIN_ROWS rows its routed experts the fused call's bf16 many-row times (both 16 now); faster bf16
    probes make those steps faster, slower ones slower (the direction is the probes', not assumed)."""
    from moestream.models.blocks import BF16_GLU_MIN_ROWS, BF16_MIN_ROWS

    fast = {k + "_bf16": {r: t / 2 for r, t in v.items()} for k, v in GLU_ROWS_FP32.items()}
    rates = {**RATES, "disk": 1e8, "glu_rows": {**GLU_ROWS_FP32, **fast}, "dense_rows": DENSE}
    fp32, bf16 = (_facts_scenario(tiny, 1.0, rates, compute_dtype=c) for c in ("fp32", "bf16"))
    for n in (1, BF16_MIN_ROWS - 1):  # below the dense threshold: the same step
        assert bf16.decode(n, 32).seconds == pytest.approx(fp32.decode(n, 32).seconds)
    a, b = fp32.decode(BF16_MIN_ROWS, 32), bf16.decode(BF16_MIN_ROWS, 32)
    assert b.parts["dense_s"] < a.parts["dense_s"]
    if BF16_GLU_MIN_ROWS > BF16_MIN_ROWS:  # experts: fp32 below their own threshold
        assert b.parts["experts_s"] == pytest.approx(a.parts["experts_s"])
        assert "bf16" not in b.detail["expert_rates"]
    below = fp32.decode(BF16_GLU_MIN_ROWS - 1, 32), bf16.decode(BF16_GLU_MIN_ROWS - 1, 32)
    assert below[1].parts["experts_s"] == pytest.approx(below[0].parts["experts_s"])
    assert "bf16" not in below[1].detail["expert_rates"]
    n = BF16_GLU_MIN_ROWS
    a, b = fp32.decode(n, 32), bf16.decode(n, 32)
    assert b.parts["experts_s"] < a.parts["experts_s"] and b.parts["dense_s"] < a.parts["dense_s"]
    assert b.seconds < a.seconds and b.detail["expert_rates"].endswith("bf16 compute")
    assert bf16.prefill(64, 512, cold=False)[0].seconds < fp32.prefill(64, 512, cold=False)[0].seconds
    slow_glu = {k + "_bf16": {r: 3 * t for r, t in v.items()} for k, v in GLU_ROWS_FP32.items()}
    slow = {**rates, "glu_rows": {**GLU_ROWS_FP32, **slow_glu},
            "dense_rows": {k: {"fp32": v["fp32"], "bf16": {r: 10 * t for r, t in v["bf16"].items()}}
                           for k, v in DENSE.items()}}
    assert _facts_scenario(tiny, 1.0, slow, compute_dtype="bf16").decode(n, 32).seconds > a.seconds
    # without the bf16 many-row probe the experts keep the fp32 times
    plain = _facts_scenario(tiny, 1.0, {**rates, "glu_rows": GLU_ROWS_FP32}, compute_dtype="bf16").decode(n, 32)
    assert plain.parts["experts_s"] == pytest.approx(a.parts["experts_s"])


def test_dense_weights_priced_at_their_own_shapes(tiny, k3_dir):
    """The dense probe's shapes are the model's (the most bytes, the lm_head apart, K3's lm_head cut to the probe's
    size); a weight is priced at the probed shape nearest in size, scaled by its parameters; the multi-row dense
    term follows the table; one-row decode keeps small weights at the one-row rate."""
    from moestream.planner.facts import model_facts, open_plan

    p = open_plan(k3_dir)
    try:
        k3 = model_facts(k3_dir, p)
    finally:
        p.store.close()
    shapes = k3.dense_probe_shapes()
    assert ("bf16", *k3.head_shape) in shapes and len(shapes) <= calibrate.DENSE_SHAPES_MAX + 1
    biggest = max(((o, i) for (k, o, i), n in k3.dense_shapes.items() if k == "bf16"), key=lambda s: s[0] * s[1] *
                  k3.dense_shapes[("bf16", *s)])
    assert ("bf16", *biggest) in shapes
    o, i = calibrate.dense_probe_shape(k3.head_shape)
    assert i == k3.head_shape[1] and 2 * o * i <= calibrate.DENSE_MATRIX_MAX < 2 * k3.head_shape[0] * i
    assert calibrate.nearest_dense(DENSE, (128, 64)) == ("bf16 64x64", 2.0)
    assert calibrate.interp_rows({"1": 1.0, "16": 4.0}, 6) == pytest.approx(2.0)
    assert calibrate.interp_rows({"16": 4.0, "64": 3.0}, 128) == pytest.approx(4.0)  # never faster with more rows
    rates = {**RATES, "disk": 1e8, "dense_rows": DENSE}
    sc = _facts_scenario(tiny, 1.0, rates)
    f = sc.facts
    want = calibrate.dense_rows_s(f.dense_shapes, DENSE, 32) + sc.dense_time(f.head_shape, 32)
    rest = sc._dense(32, 32) - want  # the formats / 1-D weights the probe does not cover
    assert rest >= 0 and rest < 0.05 * want
    slower = {k: {"fp32": {r: 2 * t for r, t in v["fp32"].items()}, "bf16": v["bf16"]} for k, v in DENSE.items()}
    assert _facts_scenario(tiny, 1.0, {**rates, "dense_rows": slower})._dense(32, 32) > sc._dense(32, 32)
    # one row: the tiny model's weights are below DENSE_OWN_MIN_BYTES, so the one-row kernel's rate prices them
    plain = _facts_scenario(tiny, 1.0, {**RATES, "disk": 1e8})
    assert sc._dense(1, 1) - sc._head(1) == pytest.approx(plain._dense(1, 1) - plain._head(1))


def test_fp8_dense_weights_priced_at_their_own_shapes(tmp_path_factory):
    """Block-FP8 dense weights (DeepSeek-V3's) are probed at their own shapes too, apart from bf16 ones: the probe
    list names them by format, a weight takes the nearest probed shape of its own format, and the multi-row dense
    term follows the FP8 table (a slower FP8 probe, a slower step; the bf16 table does not price them)."""
    path = synth_tiny(tmp_path_factory, "deepseek_v3")
    sc = _facts_scenario(path, 1.0, {**RATES, "disk": 1e8})
    f = sc.facts
    fp8 = [s for s in f.dense_probe_shapes() if s[0] == "fp8"]
    assert fp8 and len(fp8) <= calibrate.DENSE_SHAPES_MAX and ("bf16", *f.head_shape) in f.dense_probe_shapes()
    o, i = calibrate.dense_probe_shape(fp8[0][1:], "fp8")
    assert (o, i) == fp8[0][1:]
    assert calibrate.dense_probe_shape((10**6, 1000), "fp8")[0] == 2 * calibrate.dense_probe_shape((10**6, 1000))[0]
    table = {"fp32": {"1": 1e-5, "16": 4e-5, "64": 1.6e-4, "256": 6.4e-4}, "bf16": {}}
    both = {**DENSE, "fp8 64x64": table}
    assert calibrate.nearest_dense(both, (128, 64), "fp8") == ("fp8 64x64", 2.0)
    assert calibrate.nearest_dense(DENSE, (128, 64), "fp8") is None
    priced = _facts_scenario(path, 1.0, {**RATES, "disk": 1e8, "dense_rows": both})
    want = calibrate.dense_rows_s(f.dense_shapes, both, 32)
    assert want > calibrate.dense_rows_s(f.dense_shapes, DENSE, 32) > 0
    slower = {**both, "fp8 64x64": {"fp32": {r: 3 * t for r, t in table["fp32"].items()}, "bf16": {}}}
    assert _facts_scenario(path, 1.0, {**RATES, "disk": 1e8, "dense_rows": slower})._dense(32, 32) > \
        priced._dense(32, 32)


def test_fp8_dense_probe_and_the_overhead_probes_fp8_widths(tmp_path):
    """The dense probe times a block-FP8 weight through blocks.linear over every probed row count (fp32 only), and
    the overhead probe's DeepSeek-V3 checkpoint at DeepSeek-V3's head widths has only block-FP8 weights the native
    kernel takes (widths and column tiles multiples of 64), as the published model's are: at the tiny hidden size
    every one went through the chunked path, ~20 ms a layer step priced as overhead."""
    from safetensors import safe_open

    got = calibrate.dense_rows_times((128, 256), 0.05, rows=(1, 70), nbytes=1 << 20, kind="fp8")
    assert set(got["fp32"]) == {"1", "70"} and not got["bf16"] and all(t > 0 for t in got["fp32"].values())
    what = calibrate._tiny("deepseek_v3", tmp_path / "m", 8, 256,
                           {"hidden": 7168, "heads": 128, "kv_heads": 128, "head_dim": 128})
    assert "hidden 512" in what
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    block = tuple(cfg["quantization_config"]["weight_block_size"])
    widths = set()
    for shard in (tmp_path / "m").glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            widths |= {f.get_slice(k).get_shape()[1] for k in f.keys() if f.get_slice(k).get_dtype() == "F8_E4M3"}
    assert widths and all(w % 64 == 0 for w in widths) and block[1] % 64 == 0  # quant.fp8_native's conditions


def test_kv_dtype_storage_work_is_priced(tiny):
    """An int8 cache's measured work beyond fp32's (calibrate.kv_costs) is a compute term of every step, per layer
    with a cache: one-row decode by its context, a batch step by its sequences and context, a prompt by its
    tokens; an fp32 cache, or an unmeasured one, adds nothing."""
    kv = {"decode_s": 1e-5, "decode_row_s": 1e-7, "batch_s": 2e-5, "batch_row_s": 2e-7, "prefill_token_s": 3e-6}
    rates = {**RATES, "disk": 1e8, "kv": {"int8": kv}}
    q8 = _facts_scenario(tiny, 1.0, rates, kv_dtype="int8")
    layers = len(q8.facts.attention)
    assert q8.decode(1, 100).parts["kv_s"] == pytest.approx(layers * (1e-5 + 100 * 1e-7))
    assert q8.decode(8, 100).parts["kv_s"] == pytest.approx(8 * layers * (2e-5 + 100 * 2e-7))
    assert q8.prefill(64, 512, cold=False)[0].parts["kv_s"] == pytest.approx(layers * 3e-6 * 64)
    assert _facts_scenario(tiny, 1.0, rates).decode(8, 100).parts["kv_s"] == 0.0
    assert _facts_scenario(tiny, 1.0, {**RATES, "disk": 1e8}, kv_dtype="int8").decode(8, 100).parts["kv_s"] == 0.0
    base = _facts_scenario(tiny, 1.0, {**RATES, "disk": 1e8}, kv_dtype="int8")
    assert q8.decode(8, 100).seconds > base.decode(8, 100).seconds


def test_batch_overhead_from_the_multi_row_probe(tiny):
    """A multi-row step's engine overhead is batch_s + batch_row_s x rows where the overhead probe measured it on
    the multi-row path, else the one-row step's plus decode_row_s per extra row; a bf16-compute plan takes the
    line measured in bf16 compute (batch_bf16_s, batch_bf16_row_s), the fp32 one where that was not measured."""
    sc = _facts_scenario(tiny, 1.0, {**RATES, "disk": 1e8})
    o = RATES["overhead"]["qwen3_moe"]
    L = sc.facts.num_layers
    assert sc._overhead("decode", 9) == pytest.approx(L * (o["decode_s"] + 8 * o["decode_row_s"]))
    measured = {**RATES, "disk": 1e8, "overhead": {"qwen3_moe": {**o, "batch_s": 1e-3, "batch_row_s": 2e-5}}}
    sc = _facts_scenario(tiny, 1.0, measured)
    assert sc._overhead("decode", 9) == pytest.approx(L * (1e-3 + 9 * 2e-5))
    assert sc._overhead("decode", 1) == pytest.approx(L * o["decode_s"])
    assert _facts_scenario(tiny, 1.0, measured, compute_dtype="bf16")._overhead("decode", 9) == pytest.approx(
        L * (1e-3 + 9 * 2e-5))
    both = {**measured, "overhead": {"qwen3_moe": {**measured["overhead"]["qwen3_moe"], "batch_bf16_s": 4e-4,
                                                   "batch_bf16_row_s": 5e-6}}}
    assert _facts_scenario(tiny, 1.0, both)._overhead("decode", 9) == pytest.approx(L * (1e-3 + 9 * 2e-5))
    assert _facts_scenario(tiny, 1.0, both, compute_dtype="bf16")._overhead("decode", 9) == pytest.approx(
        L * (4e-4 + 9 * 5e-6))


def test_overhead_probe_measures_a_line_per_compute_dtype(monkeypatch):
    """The overhead probe's multi-row steps run at 8 and BATCH_ROWS rows in fp32 and in bf16 compute, and each
    line is the step's growth less the probe's dense weights priced in that dtype (values not asserted: nothing
    is timed reliably; the slope's rows and the dtypes are)."""
    seen = []
    real = calibrate._step_time

    def spy(eng, rows, tokens, seconds):
        seen.append((eng.options.compute_dtype, rows, tokens))
        return real(eng, rows, tokens, 0.0)

    monkeypatch.setattr(calibrate, "_step_time", spy)
    monkeypatch.setattr(calibrate, "_miss_time", lambda *a, **k: 0.0)
    o = calibrate.overhead("qwen3_moe", seconds=0.0, top_k=2, experts=8)
    assert ("fp32", calibrate.BATCH_ROWS, 1) in seen and ("bf16", calibrate.BATCH_ROWS, 1) in seen
    assert ("bf16", 8, 1) in seen and ("fp32", 8, 1) in seen
    assert calibrate.BATCH_ROWS >= 128  # a batch's width, not the 32 rows whose slope over-counted wide steps
    assert min(o.batch_s, o.batch_row_s, o.batch_bf16_s, o.batch_bf16_row_s) >= 0
    assert "bf16 compute" in o.source and "fp32 compute" in o.source


def test_plan_compute_and_kv_dtype_options(tiny, seeded_cache, capsys):
    """`plan --compute-dtype bf16 --kv-dtype int8` plans with both and states them; bad values are refused."""
    data = json.loads(seeded_cache.read_text())
    data["machines"][calibrate.machine_key()]["kv"] = {"int8": {"decode_s": 1e-5, "decode_row_s": 1e-7,
                                                                "batch_s": 2e-5, "batch_row_s": 2e-7,
                                                                "prefill_token_s": 3e-6}}
    seeded_cache.write_text(json.dumps(data))
    args = (str(tiny), "--batch", "64", "--ram-budget", str(budget_of(tiny, 1.0)), "--disk-bandwidth", "1e8",
            "--prompt-len", "8", "--gen-len", "4")
    fp32 = plan_json(*args, capsys=capsys)
    got = plan_json(*args, "--compute-dtype", "bf16", "--kv-dtype", "int8", capsys=capsys)
    assert got["compute_dtype"] == "bf16" and got["kv_dtype"] == "int8" and fp32["compute_dtype"] == "fp32"
    assert got["batch_step"]["compute_parts"]["kv_s"] > 0 == fp32["batch_step"]["compute_parts"]["kv_s"]
    text = " ".join(got["assumptions"])
    assert "compute dtype bf16" in text and "--kv-dtype int8: its storage work" in text
    assert got["rates"]["dense_rows"], "the seeded dense table stands for the model's shapes"
    with pytest.raises(SystemExit):
        main(["plan", str(tiny), "--compute-dtype", "fp16"])


def test_mxfp4_experts_under_bf16_compute_are_priced_at_their_bf16_probe(k3_dir, seeded_cache, monkeypatch,
                                                                          capsys):
    """--compute-dtype bf16 rounds MXFP4 experts' activations at every row count (blocks.mxfp4_bf16), so a K3 plan
    prices their one-row products at the MXFP4_BF16 probe's rate, fp32 at the MXFP4 one's; the probe's call is the
    engine's (mxfp4_linear with bf16)."""
    from moestream.kernels import quant

    data = json.loads(seeded_cache.read_text())
    entry = data["machines"][calibrate.machine_key()]
    entry["gemv"][calibrate.MXFP4_BF16] = 4 * entry["gemv"]["mxfp4"]
    seeded_cache.write_text(json.dumps(data))
    args = (str(k3_dir), "--ram-budget", "2000GB", "--disk-bandwidth", "3GB")
    fp32 = plan_json(*args, capsys=capsys)
    bf16 = plan_json(*args, "--compute-dtype", "bf16", capsys=capsys)
    assert bf16["rates"]["gemv"]["mxfp4"] == 4 * fp32["rates"]["gemv"]["mxfp4"]
    assert bf16["decode_step"]["compute_parts"]["experts_s"] == pytest.approx(
        fp32["decode_step"]["compute_parts"]["experts_s"] / 4)
    assert bf16["decode_tokens_per_s"] > fp32["decode_tokens_per_s"]
    assert "MXFP4 experts take bf16-rounded activations" in " ".join(bf16["assumptions"])
    calls, real = [], quant.mxfp4_linear
    monkeypatch.setattr(quant, "mxfp4_linear",
                        lambda *a, **kw: (calls.append(kw.get("bf16", False)), real(*a, **kw))[1])
    assert calibrate.weight_rates(calibrate.MXFP4_BF16, 0.02, (64, 128), wide=False, nbytes=1 << 16)[0] > 0
    assert calls and all(calls)
    calls.clear()
    assert calibrate.weight_rates("mxfp4", 0.02, (64, 128), wide=False, nbytes=1 << 16)[0] > 0
    assert calls and not any(calls)


def test_dense_and_kv_probes_measure_the_engine_paths(tiny):
    """The dense probe times blocks.linear in fp32 at every row count and in bf16 compute from BF16_MIN_ROWS rows;
    the KV probe returns each storage cost, none negative (values not asserted: nothing is timed)."""
    from moestream.kernels import cpu
    from moestream.models.blocks import BF16_MIN_ROWS

    got = calibrate.dense_rows_times((64, 128), seconds=0.05, rows=(1, 16, 32), nbytes=1 << 20)
    assert set(got["fp32"]) == {"1", "16", "32"} and all(v > 0 for v in got["fp32"].values())
    if cpu.available():
        assert set(got["bf16"]) == {str(r) for r in (16, 32) if r >= BF16_MIN_ROWS}
    kv = calibrate.kv_costs(tiny, "int8", seconds=0.2)
    assert set(kv) == {"decode_s", "decode_row_s", "batch_s", "batch_row_s", "prefill_token_s"}
    assert all(v >= 0 for v in kv.values())


def test_a_b12_pack_is_planned_with_coded_expert_probes(tiny, tmp_path, seeded_cache, monkeypatch, capsys):
    """A `pack --codec b12` checkpoint: the planner reads its experts' coded bytes and prices their compute by the
    fused GLU kernel probed over coded experts (its own cache key, rates in coded bytes), not by bf16's."""
    from moestream.kernels import b12, cpu, fused
    from moestream.planner.facts import model_facts, open_plan

    if not cpu.available():
        pytest.skip("no native kernels")
    packed = tmp_path / "b12"
    assert main(["pack", str(tiny), str(packed), "--codec", "b12"]) == 0
    capsys.readouterr()
    facts = {}
    for name, path in (("bf16", tiny), ("b12", packed)):
        p = open_plan(path)
        try:
            facts[name] = model_facts(path, p)
        finally:
            p.store.close()
    assert facts["bf16"].expert_codec == "" and facts["b12"].expert_codec == "b12"
    assert facts["b12"].expert_kind == "bf16" and facts["b12"].expert_bytes < facts["bf16"].expert_bytes
    shape = facts["b12"].glu_shape()
    assert shape is not None
    # the probe multiplies coded experts (tagged addresses) and counts their coded bytes
    seen: list[int] = []
    real = fused.moe_glu_bf16

    def glu(x, experts, parts, inter, out, *a, **kw):
        seen.extend(p[0] for p in parts)
        return real(x, experts, parts, inter, out, *a, **kw)

    monkeypatch.setattr(fused, "moe_glu_bf16", glu)
    assert calibrate.glu_rate(shape, 2, 0.02, codec="b12") > 0
    assert seen and all(a & 1 for a in seen)
    experts, _ = calibrate._glu_experts(shape, 1, "b12")
    inter, hidden = shape
    assert calibrate._glu_expert_bytes(experts) == 2 * b12.coded_nbytes(inter, hidden, 0) + b12.coded_nbytes(
        hidden, inter, 0) < 3 * inter * hidden * 2
    with pytest.raises(ValueError, match="codec"):
        calibrate._glu_experts(shape, 1, "zstd")
    monkeypatch.setattr(fused, "moe_glu_bf16", real)
    # seeded rates for coded experts (as a probe would store them): the plan takes them, and says so
    data = json.loads(seeded_cache.read_text())
    entry = data["machines"][calibrate.machine_key()]
    entry["glu_kernels"]["b12"] = 4e9
    entry["glu_rows"]["b12"] = {k: {r: 3 * t for r, t in v.items()} for k, v in SEEDED_GLU_ROWS["bf16"].items()}
    seeded_cache.write_text(json.dumps(data))
    out = {name: plan_json(str(path), "--ram-budget", str(budget_of(tiny, 1.0)), "--disk-bandwidth", "1e9",
                           capsys=capsys) for name, path in (("bf16", tiny), ("b12", packed))}
    assert out["b12"]["rates"]["glu"] == 4e9 and out["bf16"]["rates"]["glu"] == 1.6e10
    assert out["b12"]["model"]["expert_codec"] == "b12" and out["bf16"]["model"]["expert_codec"] is None
    assert any("b12-coded bf16 GLU experts" in a and "coded bytes" in a for a in out["b12"]["assumptions"])
    assert out["b12"]["decode_step"]["compute_parts"]["experts_s"] > out["bf16"]["decode_step"]["compute_parts"][
        "experts_s"]


def test_a_streamed_heads_slabs_follow_the_layers():
    """A one-row step whose lm_head streams: the head's slabs are read after the last layer (each while the one
    before computes), so they overlap the head's own compute only, not the layers' reads and work."""
    from moestream.planner.predict import Step

    plain = Step(io_s=1.0, compute_s=0.5, overhead_s=0.1, expert_reads=0, hit_rate=0.0, wait_s=0.05)
    assert plain.seconds == pytest.approx(0.1 + 1.0)
    streamed = Step(io_s=1.0, compute_s=0.5, overhead_s=0.1, expert_reads=0, hit_rate=0.0, wait_s=0.05,
                    head_tail=(0.6, 0.05))
    assert streamed.seconds == pytest.approx(0.1 + max(0.4, 0.45 + 0.05) + 0.6)


def test_fp8_and_int4_weights_of_few_rows_are_priced_at_their_native_kernels(tmp_path_factory):
    """Block-FP8 (and int4) products below quant's row limits run on the native kernels (kernels/_cpu_fp8.c): priced
    at the one-row kernel's byte rate plus the extra rows' FLOPs; from the limit on, at the chunked expansion and
    a GEMM."""
    from moestream.kernels.quant import FP8_NATIVE_MAX_T, INT4_NATIVE_MAX_T
    from moestream.planner.predict import EXPERT_ROWS, NATIVE_ROWS

    dsv3 = synth_tiny(tmp_path_factory, "deepseek_v3")
    rates = {**RATES, "gemv": {**RATES["gemv"], "fp8": 2e10}, "expand": {**RATES["expand"], "fp8": 1e9}}
    sc = _scenario(dsv3, 1.0, rates)
    f = sc.facts
    assert f.expert_kind == "fp8"
    for limit in (EXPERT_ROWS, NATIVE_ROWS):
        few = sc._weights(f.expert_bytes, "fp8", f.expert_params, FP8_NATIVE_MAX_T - 1, limit)
        assert few == pytest.approx(f.expert_bytes / 2e10 + 2 * f.expert_params * (FP8_NATIVE_MAX_T - 2) / 5e10)
        many = sc._weights(f.expert_bytes, "fp8", f.expert_params, FP8_NATIVE_MAX_T, limit)
        assert many == pytest.approx(sc._expanded(f.expert_bytes, "fp8", f.expert_params, FP8_NATIVE_MAX_T))
        assert limit["int4"] == INT4_NATIVE_MAX_T - 1
