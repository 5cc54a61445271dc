"""Image-text checkpoints whose text model is served (Gemma 3's and Llama 4's): read as the text architecture
with transformers' defaults for what their text_config leaves out, the image encoder's tensors left unread, and
text generated token for token as transformers' image-text model generates it."""

import shutil

import pytest
import torch

from appliance import LLM, SamplingParams
from appliance.config.compose import resolve
from appliance.config.hf_facts import hf_facts
from appliance.errors import ConfigError
from appliance.models.llama import text_model_name
from appliance.models.loader import resolve_model_folder
from tests.model_helpers import PROMPTS, TINY_VARIANTS

GEMMA3_4B = {  # google/gemma-3-4b-it's config.json: its text_config names only what differs from the defaults
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "boi_token_index": 255999,
    "eoi_token_index": 256000, "image_token_index": 262144, "mm_tokens_per_image": 256,
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                      "patch_size": 14, "vision_use_head": False},
}


def test_an_image_text_config_reads_as_its_text_model():
    facts, problems = hf_facts(GEMMA3_4B)
    got = {f.key: f.value for f in facts}
    assert not problems
    assert got["architecture"] == "Gemma3ForCausalLM" and "images not built yet" in next(
        f.source for f in facts if f.key == "architecture")
    # transformers' Gemma 3 text defaults, and the older rope_scaling read as its global layers' (linear x8)
    assert (got["num_heads"], got["num_kv_heads"], got["head_dim"], got["vocab_size"]) == (8, 4, 256, 262208)
    assert (got["rope_scaling.type"], got["rope_scaling.factor"], got["rope_theta"]) == ("linear", 8.0, 1e6)
    assert got["rope_local_theta"] == 10000.0 and got["sliding_window"] == 1024
    assert got["layer_types"][:6] == ["sliding_attention"] * 5 + ["full_attention"] and len(got["layer_types"]) == 34
    with pytest.raises(ConfigError, match="a checkpoint of it serves its text model, read as Gemma3ForCausalLM"):
        resolve(["+profile=cpu", "model=tiny_random", "model.architecture=Gemma3ForConditionalGeneration"])


LLAMA4_SCOUT_TEXT = {  # meta-llama/Llama-4-Scout-17B-16E-Instruct's text_config (its switch written as a number)
    "attention_chunk_size": 8192, "attn_scale": 0.1, "attn_temperature_tuning": 4, "floor_scale": 8192,
    "head_dim": 128, "hidden_size": 5120, "interleave_moe_layer_step": 1, "intermediate_size": 8192,
    "intermediate_size_mlp": 16384, "max_position_embeddings": 10485760, "model_type": "llama4_text",
    "no_rope_layers": [], "num_attention_heads": 40, "num_experts_per_tok": 1, "num_hidden_layers": 48,
    "num_key_value_heads": 8, "num_local_experts": 16, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "use_qk_norm": True, "vocab_size": 202048,
}


def test_llama4_scouts_config_reads_as_its_text_model():
    hf = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "tie_word_embeddings": False,
          "text_config": LLAMA4_SCOUT_TEXT, "vision_config": {"model_type": "llama4_vision_model"}}
    facts, problems = hf_facts(hf)
    got = {f.key: f.value for f in facts}
    assert not problems and got["architecture"] == "Llama4ForCausalLM"
    assert got["nope_layers"] == list(range(3, 48, 4)) and got["attention_chunk_size"] == 8192
    assert (got["attn_temperature_floor_scale"], got["attn_temperature_scale"]) == (8192, 0.1)
    assert (got["num_experts"], got["moe_intermediate_size"], got["intermediate_size"]) == (16, 8192, 16384)
    assert (got["rope_scaling.type"], got["rope_scaling.factor"], got["tie_word_embeddings"]) == ("llama3", 8.0, False)
    broken = {**hf, "text_config": {**LLAMA4_SCOUT_TEXT, "num_hidden_layers": "many"}}
    assert "cannot read Llama4ForConditionalGeneration's text_config" in hf_facts(broken)[1][0]


def test_the_image_encoders_tensors_are_not_read():
    assert text_model_name("model.language_model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert text_model_name("language_model.model.norm.weight") == "model.norm.weight"
    assert text_model_name("language_model.lm_head.weight") == "lm_head.weight"
    assert text_model_name("lm_head.weight") == "lm_head.weight"
    for name in ("model.vision_tower.vision_model.embeddings.patch_embedding.weight",
                 "vision_model.model.layers.0.mlp.fc1.weight", "multi_modal_projector.linear_1.weight",
                 "model.multi_modal_projector.mm_input_projection_weight"):
        assert text_model_name(name) is None


def _image_text_model(variant: str, text):
    """transformers' image-text model around the tiny text model ``text`` (its weights), a tiny random encoder."""
    if variant == "gemma3":
        from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

        vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                    image_size=28, patch_size=14)
        model = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text.config.to_dict(), vision_config=vision,
                                                            mm_tokens_per_image=4))
        model.model.language_model.load_state_dict(text.model.state_dict())
        model.lm_head.load_state_dict(text.lm_head.state_dict())
        return model
    from transformers import Llama4Config, Llama4ForConditionalGeneration, Llama4VisionConfig

    vision = Llama4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14, vision_output_dim=16, projector_input_dim=16,
                                projector_output_dim=16)
    model = Llama4ForConditionalGeneration(Llama4Config(text_config=text.config.to_dict(), vision_config=vision))
    model.language_model.load_state_dict(text.state_dict())
    return model


@pytest.mark.parametrize("variant", ["gemma3", "llama4"])
def test_an_image_text_checkpoint_serves_its_text_model(tmp_path, variant):
    from transformers import AutoModelForCausalLM

    text_folder = resolve_model_folder(resolve(["+profile=cpu", "model=tiny_random", *TINY_VARIANTS[variant]]).cfg.model)
    text = AutoModelForCausalLM.from_pretrained(str(text_folder), dtype=torch.float32).eval()
    reference = _image_text_model(variant, text).eval()
    reference.save_pretrained(str(tmp_path))
    for f in text_folder.glob("tokenizer*"):
        shutil.copy(f, tmp_path)
    llm = LLM(overrides=["+profile=cpu", f"model.path={tmp_path}", "model.dtype=float32"])
    assert llm.deployment.cfg.model.architecture == text.config.architectures[0]
    for prompt in PROMPTS[:4]:
        ids = llm.tokenizer.encode(prompt)
        with torch.no_grad():
            want = reference.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                                      eos_token_id=None)[0, len(ids):].tolist()
        out = llm.generate([ids], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
        assert list(out[0].outputs[0].token_ids) == want, prompt
