"""The layer library the architectures are declared from (in the spirit of
vLLM's ``model_executor/layers``):

- ``linear``: the column-, row-, merged- (gate|up) and qkv-parallel
  projections, each declaring which checkpoint tensor fills which rows and
  how ranks split it; a model's linears by the checkpoint tensors that fill
  them (``Projections``); the hook that swaps a projection for a quantized
  one;
- ``parallel``: tensor parallelism (column- and row-parallel projections,
  the vocabulary-parallel embedding and LM head: which rows or columns of a
  checkpoint tensor a rank holds) and the pipeline stages' hand-offs;
- ``vocab``: the vocabulary-parallel embedding and the LM head's logits
  gathered over the ranks;
- ``rotary``: rotary embeddings and their scalings;
- ``norm``: RMSNorm;
- ``attention``: q/k/v, optional q/k norm, rope, the attention backend over
  the paged KV cache, the output projection;
- ``mlp``: the gated MLP (SiLU; a subclass's activation);
- ``decoder``: the decoder layer, parametrized by an architecture's
  ``LayerSpec`` (norms and where they sit, attention, MLP);
- ``moe``: the sparse MLP: router, routing and the fused experts, expert
  parallelism.

A model file (``models/llama.py``) declares its ``LayerSpec`` and composes
the rest.
"""
