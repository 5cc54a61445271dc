"""A model runner: the model (or one rank's part of it) on its attention
backend, quantized as configured, with its KV cache, sampler and
speculative proposer (an n-gram lookup or a draft model of its own)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

from appliance.config.deployment import Deployment
from appliance.config.kv_groups import kv_layout
from appliance.config.sizes import attention_scale
from appliance.errors import ConfigError
from appliance.runner.kv import kv_group_specs

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def build_model_runner(deployment: Deployment, tp: Any = None, pp: Any = None,
                       ep: Any = None) -> tuple[Any, PreTrainedTokenizerBase]:
    """The model (one rank's part with ``tp``, ``pp`` and / or ``ep``), quantized as
    configured, on its attention backend, in a ``ModelRunner`` with the KV
    cache; and the tokenizer."""
    import torch

    from appliance.kernels.registry import load_backend
    from appliance.models.loader import load_model
    from appliance.models.arch import ModelArch
    from appliance.models.layers.parallel import shard_arch
    from appliance.worker.model_runner import ModelRunner

    cfg, ex = deployment.cfg, deployment.execution
    backend_name = ex.backend
    assert backend_name is not None  # composing a deployment to run refuses a host where no backend serves it
    dtype = getattr(torch, ex.dtype)
    # a tensor-parallel rank's GPU is the one its worker selected (rank_group.init_rank)
    device = torch.device(deployment.device if (tp is None and pp is None) or deployment.device == "cpu"
                          else f"cuda:{torch.cuda.current_device()}")
    m = cfg.model
    heads, kv_heads = m.num_heads, m.num_kv_heads
    if tp is not None:
        local = shard_arch(ModelArch.from_model_config(m), tp.size, expert_parallel=ep is not None)
        heads, kv_heads = local.num_heads, local.num_kv_heads
    backend = load_backend(backend_name)(heads, kv_heads, m.head_dim, attention_scale(m), ex.kv_cache_dtype,
                                       soft_cap=m.attn_logit_softcapping)
    eplb = cfg.parallel.eplb
    model, tokenizer, _ = load_model(m, backend, dtype, device, cfg.quantization.method, tp, pp, ep,
                                     eplb.num_redundant_experts if eplb.enabled else 0)
    if eplb.enabled:
        model.enable_eplb(eplb.window_size, eplb.step_interval)
    from appliance.models.loader import quantize_at_load

    quantize_at_load(model, cfg.quantization)
    if device.type != "cpu":  # int4 weights travel packed (4 bits a weight), as the GPU GEMM reads them
        from appliance.models.quant import Int4WeightOnlyLinear

        for module in model.modules():
            if isinstance(module, Int4WeightOnlyLinear):
                module.prepare_for(device, dtype)
    model.to(device)  # modules a quantization method built from host tensors
    num_blocks, mml = deployment.num_kv_blocks, deployment.max_model_len
    kv_dtype = backend.cache_dtype(ex.kv_cache_dtype, dtype)
    spec = cfg.speculative
    proposer = None
    if pp is None or pp.last:  # a pipeline stage before the last samples nothing, so it drafts nothing
        proposer = _proposer(deployment, tokenizer, dtype, kv_dtype, device)
    runner = ModelRunner(model, backend, num_blocks, cfg.cache.block_size, mml, cfg.scheduler.max_num_seqs, dtype,
                         kv_dtype, device, tokenizer.eos_token_id, seed=m.seed, proposer=proposer,
                         disable_spec_above=spec.disable_by_batch_size, bitmask_kernel=_bitmask_kernel(backend_name),
                         kv_groups=kv_group_specs(deployment),
                         layer_placement=kv_layout(m, mml).placement())
    return runner, tokenizer


def _proposer(deployment: Deployment, tokenizer: Any, dtype: Any, kv_dtype: Any, device: Any) -> Any:
    """Speculative decoding's proposer (``speculative.method``), or None."""
    cfg, mml = deployment.cfg, deployment.max_model_len
    spec = cfg.speculative
    if spec.method == "ngram":
        from appliance.worker.spec_decode import NgramProposer

        lo, hi = spec.prompt_lookup_min, spec.prompt_lookup_max
        assert lo is not None and hi is not None  # resolving fills either from the other, or both (compose.py)
        return NgramProposer(spec.num_speculative_tokens, lo, hi, mml)
    if spec.method == "draft_model":
        return _draft_proposer(cfg, deployment.execution, tokenizer, deployment.num_kv_blocks, dtype, kv_dtype,
                               device, mml)
    return None


def _bitmask_kernel(backend: str) -> Optional[Callable]:
    """The kernel that masks constrained logits rows (sampling runs on host
    logits): the native one where the native kernels are loaded, else None
    (xgrammar's)."""
    if backend != "cpu_native":
        return None
    from appliance.kernels.cpu_native import apply_token_bitmask

    return apply_token_bitmask


def prepare_draft(cfg: Any) -> None:
    """The draft model's folder made (converted or generated) before the ranks
    start, which each hold the whole draft and would race to make it."""
    if cfg.speculative.method != "draft_model":
        return
    from appliance.models.loader import resolve_model_folder

    resolve_model_folder(draft_config(cfg))


def draft_config(cfg: Any) -> Any:
    """The draft model's config, or ConfigError with why it cannot be had."""
    from appliance.config.draft import draft_model_config

    d, problems = draft_model_config(cfg)
    if d is None or problems:
        raise ConfigError("; ".join(problems))
    return d


def _draft_proposer(cfg: Any, ex: Any, tokenizer: Any, num_blocks: int, dtype: Any, kv_dtype: Any, device: Any,
                    mml: int):
    """The draft model on its own backend instance and KV cache (the target's
    blocks), checked to read the target's tokens."""
    import torch

    from appliance.kernels.registry import load_backend
    from appliance.models.loader import load_model
    from appliance.worker.draft_proposer import DraftModelProposer

    spec = cfg.speculative
    d = draft_config(cfg)
    # K/V of the draft's own dtype, unless the cache is set to another element type (fp8, bf16)
    kv_name = "auto" if cfg.cache.kv_cache_dtype == "auto" else ex.kv_cache_dtype
    backend = load_backend(ex.backend)(d.num_heads, d.num_kv_heads, d.head_dim, attention_scale(d), kv_name)
    if spec.draft_dtype != "auto":
        dtype = getattr(torch, spec.draft_dtype)
        kv_dtype = backend.cache_dtype(kv_name, dtype)
    model, draft_tokenizer, _ = load_model(d, backend, dtype, device)
    if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ConfigError(f"speculative.draft_model={spec.draft_model}: its tokenizer's vocabulary differs from the "
                          f"target's; a draft must share the target's tokenizer")
    model.to(device)
    return DraftModelProposer(model, backend, spec.num_speculative_tokens, mml, num_blocks, cfg.cache.block_size,
                              dtype, kv_dtype, device, cfg.scheduler.max_num_batched_tokens)
