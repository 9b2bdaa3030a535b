"""The end of a request (`OffloadSession.end_request`): every store it read from the registry handed back, every
store it made closed or kept, whatever fails on the way; the errors raised only once all of them are done."""

from __future__ import annotations

import logging

from .. import KVStore
from ..places import MiB
from ..reuse.prefix import PrefixKey
from ..reuse.registry import PrefixRegistry

logger = logging.getLogger(__name__)


def give_back(reuse: PrefixRegistry | None, leases: list, ok: bool, errors: list) -> list[dict]:
    """Each registry entry the request read, back to the registry (`ok=False`: a failed request may have left it
    half read, so it is evicted); returns their stats."""
    stats = []
    for entry in leases:
        stats.append(_stats_of(entry.store, "hit", errors))
        try:
            reuse.release(entry, ok=ok)
        except BaseException as exc:
            errors.append(exc)
    return stats


def close_or_keep(reuse: PrefixRegistry | None, stores: list[KVStore], keys: dict[int, PrefixKey | None],
                  fallbacks: dict[int, str], refused: str | None, errors: list) -> list[dict]:
    """Each store the request made, offered to the registry under `keys[id(store)]` (a completed capture) or
    closed; a Ctrl-C or an error on the way does not stop the others. Returns their stats."""
    stats = []
    for store in stores:
        key = keys.get(id(store))
        entry_stats = _stats_of(store, "off" if reuse is None else "not kept", errors)
        entry_stats["fallback"] = fallbacks.pop(id(store), None)  # a store that fell back is never kept
        if refused is not None:
            entry_stats.update(reuse="off", reuse_refused=refused)
        try:
            if key is not None and not store.closed and reuse.admit(key, store, label=store.name):
                entry_stats["reuse"] = "kept"
            else:
                store.close()
        except BaseException as exc:
            errors.append(exc)
            _close_quietly(store)
        stats.append(entry_stats)
    return stats


def raise_first(errors: list, raise_errors: bool) -> None:
    """An interrupt first (only now that every store is closed), then the first error; with `raise_errors=False`
    (another exception propagates) the errors are logged instead."""
    interrupt = next((e for e in errors if not isinstance(e, Exception)), None)
    if interrupt is not None:
        raise interrupt
    if errors and raise_errors:
        raise errors[0]
    for error in errors:
        logger.error("KV offload: closing a store failed: %r", error)


def log_summary(stats: list[dict]) -> None:
    if not stats:
        return
    total = sum(sum(s["bytes"].values()) for s in stats)
    wait = sum(s["exposed_wait_s"] for s in stats)
    modes = ", ".join(f"{s['name']}={s['mode']}" for s in stats)
    logger.info("KV offload: %d cache(s) closed (%s), %.1f MiB, exposed wait %.3f s",
                len(stats), modes, total / MiB, wait)


def _stats_of(store: KVStore, reuse: str, errors: list) -> dict:
    try:
        return {**store.stats(), "reuse": reuse}
    except BaseException as exc:  # an interrupt too: raised by end_request once every store is closed
        errors.append(exc)
        return {"name": store.name, "reuse": reuse, "bytes": {}, "exposed_wait_s": 0.0, "mode": None,
                "tier": None}  # "tier": the deprecated alias of "mode" that `stats()` keeps for one release


def _close_quietly(store: KVStore) -> None:
    """A second try after `close` or `admit` failed; an interrupt here is dropped: the first one is re-raised."""
    try:
        store.close()
    except BaseException:
        logger.error("KV offload: closing a store failed", exc_info=True)
