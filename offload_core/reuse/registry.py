"""Prefix reuse: a registry of completed stores, looked up by the content their K/V were computed from.

A prefix K/V cache that provably depends only on some inputs (FLUX.2 Klein KV: the reference latents; Qwen-Image
2.1: prompt embedding, references, slots, target size) can serve a later request with the same inputs and skip
the capture. `PrefixRegistry` holds such stores between requests:

- a `PrefixKey` (`prefix.py`) is hashed by a digest computed on its tensors' device; on a digest match the full
  content is compared, so two different prefixes never share an entry, however their digests collide.
- an entry is one completed store, sealed (read-only) and parked (its device ring freed) while it waits. A hit
  leases it to one request at a time; a request that finds its entry leased captures anew.
- byte budgets per budget place (`device`, `host` = pinned + pageable RAM, `file`; `budget.py`) bound what
  is kept; least recently used entries are evicted first, and eviction closes the store (memory, files).
- `close()` closes every entry; so does a finalizer when the registry is dropped or the process exits.

The engine stays model-agnostic: what goes into a key is decided by the adapter (`offload_core.diffusers`, the
ComfyUI nodes); `fingerprint.model_state` is the part every torch model shares.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from ..places import BUDGET_PLACES, MiB
from .prefix import PrefixKey
from .budget import BudgetSpec, limits, parse_budget, room_for, store_places
from ..tiers import KVFileError

log = logging.getLogger(__name__)

REUSE_STATS_VERSION = 1


# -- the registry ----------------------------------------------------------------------------------------------
@dataclass(eq=False)
class Entry:
    key: PrefixKey
    store: object
    places: Dict[str, int]
    label: str = ""
    hits: int = 0
    leased: bool = False
    doomed: bool = False  # evicted while leased: closed on release


@dataclass
class _Counters:
    hits: int = 0
    misses: int = 0
    admitted: int = 0
    evictions: int = 0
    rejected: int = 0
    busy: int = 0
    last_eviction: Optional[str] = None
    last_rejection: Optional[str] = None


class PrefixRegistry:
    """Completed stores by `PrefixKey`, within byte budgets per place, least recently used evicted first.

    Thread-safe. A store handed to `admit` belongs to the registry from then on (it closes it on eviction, on
    `close()` and at process exit); a store got from `lookup` is leased to the caller until `release`.
    """

    def __init__(self, budget: BudgetSpec = None, name: str = ""):
        self.budget = parse_budget(budget)
        self.name = name
        self._entries: "OrderedDict[int, List[Entry]]" = OrderedDict()
        self._lru: "OrderedDict[int, Entry]" = OrderedDict()  # id(entry) -> entry, oldest first
        self._doomed: List[Entry] = []  # evicted while leased: closed on release, or by close()
        self._closing: List[object] = []  # evicted stores, each listed until its close() has returned
        self._lock = threading.RLock()
        self._counters = _Counters()
        self.closed = False
        self._finalizer = weakref.finalize(self, _close_entries, self._lru, self._closing)

    # -- lookup / admit / release ----------------------------------------------------------------------------
    def lookup(self, key: PrefixKey) -> Optional[Entry]:
        """The entry for `key`, leased to the caller, or None (a miss: capture, then `admit`)."""
        with self._lock:
            if self.closed:
                return None
            for entry in self._entries.get(hash(key), []):
                if entry.key.matches(key):
                    if entry.leased:  # another request reads it right now: its ring is single-consumer
                        self._counters.busy += 1
                        break
                    entry.leased, entry.hits = True, entry.hits + 1
                    self._lru.move_to_end(id(entry))
                    self._counters.hits += 1
                    return entry
            self._counters.misses += 1
            return None

    def release(self, entry: Entry, *, ok: bool = True) -> None:
        """End a lease. `ok=False` (the request failed while reading it) evicts the entry: it may be damaged."""
        with self._lock:
            entry.leased = False
            if not ok:
                self._evict(entry, "the request that read it failed")
            doomed = entry.doomed
            self._doomed = [e for e in self._doomed if e is not entry]
        if doomed:  # evicted while it was being read: closed only now that its reader is done
            _close_quietly(entry.store)
        else:
            self._park(entry.store)

    def admit(self, key: PrefixKey, store, label: str = "") -> bool:
        """Keep the completed `store` for `key`; evicts older entries to make room. False: closed instead.

        The store must be complete (every layer put) and no longer written to; it is sealed and parked here.
        """
        try:
            self._park(store)  # also waits for its file writes: a failed one is no cache to keep
        except (KVFileError, TimeoutError) as exc:  # a failed or stuck write
            return self._reject(store, f"its layer files could not be written ({exc})", logging.WARNING)
        places = store_places(store.stats())
        with self._lock:
            # Whether it can be kept is decided first, on the entries as they are; only then does anything go.
            reason, victims = self._why_not(key, store, places)
            if reason is None:
                for victim in victims:
                    self._evict(victim, "least recently used, to make room")
                entry = Entry(key.on_host(), store, places, label)
                self._entries.setdefault(hash(key), []).append(entry)
                self._lru[id(entry)] = entry
                self._counters.admitted += 1
                return True
        return self._reject(store, reason, logging.INFO)

    def _reject(self, store, reason: str, level: int) -> bool:
        """An offered store turned down: counted and logged as every rejection is, then closed."""
        self.note_rejection(reason, level)
        store.close()
        return False

    def note_rejection(self, why: str, level: int = logging.INFO) -> None:
        """Count and log a completed store that is not kept: the one path of every rejection, also of a store the
        caller closes itself instead of offering it (e.g. its files go with a run)."""
        with self._lock:
            self._counters.rejected += 1
            self._counters.last_rejection = why
        log.log(level, "KV offload reuse%s: not kept (%s)", f" [{self.name}]" if self.name else "", why)

    def _why_not(self, key: PrefixKey, store, places: Dict[str, int]) -> Tuple[Optional[str], List[Entry]]:
        """(None, the entries to evict first, oldest first) when `store` can be kept, else (why not, []).

        A query: it changes nothing, so a store that cannot be kept costs no entry."""
        if self.closed:
            return "the registry is closed", []
        if any(e.key.matches(key) for e in self._entries.get(hash(key), [])):
            return "an entry for the same prefix is kept already", []
        kept = list(self._lru.values())
        return room_for(places, limits(self.budget, kept, store), kept)

    def _used(self, place: str) -> int:
        return sum(e.places[place] for e in self._lru.values())

    # -- eviction ----------------------------------------------------------------------------------------------
    def _evict(self, entry: Entry, why: str) -> None:
        """Forget `entry` (no later lookup finds it) and close its store — at once, or, while a request reads
        it, when that request releases it: a store is never closed under its reader."""
        if id(entry) not in self._lru:
            return
        if entry.leased:
            entry.doomed = True
            self._doomed.append(entry)
        else:
            self._closing.append(entry.store)  # listed before it is forgotten: a Ctrl-C cannot lose it
        del self._lru[id(entry)]
        bucket = self._entries.get(hash(entry.key), [])
        bucket[:] = [e for e in bucket if e is not entry]
        if not bucket:
            self._entries.pop(hash(entry.key), None)
        self._counters.evictions += 1
        self._counters.last_eviction = why
        self._finish_closing()

    def _finish_closing(self) -> None:
        """Closes the evicted stores in `_closing`, each struck off once its close has returned: what a Ctrl-C
        stopped is finished by the next eviction, `close()` or the registry's finalizer."""
        while self._closing:
            _close_quietly(self._closing[0])
            del self._closing[0]

    def evict_where(self, predicate, why: str, *, leased: bool = True) -> int:
        """Evict every entry whose key satisfies `predicate(key)` (`leased=False`: only those not in use; a leased
        one is closed when its reader releases it)."""
        with self._lock:
            victims = [e for e in self._lru.values() if (leased or not e.leased) and predicate(e.key)]
            for entry in victims:
                self._evict(entry, why)
            return len(victims)

    def clear(self, why: str = "cleared") -> int:
        return self.evict_where(lambda key: True, why)

    def close(self) -> None:
        """Close every entry's store, leased ones too (memory freed, files deleted). Idempotent; later admits
        are refused."""
        with self._lock:
            if self.closed:
                return
            self.clear("the registry was closed")
            while self._doomed:  # closing outranks a reader: nothing may outlive the registry
                self._closing.append(self._doomed[0].store)  # twice at worst (a Ctrl-C here): a close is idempotent
                del self._doomed[0]
            self._finish_closing()
            self.closed = True
            self._finalizer.detach()

    @staticmethod
    def _park(store) -> None:
        park = getattr(store, "park", None)
        if callable(park):
            park()

    # -- reporting ---------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._lru)

    def stats(self) -> dict:
        """Plain dict: counters, bytes held per place, budgets, and one line per entry."""
        with self._lock:
            c = self._counters
            return {
                "v": REUSE_STATS_VERSION,
                "enabled": not self.closed,
                "hits": c.hits, "misses": c.misses, "admitted": c.admitted, "evictions": c.evictions,
                "rejected": c.rejected, "busy": c.busy,
                "last_eviction": c.last_eviction, "last_rejection": c.last_rejection,
                "entries": len(self._lru),
                "bytes": {p: self._used(p) for p in BUDGET_PLACES},
                "budget": dict(self.budget),
                "held": [{"label": e.label, "hits": e.hits, "bytes": dict(e.places), "leased": e.leased,
                          "key_bytes": e.key.nbytes} for e in self._lru.values()],
            }


def _close_quietly(store) -> None:
    """Closes a store the registry no longer keeps. What closing can fail with (a file that cannot be deleted,
    I/O that stays stuck, a device error) is logged, not raised: the registry goes on closing the others, and the
    request that caused the eviction is not failed by a store it does not use."""
    try:
        store.close()
    except (OSError, RuntimeError):
        log.warning("KV offload reuse: closing a kept store failed", exc_info=True)


def _close_entries(lru: "OrderedDict[int, Entry]", closing: List[object]) -> None:
    # Runs when the registry is garbage collected or at interpreter exit: every kept store goes, files included,
    # and every evicted one whose close a Ctrl-C stopped (in a forked child, `KVStore.close` touches nothing of
    # the parent's).
    for store in [*closing, *(entry.store for entry in lru.values())]:
        _close_quietly(store)
    lru.clear()
    closing.clear()


def describe(stats: Optional[dict]) -> str:
    """One line for logs and the text readout, e.g. 'reuse: 3 hits, 1 miss, 2 kept (14.2 MiB host)'."""
    if not stats:
        return "reuse: off"
    held = ", ".join(f"{n / MiB:.1f} MiB {p}" for p, n in stats["bytes"].items() if n)
    return (f"reuse: {stats['hits']} hit{'s' * (stats['hits'] != 1)}, {stats['misses']} "
            f"miss{'es' * (stats['misses'] != 1)}, {stats['entries']} kept" + (f" ({held})" if held else "")
            + (f", {stats['evictions']} evicted" if stats["evictions"] else ""))

