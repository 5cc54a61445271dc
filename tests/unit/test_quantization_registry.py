"""The quantization registry (config/quantization.py): a row for every method the schema names, and the
rules validation, the plan and serving take from the rows."""

import dataclasses

from appliance.config import quantization
from appliance.config.compose import resolve
from appliance.config.quantization import QUANTIZATION_METHODS, quantization_problems
from appliance.config.enums import QuantMethod
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


def test_a_checkpoints_quantization_config_is_read_by_its_methods_row():
    read = quantization.checkpoint_quantization
    assert quantization.checkpoint_method("GPTQ").name == "gptq"
    assert quantization.checkpoint_method("compressed-tensors").name == "fp8"
    assert quantization.checkpoint_method("bitsandbytes") is None
    facts, problems = read({"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemv"})
    assert [(f.key, f.value) for f in facts] == [("method", "awq"), ("weight_bits", 4.0), ("group_size", 64)]
    assert problems == ["AWQ version gemv is not supported (the GEMM layout only)"]
    facts, problems = read({"quant_method": "gptq", "bits": "4"})  # the method stands; its width cannot be read
    assert [f.key for f in facts] == ["method"] and "needs integer bits and group_size" in problems[0]
    group = {"weights": {"type": "float", "num_bits": 8, "strategy": "channel"},
             "input_activations": {"type": "float", "num_bits": 8, "strategy": "token"}}
    facts, problems = read({"quant_method": "compressed-tensors", "config_groups": {"g": group}})
    assert facts[0].value == "fp8" and "compressed-tensors (fp8 weights)" in facts[0].source and problems == []
    assert ("activations", True) in [(f.key, f.value) for f in facts]
    facts, problems = read({"quant_method": "bitsandbytes"})
    assert facts == [] and problems == ["quantization_config.quant_method=bitsandbytes is not supported; supported: "
                                        "fp8, compressed-tensors, awq, gptq, mxfp4"]
    # the quant_method values are matched lower-cased
    assert all(name == name.lower() for row in QUANTIZATION_METHODS.values() for name, _ in row.checkpoint_readers)
