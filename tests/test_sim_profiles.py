"""Model and hardware profiles: computed sizes match the models' published totals; cost model."""

from __future__ import annotations

import pytest

from moeserve.sim.cost import CostModel
from moeserve.sim.hardware import get_hardware, hardware_names
from moeserve.sim.models import MODELS, get_model

# Published total parameters (billions): Mixtral 46.7 (arXiv 2401.04088), Switch-base-128 7.4
# (HF model card), NLLB-MoE 54.5 (arXiv 2207.04672), Arctic ~480 (Snowflake), Qwen3-30B-A3B 30.5
# (arXiv 2505.09388), DeepSeek-V3 671 (arXiv 2412.19437).
TOTALS_B = {
    "mixtral-8x7b": (46.7, 0.01),
    "switch-base-128": (7.4, 0.02),
    "nllb-moe-128": (54.5, 0.01),
    "arctic-128x4b": (480.0, 0.02),
    "qwen3-30b-a3b": (30.5, 0.01),
    "deepseek-v3": (671.0, 0.01),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_total_parameters_match_the_published_figure(name: str) -> None:
    m = get_model(name)
    total = (m.dense_params + m.total_experts * m.expert_params) / 1e9
    want, rel = TOTALS_B[name]
    assert total == pytest.approx(want, rel=rel)


def test_mixtral_expert_and_slots() -> None:
    m = get_model("mixtral-8x7b")
    assert m.expert_params == 3 * 4096 * 14336
    assert m.expert_bytes == 2 * 3 * 4096 * 14336
    assert m.buffer_slots(get_hardware("a5000")) == 57
    assert m.buffer_slots(get_hardware("h100")) < m.total_experts  # 256 x 336 MiB = 84 GiB > 80 GiB
    assert m.buffer_slots(get_hardware("gh200")) == m.total_experts  # 96 GiB holds them all


def test_roofline_decode_is_memory_bound_and_copy_is_bytes_over_bandwidth() -> None:
    m, hw = get_model("mixtral-8x7b"), get_hardware("a5000")
    c = CostModel.roofline(m, hw)
    assert c.transfer_s == pytest.approx(10e-6 + m.expert_bytes / 25.2e9)
    assert c.expert_s(1) == pytest.approx((m.expert_bytes + 2 * 4096 * 2) / 768e9)
    big = 100_000  # far past the ridge point: compute-bound
    assert c.expert_s(big) == pytest.approx(big * m.expert_flops_per_token / 111.1e12)


def test_every_named_hardware_resolves() -> None:
    for name in hardware_names():
        hw = get_hardware(name)
        assert hw.link.gbps > 0 and hw.gpu.memory_bytes > 0
    assert get_hardware("gh200").link.name == "nvlink-c2c"


def test_every_hardware_profile_has_a_sourced_host() -> None:
    for name in hardware_names():
        h = get_hardware(name).host
        assert h is not None and h.source and h.cores > 1 and 1 <= h.default_threads() < h.cores
        assert 0 < h.mem_gbps < h.mem_gbps_nominal and h.peak_flops > 0
    # the paper's A5000 testbed class: one 8-channel DDR4-3200 socket; an H100 server's Sapphire Rapids
    assert get_hardware("a5000").host.mem_gbps_nominal == pytest.approx(8 * 3.2 * 8)
    assert get_hardware("h100").host.mem_gbps_nominal == pytest.approx(8 * 4.8 * 8)
