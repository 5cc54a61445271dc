"""The quantization registry (config/quantization.py): a row for every method the schema names, and the
rules validation, the plan and serving take from the rows."""

import dataclasses

from appliance.config import quantization
from appliance.config.compose import resolve
from appliance.config.quantization import QUANTIZATION_METHODS, quantization_problems
from appliance.config.schema import QuantMethod
from appliance.config.unbuilt import not_built


def test_every_method_has_a_row():
    assert set(QUANTIZATION_METHODS) == {m.value for m in QuantMethod}
    for name, row in QUANTIZATION_METHODS.items():
        assert row.name == name
        assert row.scales in ("none", "channel", "group", "channel or group", "blocks")
        assert row.activation_dtype in ("", "fp8", "int8") and (row.activation_dtype or not row.activations_required)
        assert (row.scales in ("none", "blocks")) == (not row.bits)


def test_validation_and_serving_read_the_rows(monkeypatch):
    cfg = resolve(["+profile=cpu", "model=tiny_random", "quantization=int4_wo"]).cfg
    assert quantization_problems(cfg) == [] and not_built(cfg) == []
    row = QUANTIZATION_METHODS["int4_wo"]
    monkeypatch.setitem(QUANTIZATION_METHODS, "int4_wo", dataclasses.replace(row, runnable=False, bits=(2.0,)))
    assert any("int4_wo can be planned but its weight kernels are not built yet" in p for p in not_built(cfg))
    assert ("quantization.weight_bits=4 does not match quantization.method=int4_wo, which stores 2-bit weights; "
            "set quantization.weight_bits=2 (the option quantization=int4_wo sets both)") in quantization_problems(cfg)
    act = dataclasses.replace(cfg, quantization=dataclasses.replace(cfg.quantization, activations=True))
    assert ("quantization.activations=true (W8A8) is built for quantization=fp8 and w8a8_int8; quantization=int4_wo "
            "quantizes weights only") in quantization_problems(act)
    monkeypatch.setitem(QUANTIZATION_METHODS, "int4_wo", dataclasses.replace(row, activation_dtype="int8"))
    assert quantization_problems(act) == []
    assert quantization.fp8_gemm(act) is False
