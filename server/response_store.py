"""The in-memory store behind the Responses API's `previous_response_id` and `GET /v1/responses/{id}`.

A bounded LRU map: response id -> (the response object as returned, the conversation it ends as chat messages).
The conversation is what a follow-up request continues: the earlier turns' inputs and outputs, without their
`instructions` (OpenAI does not carry instructions over to the next response). Past `capacity` entries the
least recently used one is dropped; a follow-up naming it gets a 404. Lives on the server's event loop: no lock.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

DEFAULT_CAPACITY = 1024


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as the client got it (status, output, usage, ...)
    conversation: list[dict[str, Any]]  # chat messages: every turn up to and including this response's output


class ResponseStore:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        assert capacity >= 1
        self.capacity = capacity
        self._items: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()

    def put(self, rid: str, item: StoredResponse) -> None:
        self._items[rid] = item
        self._items.move_to_end(rid)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, rid: str) -> StoredResponse | None:
        item = self._items.get(rid)
        if item is not None:
            self._items.move_to_end(rid)
        return item

    def delete(self, rid: str) -> bool:
        return self._items.pop(rid, None) is not None

    def __len__(self) -> int:
        return len(self._items)
