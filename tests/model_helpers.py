"""Reference generations from Hugging Face transformers for parity tests."""

import functools

import torch

from appliance import LLM
from appliance.models.loader import resolve_model_folder

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France?",
    "Paged attention stores keys and values in fixed-size blocks. A scheduler hands out tokens",
    "def main():",
    "Numbers: 0 1 2 3 4 5 6 7 8 9",
    "café naïve résumé",
    "A scheduler hands out tokens under one budget every step. Paged attention stores keys and values in "
    "fixed-size blocks. The quick brown fox jumps over the lazy dog. What is the capital of France?",
    "<|im_start|>user\nHello<|im_end|>",
]

TINY_VARIANTS = {
    "llama": [],
    "qwen2": ["model.architecture=Qwen2ForCausalLM", "model.qkv_bias=true"],
    "qwen3": ["model.architecture=Qwen3ForCausalLM", "model.qk_norm=true"],
    # Llama 3 rope scaling with a short original context, so every frequency band is exercised.
    "llama3_rope": ["model.rope_scaling.type=llama3", "model.rope_scaling.factor=8.0",
                    "model.rope_scaling.original_max_position_embeddings=32", "model.rope_theta=500000.0"],
    # YaRN (Qwen2.5's long-context scaling): a ramp over the first dimensions, cos/sin scaled by 0.1 ln 4 + 1
    "yarn_rope": ["model.rope_scaling.type=yarn", "model.rope_scaling.factor=4.0",
                  "model.rope_scaling.original_max_position_embeddings=256"],
    # Phi-3: fused q/k/v and gate/up checkpoint tensors, a sliding window in every layer shorter than most prompts
    "phi3": ["model.architecture=Phi3ForCausalLM", "model.sliding_window=20"],
    # Phi-4-mini's form: LongRoPE over 3/4 of each head (12 of 16 channels), a 24-token original context, so
    # short prompts decode across it (computed again on the long factors there) and long ones take them
    # throughout; cos/sin scaled by sqrt(1 + ln 4 / ln 24)
    "phi4_mini": ["model.architecture=Phi3ForCausalLM", "model.partial_rotary_factor=0.75",
                  "model.rope_scaling.type=longrope", "model.rope_scaling.factor=4.0",
                  "model.rope_scaling.original_max_position_embeddings=24",
                  "model.rope_scaling.short_factor=[1.0,1.1,1.3,1.6,2.0,2.6]",
                  "model.rope_scaling.long_factor=[1.0,1.4,2.2,3.5,5.0,7.1]"],
    # Qwen2's use_sliding_window: a full-attention layer and a sliding one, two KV-cache groups
    "qwen2_window": ["model.architecture=Qwen2ForCausalLM", "model.qkv_bias=true", "model.sliding_window=12",
                     "model.layer_types=[full_attention,sliding_attention]"],
    # Gemma 3: a local layer (a 12-token window, its own rope base) and a global one, GeGLU, 1 + weight norms
    # before and after attention and MLP, q/k norms, a scaled embedding, query_pre_attn_scalar
    "gemma3": ["model.architecture=Gemma3ForCausalLM", "model.qk_norm=true", "model.sliding_window=12",
               "model.layer_types=[sliding_attention,full_attention]", "model.query_pre_attn_scalar=24",
               "model.rope_theta=1000000.0", "model.rope_local_theta=10000.0"],
    # Gemma 2: alternating local and global layers (one rope base), soft-capped attention scores and logits
    "gemma2": ["model.architecture=Gemma2ForCausalLM", "model.sliding_window=12",
               "model.layer_types=[sliding_attention,full_attention]", "model.query_pre_attn_scalar=24",
               "model.attn_logit_softcapping=1.5", "model.final_logit_softcapping=3.0"],
    # OLMo 2: norms after attention and MLP, q/k norms over all heads (layer by layer, no whole-step forward)
    "olmo2": ["model.architecture=Olmo2ForCausalLM", "model.qk_norm=true"],
    # gpt-oss: a sliding layer (12-token window) and a full one, sinks, biased q/k/v and o, 4 experts (top 2) with
    # biases and the clamped SwiGLU (a limit of 0.3, so the clamps bind), a biased router (layer by layer)
    "gpt_oss": ["model.architecture=GptOssForCausalLM", "model.qkv_bias=true", "model.sliding_window=12",
                "model.layer_types=[sliding_attention,full_attention]", "model.num_experts=4",
                "model.num_experts_per_tok=2", "model.intermediate_size=48", "model.moe_intermediate_size=48",
                "model.swiglu_limit=0.3", "model.swiglu_alpha=1.702"],
    # Llama 4: a rope layer attending in 16-token chunks (q/k L2-normed) with a dense MLP, and a NoPE layer of
    # full attention (queries tempered from position 3 on) with 4 experts (top 2, sigmoid scores on the input)
    # beside a shared expert; interleaved rope pairs (layer by layer)
    "llama4": ["model.architecture=Llama4ForCausalLM", "model.qk_norm=true", "model.attention_chunk_size=16",
               "model.layer_types=[chunked_attention,full_attention]", "model.nope_layers=[1]",
               "model.attn_temperature_floor_scale=4", "model.attn_temperature_scale=0.1", "model.num_experts=4",
               "model.num_experts_per_tok=2", "model.moe_intermediate_size=48",
               "model.shared_expert_intermediate_size=48", "model.decoder_sparse_step=2",
               "model.norm_topk_prob=false"],
    # GLM-4.5: a dense layer, then a sparse one routing as DeepSeek-V3 (sigmoid scores corrected by a random bias,
    # 2 of 4 groups of 2 experts, top 2 renormalized and scaled) beside a shared expert; biased q/k/v, q/k norms,
    # rope over half of each head (layer by layer)
    "glm4_moe": ["model.architecture=Glm4MoeForCausalLM", "model.qkv_bias=true", "model.qk_norm=true",
                 "model.partial_rotary_factor=0.5", "model.num_experts=8", "model.num_experts_per_tok=2",
                 "model.moe_intermediate_size=32", "model.shared_expert_intermediate_size=32",
                 "model.mlp_only_layers=[0]", "model.scoring_func=sigmoid", "model.n_group=4", "model.topk_group=2",
                 "model.routed_scaling_factor=2.5"],
    # Qwen2-MoE: a dense layer, then 4 experts (top 2, softmax, not renormalized) beside a shared expert gated per
    # token (layer by layer)
    "qwen2_moe": ["model.architecture=Qwen2MoeForCausalLM", "model.qkv_bias=true", "model.num_experts=4",
                  "model.num_experts_per_tok=2", "model.moe_intermediate_size=32",
                  "model.shared_expert_intermediate_size=48", "model.norm_topk_prob=false", "model.mlp_only_layers=[0]"],
    # Granite: multipliers on the embedding, the residual branches, the attention scores and the logits
    "granite": ["model.architecture=GraniteForCausalLM", "model.embedding_multiplier=12.0",
                "model.residual_multiplier=0.22", "model.attention_multiplier=0.0625", "model.logits_scaling=8.0"],
}
# the variants the native whole-step forward runs
NATIVE_VARIANTS = [v for v in TINY_VARIANTS
                   if v not in ("olmo2", "granite", "gemma2", "gemma3", "gpt_oss", "llama4", "glm4_moe", "qwen2_moe")]


@functools.lru_cache(maxsize=None)
def hf_model(folder, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def hf_greedy(llm: LLM, prompt_ids, max_new_tokens):
    """HF generate() for one prompt alone; stops at eos like the engine does."""
    folder = str(resolve_model_folder(llm.resolved.cfg.model))
    return _hf_greedy(folder, tuple(prompt_ids), max_new_tokens, llm.tokenizer.eos_token_id)


@functools.lru_cache(maxsize=None)
def _hf_greedy(folder, prompt_ids, max_new_tokens, eos):
    model = hf_model(folder)
    ids = torch.tensor([list(prompt_ids)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=eos, pad_token_id=eos)
    return out[0, ids.shape[1]:].tolist()


def hf_logprobs(llm: LLM, token_ids):
    folder = str(resolve_model_folder(llm.resolved.cfg.model))
    with torch.no_grad():
        logits = hf_model(folder)(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def hf_greedy_top_logprobs(llm: LLM, prompt_ids, max_new_tokens, k, dtype):
    """HF greedy generate() in ``dtype``: (tokens, per step {token: logprob} of the top ``k``)."""
    folder = str(resolve_model_folder(llm.resolved.cfg.model))
    return _hf_greedy_top(folder, tuple(prompt_ids), max_new_tokens, llm.tokenizer.eos_token_id, k, dtype)


@functools.lru_cache(maxsize=None)
def _hf_greedy_top(folder, prompt_ids, max_new_tokens, eos, k, dtype):
    model = hf_model(folder, dtype)
    ids = torch.tensor([list(prompt_ids)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    tops = []
    for logits in out.logits:
        top = torch.topk(torch.log_softmax(logits[0].float(), dim=-1), k)
        tops.append(dict(zip(top.indices.tolist(), top.values.tolist())))
    return tokens, tops


def check_logprobs_close(ours, ref, name_ours="ours", name_ref="hf"):
    """Greedy outputs of two runs at reduced precision agree the way vLLM's
    tests accept: token for token, or, from the first step where they
    diverge, each side's token is among the other's top candidates (the
    rest of the sequence is then not compared: the contexts differ)."""
    for i, ((toks_a, tops_a), (toks_b, tops_b)) in enumerate(zip(ours, ref)):
        for step, (a, b) in enumerate(zip(toks_a, toks_b)):
            if a == b:
                continue
            assert a in tops_b[step], (f"prompt {i} step {step}: {name_ours} chose {a}, not in {name_ref}'s top "
                                       f"{sorted(tops_b[step], key=tops_b[step].get, reverse=True)}")
            assert b in tops_a[step], (f"prompt {i} step {step}: {name_ref} chose {b}, not in {name_ours}'s top "
                                       f"{sorted(tops_a[step], key=tops_a[step].get, reverse=True)}")
            break
        else:
            n = min(len(toks_a), len(toks_b))
            assert toks_a[:n] == toks_b[:n]


def greedy_top_logprobs(llm: LLM, prompt_ids, max_new_tokens, k):
    """Our greedy outputs as (tokens, per step {token: logprob} of the top ``k``)."""
    from appliance import SamplingParams

    outs = llm.generate(prompt_ids, SamplingParams(max_tokens=max_new_tokens, temperature=0, logprobs=k),
                        use_tqdm=False)
    return [(o.outputs[0].token_ids, [dict(lp.top) for lp in o.outputs[0].logprobs]) for o in outs]


CAPITAL_OF_FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
# The question above opens its answer with 'The' only 0.08 nats ahead of "L'" in fp32 (``paris_margin``): where
# the CPU rounds the GGUF GEMMs' rows to int8 (AVX512-VNNI without AMX) the default deployment opens with
# "L'Étoile, ..." and never names the city. Asked for one word, 'The' leads by 1.3 nats on every path.
CAPITAL_ONE_WORD = "What is the capital of France? Answer in one word."


def paris_margin(llm: LLM) -> float:
    """How many nats ``llm`` puts ' Paris' above its next best token when
    the chat turn CAPITAL_OF_FRANCE is answered up to 'The capital of France
    is' (the fp32 model's greedy answer, whose ' Paris' leads by 4.7 nats):
    positive when Paris is its greedy choice there.

    A quantized model's own greedy answer is not compared: the fp32 model
    opens it with 'The' only 0.08 nats ahead of "L'", less than a 3-bit
    mantissa's error, so which opening fp8 W8A8 picks follows the last bits
    of the host's fp32 GEMMs (AVX-512 and AVX2 pick differently). Given the
    answer's opening, the fact is decided by a margin far above that error."""
    from appliance import SamplingParams

    tok = llm.tokenizer
    prompt = tok.apply_chat_template(CAPITAL_OF_FRANCE, add_generation_prompt=True, tokenize=False)
    answer = tok.encode("The capital of France is Paris", add_special_tokens=False)
    assert tok.decode(answer[-1:]) == " Paris"
    ids = tok.encode(prompt) + answer
    paris = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2),
                         use_tqdm=False)[0].prompt_logprobs[-1]
    return paris.logprob - max(lp for t, lp in paris.top if t != paris.token_id)


def write_fp8_checkpoint(plain, folder, block: int = 0) -> dict:
    """The model in folder ``plain`` as an fp8 checkpoint in ``folder``: e4m3
    projections with per-tensor weight scales and static input scales, as
    llm-compressor / vLLM's fp8 format stores them; with ``block``, scales
    per [block, block] block (``weight_scale_inv``) and dynamic activations,
    as DeepSeek-V3 / Qwen3 FP8 store them. Returns the stored tensors."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from appliance.models.fp8 import FP8, FP8_MAX
    from appliance.models.int4_checkpoints import CHECKPOINT_PROJECTIONS

    tensors = load_file(str(plain / "model.safetensors"))
    shutil.copytree(plain, folder)
    out = dict(tensors)
    for i, name in enumerate(sorted(tensors)):
        if name.rsplit(".", 2)[-2] not in CHECKPOINT_PROJECTIONS:
            continue
        w = tensors[name].float()
        if block:
            n, k = w.shape
            blocks = w.reshape(n // block, block, k // block, block)
            scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
            out[name] = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(n, k)
            out[name + "_scale_inv"] = scale
            continue
        scale = w.abs().max() / 448
        out[name] = (w / scale).clamp(-448, 448).to(FP8)
        out[name[: -len("weight")] + "weight_scale"] = scale.reshape(())
        out[name[: -len("weight")] + "input_scale"] = torch.tensor(0.01 * (1 + i % 3))
    save_file(out, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = ({"quant_method": "fp8", "activation_scheme": "dynamic",
                                      "weight_block_size": [block, block]} if block else
                                     {"quant_method": "fp8", "activation_scheme": "static"})
    (folder / "config.json").write_text(json.dumps(config))
    return out
