"""Request lifetime of the offloaded caches of one pipeline.

A session belongs to one pipeline. Each call of the pipeline is one request; every store opened during it
(one per CFG branch) is closed

- just before the VAE decodes (normal completion and interruption: the loop has ended), and
- when the call returns or raises (output_type="latent", exceptions inside the denoising loop),

so no store — device buffers, pinned host memory, files — outlives the denoising loop, in any mode; with prefix
reuse on, a store whose capture completed is instead sealed, its device ring freed, and handed to the
session's `PrefixRegistry`, which keeps it (within its budgets) for a later request with the same prefix inputs.
A store served from the registry (a hit) goes back to it at the same points.

The guards that end a request (on the pipeline's call and on its VAE's decode) are in `pipeguard.py`; both
are removed by `detach()`. The reuse key's diffusers part is in `keys.py`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref

import torch

from .. import HostServices, KVStore, Mode, OffloadConfig
from ..reuse.fingerprint import ModelState, Unkeyable, model_state, plain
from ..reuse.prefix import PrefixKey
from ..reuse.registry import PrefixRegistry
from ..reuse.cost import ReuseCost, StepTimes
from .closing import close_or_keep, give_back, log_summary, raise_first
from .keys import attention_backend, check_numerics, is_ours
from .pipeguard import CALLING, SESSION_ATTR, guard_copy, guard_decode, guarded_class, unguard_copy, unguard_decode

logger = logging.getLogger(__name__)


class OffloadSession:
    """Opens stores on demand during a request and closes them all at its end.

    Attributes:
        config: the validated `OffloadConfig` every store of this pipeline is built with.
        last_stats: `stats()` of every store of the last finished request, captured just before closing, each
            with `"reuse"`: "hit" (served from the registry), "kept" / "not kept" (captured, then offered to the
            registry) or "off".
        reuse: the `PrefixRegistry` of this pipeline, or None when reuse is off.
        cost: whether reuse pays, per model and prefix size (`reuse/cost.py`); `times`: this request's calls.
    """

    def __init__(self, pipe, config: OffloadConfig, host: HostServices | None,
                 reuse: PrefixRegistry | None = None, always: bool = False):
        self.pipe = pipe
        self.config = config
        self.host = host
        self.reuse = reuse
        self.last_stats: list[dict] = []
        self._live: list[KVStore] = []
        self._keys: dict[int, PrefixKey] = {}  # id(store) -> the key its capture is kept under
        self._complete: set[int] = set()  # id(store) of stores whose capture finished
        self._leases: list = []  # registry entries this request reads
        self._bindings: dict[int, tuple[object, object]] = {}  # id(upstream cache) -> (upstream, ours)
        self._hooks: list = []
        self._decode_owner = None
        self._fallbacks: dict[int, str] = {}  # id(store) -> what the request does instead, and why
        self._states: dict[int, ModelState] = {}  # id(transformer) -> its state, read once per request
        self.refused: str | None = None  # why this request's prefix cannot be keyed (reuse off for it)
        self._warned: set[str] = set()
        self.cost, self.times = ReuseCost(always), StepTimes()
        self._scope = None  # (transformer, prefix layout) of this request's key, once read
        self._hit = False
        self._key_s = 0.0
        self.detach_after_call = False  # `disable_kv_offload` was called during this pipeline's call

    # -- stores --------------------------------------------------------------------------------------------
    def open_store(self, device: torch.device, expected_bytes: int | None, key: PrefixKey | None = None) -> KVStore:
        """A new store for one branch of the current request; closed (or kept under `key`) by `end_request()`."""
        n = len(self._live) + len(self._leases)
        name = ("cond", "uncond")[n] if n < 2 else f"branch{n}"
        store = KVStore(self.config, device, host=self.host, expected_bytes=expected_bytes, name=name)
        self._live.append(store)
        if key is not None:
            self._keys[id(store)] = key
        return store

    # -- reuse ---------------------------------------------------------------------------------------------
    def active(self) -> bool:
        """False while another enabled pipeline's call runs on this thread (both hook a shared transformer)."""
        calling = getattr(CALLING, "session", None)
        return calling is None or calling is self

    def reuse_key(self, family: str, transformer, device: torch.device, header: tuple,
                  tensors: list, options=None) -> PrefixKey | None:
        """The key of a prefix computed by `transformer` on `device` from `tensors` and the call's attention
        `options`; None when reuse is off, or when the key cannot read something that may change the prefix
        (then `refused` says what, for this request). Its time adds to the request's `reuse_key_s`."""
        if self.reuse is None:
            return None
        began = time.perf_counter()
        try:
            return self._reuse_key(family, transformer, device, header, tensors, options)
        finally:
            self._key_s += time.perf_counter() - began

    def _reuse_key(self, family, transformer, device, header, tensors, options) -> PrefixKey | None:
        scope = (weakref.ref(transformer), header)  # a new transformer at a dead one's address is another
        off = self.cost.off(scope)
        if off is not None:
            self._refuse(off)
            return None
        try:
            state = self._states.get(id(transformer))
            if state is None:  # once per request: the branches of one call share the transformer
                state = self._states[id(transformer)] = model_state(transformer, device, own=is_ours)
            described, option_tensors = plain(options or {}, "the attention kwargs")
            check_numerics(transformer)
        except Unkeyable as exc:
            self._refuse(str(exc))
            return None
        model = (state.identity, state.digest)
        self._scope = scope
        return PrefixKey.build((family, id(transformer), model, attention_backend(), self.config.storage,
                                described, *header), [*tensors, *option_tensors])

    def _refuse(self, why: str) -> None:
        self.refused = why
        if why not in self._warned:
            self._warned.add(why)
            logger.warning("KV offload: prefix reuse is off for this request: %s", why)

    def lookup(self, key: PrefixKey | None) -> KVStore | None:
        """A kept store for `key`, leased to this request until `end_request()`; None: capture."""
        if key is None or self.reuse is None:
            return None
        entry = self.reuse.lookup(key)
        if entry is None:
            self._drop_stale(key)
            return None
        self._hit = True
        self._leases.append(entry)
        return entry.store

    def _drop_stale(self, key: PrefixKey) -> None:
        """Evict entries of the same transformer made from other weights (LoRA fused, weights edited): no later
        request is likely to hit them. Entries of the same weights in another module state stay (a backend or a
        hook switched off again hits them)."""
        def stale(kept: PrefixKey) -> bool:
            return kept.scope == key.scope and kept.weights != key.weights

        self.reuse.evict_where(stale, "the transformer's weights changed", leased=False)

    def mark_complete(self, store: KVStore) -> None:
        """The capture that fills `store` finished: it may be kept for reuse."""
        self._complete.add(id(store))

    def bind(self, upstream, ours) -> None:
        """Remember that the pipeline's cache object `upstream` is served by our cache `ours` this request."""
        self._bindings[id(upstream)] = (upstream, ours)

    def bound(self, upstream):
        entry = self._bindings.get(id(upstream))
        return entry[1] if entry is not None and entry[0] is upstream else None

    def fall_back(self, store: KVStore, instead: str, error: Exception) -> None:
        """`store` could not write its files (disk full, I/O error): the request goes on `instead` (e.g.
        "recomputing the prefix every step"), says so in a warning and in `last_stats[...]["fallback"]`, and
        the store's files are deleted now."""
        reason = f"{error}; {instead} for this request"
        self._fallbacks[id(store)] = reason
        logger.warning("KV offload [%s]: %s", store.name, reason)
        store.close()

    @property
    def live_stores(self) -> list[KVStore]:
        return [s for s in self._live if not s.closed]

    def end_request(self, *, raise_errors: bool = True) -> None:
        """Close every store of the current request — or, with reuse, hand each completed one to the registry and
        give back the ones it lent. Idempotent.

        `raise_errors=False` (used while another exception propagates) logs a failed close instead of raising,
        so the caller sees the original error.
        """
        stores, self._live = self._live, []
        leases, self._leases = self._leases, []
        keys, complete = self._keys, self._complete
        self._keys, self._complete = {}, set()
        self._bindings.clear()
        self._states = {}
        refused, self.refused = self.refused, None
        key_s, self._key_s = self._key_s, 0.0
        saved = self._judge(complete, key_s)
        if not stores and not leases:
            return
        errors: list[BaseException] = []
        kept = {id(s): keys.get(id(s)) for s in stores if raise_errors and id(s) in complete}
        stats = give_back(self.reuse, leases, raise_errors, errors)
        stats += close_or_keep(self.reuse, stores, kept, self._fallbacks, refused, errors)
        for entry_stats in stats:
            entry_stats["reuse_key_s"] = key_s  # reading the model for the key, once per request
            if saved is not None:
                entry_stats["reuse_saved_s"] = saved  # what a hit would have saved this request
        self.last_stats = stats
        log_summary(stats)
        raise_first(errors, raise_errors)

    def timing(self) -> bool:
        """Whether this call's time counts towards `cost` (reuse on, this pipeline's call)."""
        return self.reuse is not None and self.active()

    def _judge(self, complete: set, key_s: float) -> float | None:
        """What a hit would have saved this request (a miss that made a prefix), weighed against the key."""
        scope, hit, self._scope, self._hit = self._scope, self._hit, None, False
        saved = self.times.saved() if scope is not None and not hit and complete else None
        self.times.reset()
        if saved is not None:
            saved -= key_s  # the key is read inside the extracting call: a hit reads it too
        if saved is not None:
            off = self.cost.judge(scope, key_s, saved)
            if off is not None:
                logger.warning("KV offload: prefix reuse is off for this model: %s", off)
        return saved

    # -- hooks ---------------------------------------------------------------------------------------------
    def add_hook(self, handle) -> None:
        self._hooks.append(handle)

    def attach(self) -> None:
        """Install the call guard on the pipeline and the decode guard on its VAE."""
        pipe = self.pipe
        object.__setattr__(pipe, SESSION_ATTR, self)
        object.__setattr__(pipe, "__class__", guarded_class(type(pipe)))
        guard_copy(pipe.transformer, self)
        vae = getattr(pipe, "vae", None)
        if vae is not None:
            self._decode_owner = vae  # first: a detach after a Ctrl-C in the next line undoes it
            guard_decode(vae, self)

    def detach(self) -> None:
        """Undo `attach()` and every registered hook; closes live stores and every kept store first."""
        try:
            try:
                self.end_request()
            finally:
                if self.reuse is not None:
                    self.reuse.close()
        finally:
            for handle in self._hooks:
                handle.remove()
            self._hooks.clear()
            unguard_copy(self.pipe.transformer, self)
            if self._decode_owner is not None:
                unguard_decode(self._decode_owner, self)
                self._decode_owner = None
            # `attach` may have been stopped part-way (Ctrl-C in `enable_kv_offload`): undo what it did, only that
            pipe = self.pipe
            base = type(pipe).__dict__.get("_kv_offload_base")
            if base is not None:
                object.__setattr__(pipe, "__class__", base)
            if pipe.__dict__.get(SESSION_ATTR) is self:
                object.__delattr__(pipe, SESSION_ATTR)


def make_config(mode: Mode | str, config_fields: dict) -> OffloadConfig:
    """Build and validate the config before anything is patched."""
    fields = {f.name for f in dataclasses.fields(OffloadConfig)} - {"mode"}
    unknown = sorted(set(config_fields) - fields)
    if unknown:
        raise TypeError(f"enable_kv_offload: unknown option(s) {', '.join(map(repr, unknown))}; the options are "
                        f"mode, host, reuse, reuse_budget and the OffloadConfig fields {', '.join(sorted(fields))}.")
    return OffloadConfig(mode=mode, **config_fields)
