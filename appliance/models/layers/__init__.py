"""The layer library the architectures are declared from (in the spirit of
vLLM's ``model_executor/layers``):

- ``linear``: the packed projections (q|k|v into ``qkv_proj``, gate|up into
  ``gate_up_proj``), which checkpoint tensor fills which rows, and the hook
  that swaps a projection for a quantized one;
- ``parallel``: tensor parallelism (column- and row-parallel projections,
  the vocabulary-parallel embedding and LM head: which rows or columns of a
  checkpoint tensor a rank holds) and the pipeline stages' hand-offs;
- ``rotary``: rotary embeddings and their scalings;
- ``norm``: RMSNorm;
- ``attention``: q/k/v, optional q/k norm, rope, the attention backend over
  the paged KV cache, the output projection;
- ``mlp``: the gated SiLU MLP;
- ``moe``: the sparse MLP: router, routing and the fused experts, expert
  parallelism.

A model file (``models/llama.py``) composes these into decoder layers.
"""
