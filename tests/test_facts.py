"""The facts layer: scenario loading and validation, the GPU cost and memory model, the WAN model."""

import pytest

from geomesh.config import ConfigError, load_scenario, preset_names
from geomesh.hardware import GPU_CATALOG, TimingModel, WorkerProfile, gpu_spec, model_profile
from geomesh.network import WanModel, azure_rtt_ms

TIMING = TimingModel(n_layers=24, hidden=1024, seq_len=1024)


# ---- scenarios ---------------------------------------------------------------------------------
def test_presets_load_and_differ():
    assert {"default", "homogeneous"} <= set(preset_names())
    default, homog = load_scenario("default"), load_scenario("homogeneous")
    assert len({r.gpu for r in default.regions}) == 4
    assert len({r.gpu for r in homog.regions}) == 1
    assert default.wan_model().n == 4
    assert all(bw <= 1e9 / 8 for row in default.wan_model().bandwidth_Bps for bw in row)


def write(tmp_path, text):
    path = tmp_path / "s.yaml"
    path.write_text(text)
    return path


BASE = """
regions:
  - {name: a, gpu: H100, azure_region: East US}
  - {name: b, gpu: T4, azure_region: Japan East}
"""


@pytest.mark.parametrize(
    "extra, field, allowed",
    [
        ("training: {tokens: -5}", "training.tokens", "positive"),
        ("training: {tokens: lots}", "training.tokens", "integer"),
        ("training: {outer_lr: 0}", "training.outer_lr", "learning rate"),
        ("training: {outer_momentum: 1.0}", "training.outer_momentum", "[0, 1)"),
        ("training: {warp: 3}", "training.warp", "allowed: tokens"),
        ("wan: {bandwidth_gbps: 0}", "wan.bandwidth_gbps", "Gbit/s"),
        ("wan: {rtt: [[0, 1], [1]]}", "wan.rtt", "2x2"),
        ("wan: {rtt: [[0, -1], [1, 0]]}", "wan.rtt[0][1]", "positive"),
        ("model: {preset: gigantic}", "model.preset", "expected one of"),
        ("timing_model: {mfu: 1.5}", "timing_model.mfu", "(0, 1]"),
        ("geomesh: {scale: l3}", "geomesh.scale", "'l1' or 'l2'"),
        ("data: {vocab_size: 10}", "data.vocab_size", "256..65536"),
    ],
)
def test_loading_errors_name_field_value_and_allowed(tmp_path, extra, field, allowed):
    with pytest.raises(ConfigError) as err:
        load_scenario(write(tmp_path, BASE + extra))
    msg = str(err.value)
    assert field in msg and allowed in msg


def test_region_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"regions\[0\].gpu: 'X100'.*H100"):
        load_scenario(write(tmp_path, "regions: [{name: a, gpu: X100, azure_region: East US}]"))
    with pytest.raises(ConfigError, match=r"regions\[1\].name"):
        load_scenario(write(tmp_path, "regions: [{name: a, gpu: T4, azure_region: East US}, "
                                      "{name: a, gpu: T4, azure_region: East US}]"))
    with pytest.raises(ConfigError, match=r"regions\[0\].azure_region: 'Mars'"):
        load_scenario(write(tmp_path, "regions: [{name: a, gpu: T4, azure_region: Mars}]"))
    with pytest.raises(ConfigError, match=r"scenario.regions: missing"):
        load_scenario(write(tmp_path, "training: {tokens: 5}"))
    with pytest.raises(ConfigError, match="regions: .*at least one"):
        load_scenario(write(tmp_path, "regions: []"))


def test_file_level_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such preset or file"):
        load_scenario("nonexistent-preset")
    with pytest.raises(ConfigError, match="cannot read"):
        load_scenario(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_scenario(write(tmp_path, "regions: [unclosed"))
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_scenario(write(tmp_path, "- 1\n- 2\n"))


def test_given_rtt_matrix_and_overrides(tmp_path):
    path = write(tmp_path, """
regions: [{name: a, gpu: A100}, {name: b, gpu: V100}, {name: c, gpu: T4}]
wan: {rtt: [[0, 10, 20], [10, 0, 30], [20, 30, 0]], bandwidth_gbps: 0.5}
""")
    s = load_scenario(path, {"training.seed": 7, "training.tokens": 1e5})
    assert s.training.seed == 7 and s.training.tokens == 100000
    wan = s.wan_model()
    assert wan.rtt_s[1][2] == pytest.approx(0.030)
    assert wan.bandwidth_Bps[0][1] == pytest.approx(0.5e9 / 8)


# ---- cost and memory model ---------------------------------------------------------------------
def test_faster_gpu_is_faster():
    h100, a100, v100, t4 = (model_profile(g, g, 1, TIMING) for g in ("H100", "A100", "V100", "T4"))
    for b in (1, 4, 8):
        assert h100.step_s(b, 1) < a100.step_s(b, 1) < v100.step_s(b, 1) < t4.step_s(b, 1)


def test_flops_and_params_formulae():
    # P = 12·L·h² + V·h; FLOPs/token = 6P + 12·L·h·s
    assert TIMING.params == 12 * 24 * 1024**2 + 32000 * 1024
    assert TIMING.flops_per_token == 6 * TIMING.params + 12 * 24 * 1024 * 1024


def test_memory_cap_shrinks_as_model_grows():
    t4 = gpu_spec("T4")
    caps = [TimingModel(n_layers=n, hidden=h, seq_len=1024).max_micro_batch(t4)
            for n, h in ((12, 768), (24, 1024), (24, 1536))]
    assert caps[0] > caps[1] > caps[2] >= 0
    huge = TimingModel(n_layers=80, hidden=8192, seq_len=4096)  # 65B parameters
    assert huge.max_micro_batch(gpu_spec("H100")) == 0


def test_throughput_saturates_with_batch():
    p = model_profile("a", "A100", 1, TIMING)
    thr = [p.throughput(b) for b in (1, 2, 4, 8)]
    assert thr == sorted(thr) and thr[-1] / thr[-2] < thr[1] / thr[0]


def test_multi_gpu_region_is_faster_and_holds_more():
    one, eight = model_profile("a", "A100", 1, TIMING), model_profile("b", "A100", 8, TIMING)
    assert eight.max_micro_batch == 8 * one.max_micro_batch
    assert eight.step_s(64, 1) < one.step_s(8, 8)


def test_profile_json_round_trip_and_errors():
    p = model_profile("a", "T4", 1, TIMING)
    q = WorkerProfile.from_json(p.to_json())
    assert q.step_s(3, 2) == pytest.approx(p.step_s(3, 2))
    with pytest.raises(ValueError, match="bad profile"):
        WorkerProfile.from_json({"table": {"1": -1.0}, "max_micro_batch": 4})
    with pytest.raises(ValueError, match="bad profile"):
        WorkerProfile.from_json({"table": {}})


def test_catalog_has_no_sparse_figures():
    assert GPU_CATALOG["H100"].tflops == 989.0 and GPU_CATALOG["H200"].tflops == 989.0


# ---- WAN model ---------------------------------------------------------------------------------
def test_azure_rtts_are_the_published_ones():
    assert azure_rtt_ms("East US", "West US 2") == 75
    assert azure_rtt_ms("central india", "Southeast Asia") == 59
    with pytest.raises(KeyError):
        azure_rtt_ms("East US", "Moon")


def uniform_wan(n, rtt_s, bw_Bps):
    return WanModel(tuple(tuple(0.0 if i == j else rtt_s for j in range(n)) for i in range(n)),
                    tuple(tuple(bw_Bps for _ in range(n)) for _ in range(n)))


def test_collective_times():
    wan = uniform_wan(4, 0.1, 1e8)
    m = 4e8
    # ring all-reduce: 2(N-1) steps of M/N bytes, each paying one-way latency
    assert wan.allreduce_s(m) == pytest.approx(6 * (0.05 + 1e8 / 1e8))
    assert wan.allgather_s(m / 32) == pytest.approx(3 * (0.05 + m / 32 / 1e8))
    assert wan.allreduce_bytes_per_worker(m, 4) == pytest.approx(1.5 * m)
    assert uniform_wan(1, 0.1, 1e8).allreduce_s(m) == 0.0


def test_slowest_link_sets_the_pace_and_latency_counts():
    wan = uniform_wan(3, 0.1, 1e8).scaled_bandwidth(2, 0.5)
    assert wan.allgather_s(1e6) == pytest.approx(2 * (0.05 + 1e6 / 5e7))
    assert uniform_wan(3, 0.2, 1e8).allgather_s(0) == pytest.approx(2 * 0.1)
    sub = wan.subset([0, 1])
    assert sub.n == 2 and sub.allgather_s(1e6) == pytest.approx(0.05 + 1e6 / 1e8)
