"""A KV connector's worker side: vLLM V1's calls, in the order the model
runner makes them each step (the scheduler side: ``engine/kv_connector.py``).

- ``start_load_kv(meta, kv_caches)`` before the forward: the step's
  instructions from the scheduler side are bound for the calls below, and
  the connector starts (or, synchronously, makes) its loads;
- ``wait_for_layer_load(layer)`` before layer ``layer`` reads its cache;
- ``save_kv_layer(layer, kv_cache)`` once layer ``layer`` wrote the step's
  K and V into its cache (``kv_cache``);
- ``wait_for_save()`` after the forward: what was saved layer by layer is
  complete (or handed to a background writer);
- ``get_finished()``: what finished since the last report.

On the torch path the model calls the two layer hooks inside its layer loop
(``LlamaForCausalLM.kv_layer_hooks``), so a connector that loads or saves a
layer at a time overlaps the others' compute; the native CPU forward runs
a step's layers in one call, so the runner makes them around it (every
layer's load wait before it, every layer's save after it). ``layer`` counts
the layers this rank holds (a pipeline stage's, from 0).
"""

from __future__ import annotations

from typing import Any

import torch

from appliance.engine.kv_connector import KVConnectorOutput


class KVConnectorWorker:
    """The calls' defaults: loads done in ``start_load_kv``, nothing saved per layer."""

    meta: Any = None  # the step's instructions, bound by start_load_kv

    def start_load_kv(self, meta: Any, kv_caches: list[torch.Tensor]) -> None:
        """Bind the step's instructions; a connector that loads starts (or makes) its loads here."""
        self.meta = meta

    def wait_for_layer_load(self, layer: int) -> None:
        """Layer ``layer``'s part of the step's loads is in its cache."""

    def save_kv_layer(self, layer: int, kv_cache: torch.Tensor) -> None:
        """Layer ``layer`` wrote the step's K and V into ``kv_cache``."""

    def wait_for_save(self) -> None:
        """Every layer of the step saved (or queued for a writer)."""

    def get_finished(self) -> KVConnectorOutput:
        return KVConnectorOutput()
