"""Any checkpoint by path: ``model.path=`` alone makes a local Hugging Face
folder or GGUF file the source of the model's architecture facts."""

import json
import math

import pytest
import torch
from safetensors import safe_open

from appliance import LLM, SamplingParams
from appliance.config.compose import ConfigError, resolve
from appliance.config.plan import format_plan, make_plan
from appliance.errors import ModelLoadError
from appliance.models.loader import check_checkpoint, find_wheel_gguf
from appliance.models.tiny import generate_tiny
from tests.conftest import run_cli
from tests.model_helpers import PROMPTS, check_logprobs_close, greedy_top_logprobs, hf_greedy, hf_greedy_top_logprobs

BASE = ["+profile=cpu"]
# Generated through tiny.py (transformers' Qwen2Config / Qwen3Config, random
# weights as safetensors, a trained BPE tokenizer); numbers unlike any catalog option.
FOLDERS = {
    "qwen2": {"architecture": "Qwen2ForCausalLM", "qkv_bias": True, "qk_norm": False, "tie_word_embeddings": False,
              "num_layers": 2, "hidden_size": 64, "intermediate_size": 96, "num_heads": 4, "num_kv_heads": 2,
              "head_dim": 16, "vocab_size": 512, "max_position_embeddings": 4096, "rope_theta": 1000000.0,
              "rms_norm_eps": 1e-6, "rope_scaling.type": "yarn", "rope_scaling.factor": 4.0,
              "rope_scaling.original_max_position_embeddings": 1024, "rope_scaling.beta_fast": 16.0},
    "qwen3": {"architecture": "Qwen3ForCausalLM", "qkv_bias": False, "qk_norm": True, "tie_word_embeddings": True,
              "num_layers": 3, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "num_kv_heads": 2,
              "head_dim": 32, "vocab_size": 384, "max_position_embeddings": 2048, "rope_theta": 500000.0,
              "rms_norm_eps": 1e-6, "rope_scaling.type": "linear", "rope_scaling.factor": 2.0,
              "sliding_window": 6, "layer_types": ["full_attention", "sliding_attention", "sliding_attention"]},
    "gemma3": {"architecture": "Gemma3ForCausalLM", "qkv_bias": False, "qk_norm": True, "tie_word_embeddings": True,
               "num_layers": 3, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "num_kv_heads": 1,
               "head_dim": 32, "vocab_size": 384, "max_position_embeddings": 2048, "rope_theta": 1000000.0,
               "rope_local_theta": 10000.0, "rms_norm_eps": 1e-6, "sliding_window": 8,
               "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
               "query_pre_attn_scalar": 32.0},
    "gemma2": {"architecture": "Gemma2ForCausalLM", "qkv_bias": False, "qk_norm": False, "tie_word_embeddings": True,
               "num_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "num_kv_heads": 2,
               "head_dim": 16, "vocab_size": 384, "max_position_embeddings": 2048, "rope_theta": 10000.0,
               "rms_norm_eps": 1e-6, "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"],
               "query_pre_attn_scalar": 16.0, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 5.0},
}


def _value(m, key):
    for part in key.split("."):
        m = getattr(m, part)
    return getattr(m, "value", m)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    out = {}
    for name, facts in FOLDERS.items():
        overrides = [f"model.{k}={json.dumps(v)}" for k, v in facts.items()]
        spec = resolve(BASE + ["model=tiny_random", *overrides], check=False).cfg.model
        out[name] = generate_tiny(spec, root / f"my-{name}")
    return out


def _checkpoint_parameters(folder):
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


@pytest.mark.parametrize("name", list(FOLDERS))
def test_folder_facts_are_read_at_resolve_time(folders, name):
    m = resolve(BASE + [f"model.path={folders[name]}"]).cfg.model
    for key, value in FOLDERS[name].items():
        assert _value(m, key) == value, key
    assert m.name == f"my-{name}"
    # The figure computed from the facts is the checkpoint's own tensor count.
    assert m.param_count_b * 1e9 == pytest.approx(_checkpoint_parameters(folders[name]), rel=1e-3)


def test_plan_shows_the_folder(folders):
    m = FOLDERS["qwen2"]
    plan = make_plan(resolve(BASE + [f"model.path={folders['qwen2']}"]).cfg)
    assert plan.model == "my-qwen2"
    assert plan.parameter_count == _checkpoint_parameters(folders["qwen2"])
    assert plan.weight_bytes_total == 2 * plan.parameter_count  # bf16: the native kernels' fastest dtype
    assert plan.kv_bytes_per_token == 2 * m["num_layers"] * m["num_kv_heads"] * m["head_dim"] * 2
    assert plan.max_model_len == m["max_position_embeddings"]
    text = format_plan(plan)
    assert "my-qwen2" in text and f"{plan.kv_bytes_per_token} bytes/token" in text
    assert not any("catalog" in n for n in plan.notes)


@pytest.mark.parametrize("name", list(FOLDERS))
def test_folder_generates_with_only_model_path(folders, name):
    """Served as a user writes it (bf16 on the cpu profile: close to HF in
    bf16), and token for token against HF in fp32."""
    llm = LLM(overrides=BASE + [f"model.path={folders[name]}"])
    assert llm.execution.dtype == "bfloat16"
    ids = [llm.tokenizer.encode(p) for p in PROMPTS[:3]]
    check_logprobs_close(greedy_top_logprobs(llm, ids, 6, 5),
                         [hf_greedy_top_logprobs(llm, p, 6, 5, torch.bfloat16) for p in ids])
    fp32 = LLM(overrides=BASE + [f"model.path={folders[name]}", "model.dtype=float32"])
    for p in ids:
        out = fp32.generate([p], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_greedy(fp32, p, 6)


def test_overrides_against_the_checkpoint(folders, tmp_path):
    q2 = folders["qwen2"]
    with pytest.raises(ConfigError, match=rf"model.num_layers=3 but the checkpoint {q2} has num_hidden_layers=2"):
        resolve(BASE + [f"model.path={q2}", "model.num_layers=3"])
    with pytest.raises(ConfigError, match=r"model.qkv_bias=false but the checkpoint .*Qwen2ForCausalLM.*q/k/v bias"):
        resolve(BASE + [f"model.path={q2}", "++model.qkv_bias=false"])
    with pytest.raises(ConfigError, match=r"model.rope_scaling.type=none but the checkpoint .* rope scaling linear"):
        resolve(BASE + [f"model.path={folders['qwen3']}", "model.rope_scaling.type=none"])
    with pytest.raises(ConfigError, match=r"model.rope_scaling.beta_fast=32.0 but the checkpoint .* beta_fast=16.0"):
        resolve(BASE + [f"model.path={q2}", "model.rope_scaling.beta_fast=32.0"])
    # Agreeing facts and non-architectural keys are free to set.
    m = resolve(BASE + [f"model.path={q2}", "model.num_layers=2", "model.name=mine", "model.max_model_len=512",
                        "model.dtype=float32", "model=llama3_1_8b"]).cfg.model
    # the checkpoint's rope scaling (YaRN) replaces the option's (llama3), its unset keys at their defaults
    assert (m.name, m.max_model_len, m.num_layers, m.rope_scaling.type) == ("mine", 512, 2, "yarn")
    assert (m.rope_scaling.beta_fast, m.rope_scaling.beta_slow, m.rope_scaling.low_freq_factor) == (16.0, 1.0, 1.0)
    # check=False keeps the explicit value; the loader's check still stops it.
    m = resolve(BASE + [f"model.path={q2}", "model.qkv_bias=false"], check=False).cfg.model
    hf = json.loads((q2 / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=r"model.qkv_bias=false but the checkpoint has"):
        check_checkpoint(m, hf, q2)
    check_checkpoint(resolve(BASE + [f"model.path={q2}"]).cfg.model, hf, q2)


def test_local_paths_that_cannot_be_read(tmp_path):
    with pytest.raises(ConfigError, match=rf"model.path={tmp_path}/nope: no such folder or file"):
        resolve(BASE + [f"model.path={tmp_path}/nope"])
    with pytest.raises(ConfigError, match="no such GGUF file"):
        resolve(BASE + [f"model.path={tmp_path}/x.gguf"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="folder has no config.json"):
        resolve(BASE + [f"model.path={tmp_path}/empty"])
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_layer": 2}))
    with pytest.raises(ConfigError, match="architecture GPT2LMHeadModel is not supported"):
        resolve(BASE + [f"model.path={tmp_path}/gpt2"])
    (tmp_path / "deepseek").mkdir()  # a known architecture not served yet: what it needs
    (tmp_path / "deepseek" / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "num_hidden_layers": 2,
                                                                   "architectures": ["DeepseekV3ForCausalLM"]}))
    with pytest.raises(ConfigError, match="architecture DeepseekV3ForCausalLM is not built yet: it needs multi-head "
                                          "latent attention"):
        resolve(BASE + [f"model.path={tmp_path}/deepseek"])


def test_validation_and_the_plan_read_the_architecture_registry(monkeypatch):
    """model.architecture set by hand must be served; the parallelism asked for must be one its row
    supports; the plan shows the row."""
    import dataclasses

    from appliance.config import architectures
    from appliance.config.validate import validate

    with pytest.raises(ConfigError, match="model.architecture=DeepseekV3ForCausalLM is not built yet: it needs "
                                          "multi-head latent attention"):
        resolve(BASE + ["model.architecture=DeepseekV3ForCausalLM"])
    cfg = resolve(["+profile=cpu", "model=tiny_random", "parallel.tensor_parallel_size=2"]).cfg
    assert make_plan(cfg).implementation == ("LlamaForCausalLM (llama implementation): dense; full attention; "
                                             "tensor, pipeline parallel")
    row = architectures.ARCHITECTURES["LlamaForCausalLM"]
    monkeypatch.setitem(architectures.ARCHITECTURES, "LlamaForCausalLM",
                        dataclasses.replace(row, tensor_parallel=False))
    assert ("parallel.tensor_parallel_size=2: LlamaForCausalLM has no tensor-parallel implementation yet; use "
            "parallel.tensor_parallel_size=1") in validate(cfg)
    assert "pipeline parallel" in make_plan(cfg).implementation and "tensor" not in make_plan(cfg).implementation


def test_catalog_options_and_special_paths_keep_their_numbers():
    r = resolve(["+profile=h100_bf16", "model=llama3_1_8b"])  # a hub id, not downloaded: the catalog's numbers
    assert (r.cfg.model.path, r.cfg.model.num_layers) == ("meta-llama/Llama-3.1-8B-Instruct", 32)
    plan = make_plan(r.cfg)
    assert plan.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    default = resolve(BASE).cfg.model
    assert (default.name, default.path, default.num_layers) == ("smollm2-135m-instruct", "smollm2_gguf", 30)
    assert resolve(BASE + ["model=tiny_random"]).cfg.model.name == "tiny-random-llama"


def test_gguf_facts_are_read():
    from appliance.models.gguf import gguf_config, read_gguf

    path = find_wheel_gguf()
    m = resolve(BASE + [f"model.path={path}"]).cfg.model
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.vocab_size) == (30, 576, 9, 3, 49152)
    assert m.name == "SmolLM2-135M-Instruct.Q4_1"
    catalog = resolve(BASE).cfg.model
    for key in ("architecture", "intermediate_size", "head_dim", "max_position_embeddings", "rope_theta",
                "rms_norm_eps", "tie_word_embeddings", "qkv_bias", "qk_norm", "param_count_b"):
        assert _value(m, key) == _value(catalog, key), key
    # The folder the loader converts it into passes the loader's check.
    check_checkpoint(m, gguf_config(*read_gguf(path)), path)


def test_every_served_architecture_has_an_implementation_and_a_valid_row():
    from appliance.config.architectures import ARCHITECTURES, EXPERT_LAYOUTS, NOT_BUILT, QKV_BIAS
    from appliance.models.registry import MODEL_CLASSES, model_class

    for name, row in ARCHITECTURES.items():
        assert row.name == name and row.family in MODEL_CLASSES and model_class(name) is MODEL_CLASSES[row.family]
        assert row.experts in EXPERT_LAYOUTS and row.qkv_bias in QKV_BIAS and row.attention
    assert len({a.model_type for a in ARCHITECTURES.values()}) == len(ARCHITECTURES)
    assert not set(NOT_BUILT) & set(ARCHITECTURES)
    with pytest.raises(ValueError, match="DeepseekV3ForCausalLM is not built yet: it needs multi-head latent"):
        model_class("DeepseekV3ForCausalLM")
    with pytest.raises(ValueError, match="FooForCausalLM is not supported; served: LlamaForCausalLM, "):
        model_class("FooForCausalLM")


def test_cli_plan_and_config_show_the_folder(folders, tmp_path):
    env = {"APPLIANCE_CACHE_DIR": str(tmp_path)}
    r = run_cli("plan", *BASE, f"model.path={folders['qwen2']}", "--json", env=env)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["model"] == "my-qwen2"
    assert plan["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 2
    assert plan["parameter_count"] == _checkpoint_parameters(folders["qwen2"])
    r = run_cli("plan", *BASE, f"model.path={folders['qwen2']}", env=env)
    assert r.returncode == 0, r.stderr
    assert ("architecture       Qwen2ForCausalLM: 2 layers, hidden 64, intermediate 96, 4 heads / 2 kv heads x 16, "
            "vocab 512; qkv bias") in r.stdout
    r = run_cli("config", *BASE, f"model.path={folders['qwen2']}", env=env)
    assert r.returncode == 0, r.stderr
    for line in ("num_layers: 2", "hidden_size: 64", "intermediate_size: 96", "num_heads: 4", "num_kv_heads: 2",
                 "head_dim: 16", "vocab_size: 512", "qkv_bias: true"):
        assert f"  {line}\n" in r.stdout
