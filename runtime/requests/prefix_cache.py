"""The prefix cache: the keys and values of prefixes computed for earlier requests, kept across requests, so that a
prompt that requests repeat (a few-shot classifier, a judge's rubric, a reranker's template, a query paged over
several requests) is computed once.

An entry is one shared context as the scorer computed it (runtime.requests.scorer: `prefill_context`'s keys and
values, [layers, context bucket, kv heads, head dim] each, on the device), for one token prefix; or a prompt read at
every position (runtime.requests.prompt_rows: `token_logprobs_context`'s keys and values and its per-position
outputs, which only prompts read at every position use). It is found by a
hash chained over fixed blocks of BLOCK tokens, seeded with the adapter and the request's `cache_salt`: each of its
block boundaries, and its own length, is a key. A request reuses the longest cached run of its leading tokens, up to
where its rows are read: the longest key it shares with an entry, then on through the entry's own tokens as far as
they agree (a few-shot prompt that ends inside a block, followed by each request's own text, is found whole once one
request has kept it with its text). It scores the rest after it (the `hidden_after_context` programs, with the
context's length the hit's), or computes its query past it once and keeps the longer prefix (`extend_context`, a
new entry in a copy of the hit's context bucket): keys and values are causal, so an entry's first n positions are
the keys and values of any prompt that shares those n tokens. With batch-invariant kernels (runtime.model.invariant:
keys in fixed blocks at absolute positions) the cascade is one pass over the whole sequence bit for bit, so a hit, a
partial hit, an extended hit and a miss give the same bits. Entries are evicted least recently used to stay within
the byte budget (SCOREFN_PREFIX_CACHE_BYTES); a device batch that reads an evicted entry holds its arrays until it is
done. Pure Python and NumPy (the arrays are the scorer's).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import threading
import time
from typing import Any, Sequence

import numpy as np

# Tokens per block: the invariant attention's key block (runtime.model.invariant.KEY_BLOCK).
BLOCK = 64
# The shortest prefix a request of one sequence computes apart so that it enters the cache: shorter ones are cheap to
# compute again, and each costs a device batch of its own.
MIN_TOKENS = 4 * BLOCK


@dataclasses.dataclass(frozen=True)
class Hit:
    """A cached context usable for `length` leading tokens: its keys and values and the context bucket they fill, and
    its per-position outputs when a prompt read at every position kept it (`_Entry.positions`)."""
    length: int
    kv: tuple[Any, Any]
    context: int
    positions: tuple[Any, ...] | None = None


@dataclasses.dataclass
class _Entry:
    kv: tuple[Any, Any]
    context: int
    nbytes: int  # of its keys and values, and of its per-position outputs
    keys: list[bytes]
    tokens: np.ndarray  # the prefix it holds, int64
    # A prompt read at every position (/v1/completions' echo): its next-token log-probabilities, top ids and top
    # log-probabilities ([1, context], [1, context, k] twice), which a later prompt that shares its tokens reads for
    # them; None for a context computed for its keys and values only.
    positions: tuple[Any, ...] | None = None


def _seed(adapter: int, salt: str | None) -> bytes:
    """Adapters never share blocks with the base model or each other, salts never with another salt or none."""
    return hashlib.blake2b(repr((adapter, salt)).encode(), digest_size=16).digest()


def _keys(tokens: Sequence[int], length: int, adapter: int, salt: str | None) -> list[tuple[int, bytes]]:
    """(length, key) of every block boundary of tokens[:length], then of its exact length when that ends inside a
    block: a hash chained over the blocks, from the seed; an exact length's key is its last boundary's and the rest,
    marked apart from a boundary's."""
    keys, h = [], _seed(adapter, salt)
    array = np.asarray(tokens[:length], np.int64)
    for end in range(BLOCK, length + 1, BLOCK):
        h = hashlib.blake2b(h + array[end - BLOCK:end].tobytes(), digest_size=16).digest()
        keys.append((end, h))
    if length % BLOCK:
        rest = array[len(keys) * BLOCK:].tobytes()
        keys.append((length, hashlib.blake2b(b"tail" + h + rest, digest_size=16).digest()))
    return keys


class PrefixCache:
    """Contexts' keys and values by token prefix, least recently used evicted beyond `capacity_bytes`. Thread-safe:
    admission prices lookups, the scorer's launcher threads insert."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()  # least recent first
        self._index: dict[bytes, dict[int, int]] = {}  # key -> {entry: length it covers}, in order of insertion
        self._pending: dict[bytes, tuple[int, float]] = {}  # key -> (length, until): contexts queued requests keep
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self.bytes = 0
        self.evictions = 0
        self.query_tokens = 0  # leading tokens looked up for scoring (each request's prefix, once per lookup)
        self.hit_tokens = 0  # of which found cached

    def peek(self, tokens: Sequence[int], limit: int, adapter: int = 0, salt: str | None = None,
             pending: bool = False, now: float | None = None, positions: bool = False) -> int:
        """How many of tokens[:limit] are cached (0: none), without counting or touching anything: admission's
        price. `pending`: also those a queued request will compute and keep (`expect`), as of `now`. `positions`:
        only entries with per-position outputs (a prompt read at every position reads them)."""
        keys = _keys(tokens, limit, adapter, salt) if limit > 0 else []
        found = self._find(keys, tokens, limit, positions)
        if positions:
            return found[0] if found else 0
        held = found[0] if found else 0
        if pending and self._pending:
            now = time.monotonic() if now is None else now
            with self._lock:
                for length, key in reversed(keys):
                    expected = self._pending.get(key)
                    if length <= held:
                        break
                    if expected and expected[1] > now:
                        return length
        return held

    def expect(self, tokens: Sequence[int], length: int, adapter: int, salt: str | None, until: float) -> None:
        """A queued request will compute tokens[:length] and keep them: requests after it are priced as hits
        (`peek(pending=True)`) until it does, or until `until` (it may fail or be dropped)."""
        keys = _keys(tokens, length, adapter, salt)
        with self._lock:
            for end, key in keys:
                self._pending[key] = (end, max(until, self._pending.get(key, (0, 0.0))[1]))
            now = time.monotonic()
            for key in [k for k, (_, at) in self._pending.items() if at <= now]:
                del self._pending[key]

    def lookup(self, tokens: Sequence[int], limit: int, adapter: int = 0, salt: str | None = None,
               positions: bool = False) -> Hit | None:
        """The longest cached run of tokens[:limit], marked recently used and counted (`positions`: as peek's)."""
        found = self._find(_keys(tokens, limit, adapter, salt) if limit > 0 else [], tokens, limit, positions)
        with self._lock:
            self.query_tokens += limit
            if found is None or found[1] not in self._entries:
                return None
            length, entry_id = found
            entry = self._entries[entry_id]
            self._entries.move_to_end(entry_id)
            self.hit_tokens += length
            return Hit(length, entry.kv, entry.context, entry.positions)

    def _find(self, keys: list[tuple[int, bytes]], tokens: Sequence[int], limit: int,
              positions: bool = False) -> tuple[int, int] | None:
        """(length, entry) of the longest of `keys` held (_keys' order: the shortest first), extended through the
        entry's own tokens while they agree with `tokens`, up to `limit`; or None. `positions`: only entries that
        have per-position outputs."""
        with self._lock:
            for length, key in reversed(keys):
                holders = [entry_id for entry_id in self._index.get(key, ())
                           if not positions or self._entries[entry_id].positions is not None]
                if holders:
                    entry_id = holders[-1]  # the newest entry that holds it
                    held = self._entries[entry_id].tokens[length:limit]
                    ours = np.asarray(tokens[length:limit], np.int64)[: len(held)]
                    differ = np.flatnonzero(held[: len(ours)] != ours)
                    return length + (int(differ[0]) if differ.size else len(ours)), entry_id
        return None

    def insert(self, tokens: Sequence[int], length: int, kv: tuple[Any, Any], context: int, adapter: int = 0,
               salt: str | None = None, positions: tuple[Any, ...] | None = None) -> bool:
        """Keep the keys and values of tokens[:length] (a context bucket of `context` positions), and with
        `positions` its per-position outputs (_Entry.positions); False when they are larger than the whole cache or
        already held (an entry without positions gives way to one with them). Evicts the least recently used
        entries to make room."""
        nbytes = int(sum(getattr(array, "nbytes", 0) for array in (*kv, *(positions or ()))))
        if length <= 0:
            return False
        keys = _keys(tokens, length, adapter, salt)
        with self._lock:
            for _, key in keys:
                self._pending.pop(key, None)
            if nbytes > self.capacity_bytes:
                return False
            held = list(self._index.get(keys[-1][1], ()))
            if held and (positions is None or any(self._entries[i].positions is not None for i in held)):
                return False  # this very prefix is held: keep one copy
            for entry_id in held:  # held without per-position outputs: this one replaces it
                self._evict(entry_id)
            while self.bytes + nbytes > self.capacity_bytes and self._entries:
                self._evict(next(iter(self._entries)))
            entry_id = next(self._ids)
            self._entries[entry_id] = _Entry(kv, context, nbytes, [key for _, key in keys],
                                             np.asarray(tokens[:length], np.int64), positions)
            for end, key in keys:
                self._index.setdefault(key, {})[entry_id] = end
            self.bytes += nbytes
        return True

    def _evict(self, entry_id: int) -> None:
        """Drop an entry and its keys (lock held); a device batch that reads it keeps its arrays alive."""
        entry = self._entries.pop(entry_id)
        for key in entry.keys:
            holders = self._index.get(key, {})
            holders.pop(entry_id, None)
            if not holders:
                self._index.pop(key, None)
        self.bytes -= entry.nbytes
        self.evictions += 1

    def clear(self) -> None:
        with self._lock:
            while self._entries:
                self._evict(next(iter(self._entries)))

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"prefix_cache_query_tokens": self.query_tokens, "prefix_cache_hit_tokens": self.hit_tokens,
                    "prefix_cache_bytes": self.bytes, "prefix_cache_evictions": self.evictions,
                    "prefix_cache_entries": len(self._entries)}
