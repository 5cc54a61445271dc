"""Stored responses of the Responses API (``store``, ``previous_response_id``,
``GET`` / ``DELETE /v1/responses/{id}``): in this process's memory,
bounded by count and bytes (``server.responses_store_max``,
``server.responses_store_mib``; the least recently used dropped first), and
keyed by the API key's tenant as well as the id, so one key never reads,
continues or deletes another's responses."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional


@dataclass
class Stored:
    response: dict  # the response object as it was answered
    conversation: list[dict]  # the chat messages up to and including its answer (instructions left out)
    size: int


class ResponseStore:
    def __init__(self, max_responses: int, max_bytes: int):
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._items: OrderedDict[tuple[Optional[int], str], Stored] = OrderedDict()
        self.bytes = 0

    def put(self, tenant: Optional[int], response: dict, conversation: list[dict]) -> None:
        """Keep a response (one larger than the whole store is not kept)."""
        size = len(json.dumps(response)) + len(json.dumps(conversation))
        key = (tenant, response["id"])
        self.delete(tenant, response["id"])
        if size > self.max_bytes or self.max_responses < 1:
            return
        self._items[key] = Stored(response, conversation, size)
        self.bytes += size
        while len(self._items) > self.max_responses or self.bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.bytes -= old.size

    def get(self, tenant: Optional[int], response_id: str) -> Optional[Stored]:
        found = self._items.get((tenant, response_id))
        if found is not None:
            self._items.move_to_end((tenant, response_id))
        return found

    def delete(self, tenant: Optional[int], response_id: str) -> bool:
        old = self._items.pop((tenant, response_id), None)
        if old is not None:
            self.bytes -= old.size
        return old is not None

    def __len__(self) -> int:
        return len(self._items)
