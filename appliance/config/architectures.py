"""The architectures the appliance serves, as data: one row each, read by
checkpoint reading (``config/checkpoint.py``), validation, ``appliance plan``,
the GGUF converter, the tiny-checkpoint generator and the model loader, so an
architecture is added here and in its implementation, nowhere else.

A row names the Hugging Face ``architectures`` entry and ``model_type`` it
answers to, the implementation that builds it (``family``: a class in
``models/registry.py``), the GGUF ``general.architecture`` values that
convert to it, and its capabilities: how its layers hold experts, its q/k/v
bias and q/k norm, the parallelism it supports, the attention kinds its
layers use, whether it pools, its chat format. ``NOT_BUILT`` lists architectures people bring
that are not served yet, each with what it needs; ``support`` answers for any
name, with the reason when it is not served.

Torch-free, like the rest of ``config/``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

EXPERT_LAYOUTS = ("none", "some", "every")
QKV_BIAS = ("never", "always", "config")
ROUTINGS = ("softmax", "deepseek")


@dataclass(frozen=True)
class Architecture:
    name: str  # Hugging Face ``architectures[0]``
    model_type: str  # config.json's ``model_type``
    family: str  # the implementation that builds it (models/registry.py)
    # "none": dense; "some": sparse layers chosen by decoder_sparse_step and mlp_only_layers (Qwen3-MoE);
    # "every": every layer sparse, experts intermediate_size wide, top-k weights renormalized (Mixtral)
    experts: str = "none"
    # "config": on q, k and v where config.json's attention_bias says, never on o (GLM-4.5)
    qkv_bias: str = "never"  # "always": on q, k and v whatever config.json says (Qwen2); "never": none (a
    # checkpoint with attention_bias is refused: its output projection would carry one too)
    qk_norm: bool = False  # an RMSNorm over each head of q and k before rope...
    qk_norm_over_all_heads: bool = False  # ... or over all of q's heads at once, and all of k's (OLMo 2)
    config_qk_norm: bool = False  # the q/k norm where config.json's use_qk_norm says (qk_norm: its default)
    gguf: tuple[str, ...] = ()  # GGUF general.architecture values of its dense checkpoints
    gguf_experts: tuple[str, ...] = ()  # ... and of its checkpoints with experts
    gguf_permuted_qk: bool = False  # llama.cpp's converter interleaves its Q and K rows
    tensor_parallel: bool = True
    pipeline_parallel: bool = True
    expert_parallel: bool = True  # (a mixture of experts') experts split over ranks
    attention: tuple[str, ...] = ("full",)  # its layers' attention kinds
    # how a checkpoint's sliding_window applies: "none" (never), "every" (to every layer when set: Mistral,
    # Mixtral, Phi-3), "optional" (only with use_sliding_window, to the layers layer_types names: Qwen2/3),
    # "pattern" (to the layers layer_types names, else all but every global_every-th: Gemma)
    window: str = "none"
    global_every: int = 0  # "pattern": every global_every-th layer is global unless sliding_window_pattern says
    # Gemma's: query_pre_attn_scalar scales the attention scores, soft-capped scores and logits, its sliding
    # layers' own rope base (Gemma 3)
    gemma: bool = False
    multipliers: bool = False  # Granite's embedding, residual, attention and logit multipliers
    partial_rotary: bool = False  # rope over the first partial_rotary_factor of each head's channels (Phi-3's)
    rotary_default: float = 1.0  # ... where config.json names none (GLM-4.5's half, as transformers defaults it)
    # how its sparse layers route ("softmax": the router's softmax, Qwen3-MoE's and Mixtral's; "deepseek": sigmoid
    # scores, the bias-corrected group-limited choice, the scaling factor, shared experts, the first layers dense)
    routing: str = "softmax"
    shared_expert_gate: bool = False  # a shared expert beside the routed, its output gated per token (Qwen2-MoE)
    # gpt-oss's: q, k, v and o biased where config.json's attention_bias says, a learned attention sink per head,
    # experts of stacked weights with biases and the clamped SwiGLU, routed top-k then softmax
    gpt_oss: bool = False
    # Llama 4's: rope over interleaved channel pairs, none in its NoPE layers (which attend to everything, their
    # queries tempered by position) and chunked local attention in the others, whose q and k are L2-normed
    # (no weight); sparse layers of stacked experts that take each token scaled by its sigmoid router score,
    # beside a shared expert
    llama4: bool = False
    pooling: bool = False  # an embedding, reranking or classification head
    # how chat requests become prompts and outputs answers: "template" (the tokenizer's Jinja chat template,
    # server.reasoning_parser and server.tool_parser read the output) or "harmony" (gpt-oss's format through
    # openai-harmony: its channels carry the reasoning and the tool calls; server/harmony.py)
    chat_format: str = "template"

    @property
    def moe(self) -> bool:
        return self.experts != "none"

    def capabilities(self) -> str:
        """One line for ``appliance plan``."""
        parallel = [k for k, on in (("tensor", self.tensor_parallel), ("pipeline", self.pipeline_parallel),
                                    ("expert", self.moe and self.expert_parallel)) if on]
        experts = {"none": "dense", "some": "mixture of experts (sparse layers by step)",
                   "every": "mixture of experts (every layer sparse)"}[self.experts]
        return (f"{self.name} ({self.family} implementation): {experts}; {', '.join(self.attention)} attention; "
                + (f"{', '.join(parallel)} parallel" if parallel else "one device per engine core (no tensor or "
                   "pipeline parallelism yet)") + ("; pooling" if self.pooling else ""))


SLIDING_TOO = ("full", "sliding window")  # layers of either kind, in their own KV-cache groups (config/kv_groups.py)
CHUNKED_TOO = ("full", "chunked local")  # the same, chunked local attention beside full

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("LlamaForCausalLM", "llama", "llama", gguf=("llama",), gguf_permuted_qk=True),
    Architecture("MistralForCausalLM", "mistral", "llama", window="every", attention=SLIDING_TOO),
    Architecture("Qwen2ForCausalLM", "qwen2", "llama", qkv_bias="always", gguf=("qwen2",), window="optional", attention=SLIDING_TOO),
    Architecture("Qwen3ForCausalLM", "qwen3", "llama", qk_norm=True, gguf=("qwen3",), window="optional", attention=SLIDING_TOO),
    Architecture("Qwen3MoeForCausalLM", "qwen3_moe", "llama", experts="some", qk_norm=True, gguf_experts=("qwen3moe",),
                 window="optional", attention=SLIDING_TOO),
    # llama.cpp writes Mixtral as general.architecture=llama with experts
    # Qwen2's layers and Qwen3-MoE's routing beside a gated shared expert: layer by layer (no whole-step forward)
    Architecture("Qwen2MoeForCausalLM", "qwen2_moe", "qwen2_moe", experts="some", qkv_bias="always",
                 window="optional", attention=SLIDING_TOO, shared_expert_gate=True),
    Architecture("MixtralForCausalLM", "mixtral", "llama", experts="every", gguf_experts=("llama",),
                 gguf_permuted_qk=True, window="every", attention=SLIDING_TOO),
    # its checkpoints' q/k/v and gate/up come fused, as this implementation packs them (a tensor-parallel rank
    # reads its rows of each part: layers.parallel.fused_shard_rows)
    Architecture("Phi3ForCausalLM", "phi3", "llama", window="every", attention=SLIDING_TOO, partial_rotary=True),
    # norms after attention and MLP, q/k norms over all heads: layer by layer (no whole-step native forward)
    Architecture("Olmo2ForCausalLM", "olmo2", "olmo2", qk_norm=True, qk_norm_over_all_heads=True),
    # the Llama layers with Granite's multipliers: layer by layer (no whole-step native forward)
    Architecture("GraniteForCausalLM", "granite", "granite", multipliers=True),
    # local (sliding-window) and global layers with their own rope bases, GeGLU MLPs, norms before and after
    # attention and MLP, q/k norms, a scaled embedding: layer by layer (no whole-step native forward)
    Architecture("Gemma3ForCausalLM", "gemma3_text", "gemma3", qk_norm=True, attention=SLIDING_TOO,
                 window="pattern", global_every=6, gemma=True),
    # Gemma 3's layers without q/k norms or a local rope base, with soft-capped attention scores and logits
    Architecture("Gemma2ForCausalLM", "gemma2", "gemma2", attention=SLIDING_TOO, window="pattern", global_every=2,
                 gemma=True),
    # alternating sliding-window and full layers (config.json's layer_types), sinks, its own experts: layer by
    # layer (no whole-step native forward); a tensor-parallel rank holds every expert's slice, or with expert
    # parallelism whole experts (over one engine core's ranks: not across data-parallel cores, nor EPLB, yet)
    Architecture("GptOssForCausalLM", "gpt_oss", "gpt_oss", experts="every", attention=SLIDING_TOO,
                 window="pattern", global_every=2, gpt_oss=True, chat_format="harmony"),
    # chunked local attention in its rope layers, full in its NoPE ones (config.json's no_rope_layers), its own
    # experts and a shared expert: layer by layer (no whole-step native forward), over pipeline stages (no tensor or
    # expert parallelism yet)
    Architecture("Llama4ForCausalLM", "llama4_text", "llama4", experts="some", attention=CHUNKED_TOO, llama4=True,
                 qk_norm=True, config_qk_norm=True, tensor_parallel=False, expert_parallel=False),
    # the Llama layers with biased q/k/v, rope over half of each head and DeepSeek-V3's routing: sparse layers
    # after the first few dense ones, shared experts beside the routed (its multi-token-prediction layer not read)
    Architecture("Glm4MoeForCausalLM", "glm4_moe", "glm4_moe", experts="some", qkv_bias="config", config_qk_norm=True,
                 partial_rotary=True, rotary_default=0.5, routing="deepseek"),
)}

# Image-text checkpoints whose text model is served (their images are not built yet): a checkpoint of one reads as
# its text model's architecture (config/hf_facts.text_model_config), its image encoder's tensors left unread.
TEXT_OF: dict[str, str] = {
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
    "Llama4ForConditionalGeneration": "Llama4ForCausalLM",
}

# Architectures people bring that are not served yet, and what each needs.
NOT_BUILT: dict[str, str] = {
    **{name: f"an image encoder (a checkpoint of it serves its text model, read as {text})"
       for name, text in TEXT_OF.items()},
    "DeepseekV2ForCausalLM": "multi-head latent attention (MLA) and DeepSeek's shared experts",
    "DeepseekV3ForCausalLM": "multi-head latent attention (MLA), DeepSeek's shared experts and grouped top-k routing",
    "Qwen2VLForConditionalGeneration": "an image encoder and multimodal rotary embeddings",
    "Qwen2_5_VLForConditionalGeneration": "an image encoder and multimodal rotary embeddings",
    "LlavaForConditionalGeneration": "an image encoder and its projector",
    "BertModel": "an encoder-only model and pooling",
    "XLMRobertaModel": "an encoder-only model and pooling",
}


def by_model_type(model_type: Optional[str]) -> Optional[Architecture]:
    return next((a for a in ARCHITECTURES.values() if a.model_type == model_type), None)


def by_gguf(general_architecture: Optional[str], experts: bool) -> Optional[Architecture]:
    """The row a GGUF file converts to: its general.architecture, dense or with experts."""
    return next((a for a in ARCHITECTURES.values()
                 if general_architecture in (a.gguf_experts if experts else a.gguf)), None)


def gguf_names() -> list[str]:
    return sorted({g for a in ARCHITECTURES.values() for g in a.gguf + a.gguf_experts})


def support(name: str, subject: str = "") -> tuple[Optional[Architecture], str]:
    """(row, "") for a served architecture; (None, why) for any other name:
    what it needs where it is known, and what is served. ``subject`` names it
    in the message (default: "architecture NAME")."""
    if name in ARCHITECTURES:
        return ARCHITECTURES[name], ""
    subject = subject or f"architecture {name}"
    served = ", ".join(ARCHITECTURES)
    if name in NOT_BUILT:
        return None, f"{subject} is not built yet: it needs {NOT_BUILT[name]}; served: {served}"
    return None, f"{subject} is not supported; served: {served}"


def describe(name: str) -> str:
    """A served architecture's capabilities, or why it is not served (``appliance plan``)."""
    row, why = support(name)
    return row.capabilities() if row is not None else why


def chat_format(architecture: str) -> str:
    """An architecture's chat format (``Architecture.chat_format``; "template" for one not served)."""
    row = ARCHITECTURES.get(architecture)
    return row.chat_format if row is not None else "template"


def tool_format(architecture: str, tool_parser: str) -> str:
    """How tool calls are read from a model's output: ``server.tool_parser``, or under ``auto`` the
    architecture's own format (harmony's messages to functions.NAME; hermes for a chat template)."""
    if tool_parser != "auto":
        return tool_parser
    return "harmony" if chat_format(architecture) == "harmony" else "hermes"
