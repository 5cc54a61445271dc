"""The implementations behind the architecture registry's ``family`` column
(``config/architectures.py``): which class builds a served architecture."""

from __future__ import annotations

from appliance.config.architectures import support
from appliance.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from appliance.models.glm4_moe import Glm4MoeForCausalLM
from appliance.models.gpt_oss import GptOssForCausalLM
from appliance.models.granite import GraniteForCausalLM
from appliance.models.llama import LlamaForCausalLM
from appliance.models.llama4 import Llama4ForCausalLM
from appliance.models.olmo2 import Olmo2ForCausalLM
from appliance.models.qwen2_moe import Qwen2MoeForCausalLM

MODEL_CLASSES: dict[str, type] = {"llama": LlamaForCausalLM, "olmo2": Olmo2ForCausalLM, "granite": GraniteForCausalLM,
                                  "gemma2": Gemma2ForCausalLM, "gemma3": Gemma3ForCausalLM, "gpt_oss": GptOssForCausalLM,
                                  "llama4": Llama4ForCausalLM, "glm4_moe": Glm4MoeForCausalLM,
                                  "qwen2_moe": Qwen2MoeForCausalLM}


def model_class(architecture: str) -> type:
    """The class that builds ``architecture``; ValueError saying why for an unserved one."""
    row, why = support(architecture)
    if row is None:
        raise ValueError(why)
    return MODEL_CLASSES[row.family]
