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
}


@functools.lru_cache(maxsize=None)
def hf_model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


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
