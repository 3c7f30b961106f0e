"""Which engine replica serves a request: the one most likely to hold its prompt prefix in
its KV cache, unless that replica is busier than the least busy one by more than a
threshold, in which case the least busy one wins. A Ray Serve RequestRouter on Serve's
public API (ray.serve.request_router).

Ray ships a router of this kind, `ray.serve.llm.request_router.PrefixCacheAffinityRouter`,
but only with the `ray[llm]` extra (it imports vLLM's dependencies, pyarrow first), and
it keeps its prefix tree in a separate actor that it calls with blocking `ray.get` from
the routing loop. This one keeps its table in the router, in the ingress process.

A prompt becomes prefix keys (`prefix_keys`): chained hashes of its leading chunks of
CHUNK_CHARS characters, a chat message by message, so key i stands for everything up
to the end of chunk i. A chat's next turn repeats the earlier messages, so its keys
start with the earlier turn's: the turns of one conversation keep their replica. The
router remembers, per key, the replica it last chose for that key (least recently used
keys are forgotten past `max_keys`); the replica owning the longest run of a request's
keys is where its prefix is cached. A prompt nobody has seen goes to the least busy
replica, ties to the one that owns the fewest keys, so new prefixes spread out.

A request counts as in flight on its replica from the moment `choose_replicas` picks it,
before any other choice is made: Serve only reports the routing (`on_request_routed`)
after the replica has accepted, a round trip later, and a burst of requests chosen on
counts taken before then would all go to the prefix's replica. Serve may still send the
request to a lower rank (the first replica was at `max_ongoing_requests`); the count moves
there when it reports the routing. The count is released when the request completes (or
is rejected, or fails), or, for a request cancelled before it was sent, at the next choice.
"""
from __future__ import annotations

import hashlib
import logging
from collections import Counter, OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

logger = logging.getLogger(__name__)
CHUNK_CHARS = 64  # about 16 tokens: one KV block of the default block size
MAX_KEYS_PER_PROMPT = 1024
DEFAULT_MAX_KEYS = 1 << 18
DEFAULT_IMBALANCE_THRESHOLD = 4


def prefix_keys(body: Any) -> tuple[int, ...]:
    """The prefix keys of a completions or chat completions body (parsed JSON); () when it
    has no prompt we can read (the replica will answer it with the proper error)."""
    keys: list[int] = []
    digest = b""
    for role, text in _prompt_parts(body):
        for start in range(0, max(len(text), 1), CHUNK_CHARS):
            chunk = text[start:start + CHUNK_CHARS]
            digest = hashlib.blake2b(digest + role.encode() + b"\0" + chunk.encode("utf-8", "replace"),
                                     digest_size=8).digest()
            keys.append(int.from_bytes(digest, "big"))
            if len(keys) == MAX_KEYS_PER_PROMPT:
                return tuple(keys)
    return tuple(keys)


def _prompt_parts(body: Any) -> list[tuple[str, str]]:
    """(role, text) per chat message, or ("", text) for a completions prompt (the first
    one of a list: a batch lands on one replica)."""
    if not isinstance(body, dict):
        return []
    messages = body.get("messages")
    if isinstance(messages, list):
        return [(str(m.get("role", "")), _content_text(m.get("content"))) for m in messages if isinstance(m, dict)]
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list):  # token ids
        prompt = ",".join(str(token) for token in prompt)
    return [("", prompt)] if isinstance(prompt, str) else []


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""


def _keys_of(request: PendingRequest | None) -> tuple[int, ...]:
    if request is None or not request.args:
        return ()
    keys = getattr(request.args[0], "prefix_keys", ())
    return keys if isinstance(keys, tuple) else ()


class PrefixAffinityRouter(RequestRouter):
    """See the module's docstring. `imbalance_threshold`: how many more requests in flight
    the prefix's replica may have than the least busy one and still get the request."""

    def initialize_state(self, imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD,
                         max_keys: int = DEFAULT_MAX_KEYS, **kwargs: Any) -> None:
        if kwargs:
            raise ValueError(f"PrefixAffinityRouter: unknown options {sorted(kwargs)}")
        self.imbalance_threshold = imbalance_threshold
        self.max_keys = max_keys
        self.owners: OrderedDict[int, ReplicaID] = OrderedDict()
        self.keys_owned: Counter[ReplicaID] = Counter()
        self.in_flight: Counter[ReplicaID] = Counter()
        self.routed: dict[str, ReplicaID] = {}  # internal request id -> where it is counted, until it completes
        self.unsent: dict[str, PendingRequest] = {}  # chosen, not yet reported routed: may be cancelled unsent

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """Ranks of one replica each, best first; Serve takes the first that has room. The
        first is counted as this request's replica at once (no await in here: the choice
        and the count are one step of the event loop)."""
        self.release_cancelled()
        if pending_request is not None:
            self.release(pending_request.metadata.internal_request_id)  # a retry: not busy with itself
        ranks = self.rank(candidate_replicas, _keys_of(pending_request))
        if pending_request is not None and ranks:
            self.count(pending_request, ranks[0].replica_id)
            self.unsent[pending_request.metadata.internal_request_id] = pending_request
        return [[replica] for replica in ranks]

    def rank(self, candidates: list[RunningReplica], keys: tuple[int, ...]) -> list[RunningReplica]:
        """Least busy first, unless the prefix's replica is within the threshold of it."""
        by_load = sorted(candidates, key=lambda r: (self.in_flight[r.replica_id], self.keys_owned[r.replica_id]))
        owner = self.cached_at(keys, {r.replica_id for r in candidates})
        if owner is not None and by_load:
            excess = self.in_flight[owner] - self.in_flight[by_load[0].replica_id]
            if excess <= self.imbalance_threshold:
                by_load.sort(key=lambda r: r.replica_id != owner)  # stable: the others keep their order
        return by_load

    def cached_at(self, keys: tuple[int, ...], candidates: set[ReplicaID]) -> ReplicaID | None:
        """The candidate that was sent the longest run of these keys, if any."""
        owner = None
        for key in keys:
            replica = self.owners.get(key)
            if replica is None:
                break
            if replica in candidates:
                owner = replica
        return owner

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """The replica accepted the request: its count stays, or moves here from the rank
        `choose_replicas` put first."""
        request_id = pending_request.metadata.internal_request_id
        self.unsent.pop(request_id, None)
        if self.routed.get(request_id) != replica_id:
            self.release(request_id)
            self.count(pending_request, replica_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """Ended, failed or rejected. A count already moved elsewhere (a retry chosen before
        this callback ran) stays."""
        if self.routed.get(internal_request_id) == replica_id:
            self.release(internal_request_id)

    def count(self, pending_request: PendingRequest, replica_id: ReplicaID) -> None:
        self.routed[pending_request.metadata.internal_request_id] = replica_id
        self.in_flight[replica_id] += 1
        for key in _keys_of(pending_request):  # the next request with this prefix follows it
            self.remember(key, replica_id)

    def release(self, request_id: str) -> None:
        self.unsent.pop(request_id, None)
        replica_id = self.routed.pop(request_id, None)
        if replica_id is None:
            return
        if self.in_flight[replica_id] > 1:
            self.in_flight[replica_id] -= 1
        else:  # dropped at zero, so a replica `forget_gone` dropped gets no counter back
            self.in_flight.pop(replica_id, None)

    def release_cancelled(self) -> None:
        """Requests whose caller gave up before Serve sent them: Serve tells the router nothing."""
        for request_id in [rid for rid, request in self.unsent.items() if request.future.cancelled()]:
            self.release(request_id)

    def remember(self, key: int, replica_id: ReplicaID) -> None:
        self.disown(self.owners.pop(key, None))
        self.owners[key] = replica_id
        self.keys_owned[replica_id] += 1
        if len(self.owners) > self.max_keys:
            self.disown(self.owners.popitem(last=False)[1])

    def disown(self, replica_id: ReplicaID | None) -> None:
        if replica_id is not None and replica_id in self.keys_owned:  # not one forget_gone dropped
            self.keys_owned[replica_id] -= 1

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.forget_gone({r.replica_id for r in replicas})

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.forget_gone(set(self.curr_replicas))

    def forget_gone(self, alive: set[ReplicaID]) -> None:
        """Counters of replicas that are gone; their keys are skipped by `cached_at` and
        age out of the table."""
        for counter in (self.in_flight, self.keys_owned):
            for replica_id in [r for r in counter if r not in alive]:
                del counter[replica_id]
