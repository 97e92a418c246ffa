"""Pure parts of benchmarks/quant_quality.py (agreement scores) and benchmarks/compile_throughput.py
(inductor cache state, median round); the benchmarks themselves load SmolLM2 and are not run here."""

import pytest
from helpers.bench_module import load_bench


_load = load_bench  # the scripts import their siblings (quant_throughput, engine_throughput)


@pytest.fixture(scope="module")
def qq():
    return _load("quant_quality")


@pytest.fixture(scope="module")
def ct():
    return _load("compile_throughput")


def test_agreement_prefix_overall_and_first_divergence(qq):
    ref = {0: [1, 2, 3, 4], 1: [5, 6, 7, 8], 2: [9, 9, 9, 9]}
    outs = {0: [1, 2, 3, 4],   # all 4 agree, no divergence (position 4)
            1: [5, 0, 7, 8],   # diverges at 1; 3 of 4 equal at their position
            2: [0, 9, 9, 9]}   # diverges at 0; 3 of 4 equal
    prefix, overall, first = qq.agreement(ref, outs)
    assert prefix == pytest.approx((4 + 1 + 0) / 12)
    assert overall == pytest.approx((4 + 3 + 3) / 12)
    assert first == 1  # median of 4, 1, 0


def test_quant_quality_modes_are_real_quantization_values(qq):
    from fleetserve.layers.quantization import QUANTIZATION_CHOICES

    shipped = [m for m in qq.MODES if not m.startswith("int8-")]
    assert shipped[0] == "none" and "auto" in shipped and "int4wo-256" in shipped
    assert set(shipped) <= set(QUANTIZATION_CHOICES)
    assert len(qq.PROMPTS) == 32


def test_inductor_cache_state_cold_then_warm(ct, tmp_path):
    missing = tmp_path / "nope"
    assert ct.inductor_cache_state(str(missing)) == (str(missing), "cold")
    (tmp_path / "fxgraph" / "ab").mkdir(parents=True)
    assert ct.inductor_cache_state(str(tmp_path))[1] == "cold"  # folders only
    (tmp_path / "fxgraph" / "ab" / "g1").write_bytes(b"x")
    (tmp_path / "c.so").write_bytes(b"y")
    assert ct.inductor_cache_state(str(tmp_path))[1] == "warm (2 files)"


def test_median_run_keeps_one_rounds_figures_together(ct):
    runs = [(30.0, 0.5, {0: [1]}, 4.0), (10.0, 0.9, {0: [2]}, 6.0), (20.0, 0.7, {0: [3]}, 5.0)]
    assert ct.median_run(runs) == runs[2]
    assert ct.median_run(runs[:2]) == runs[1]  # even count: the lower middle
    assert ct.median_run(runs[:1]) == runs[0]
