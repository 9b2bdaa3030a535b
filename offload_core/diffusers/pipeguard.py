"""The guards a session puts on its pipeline: the call guard (a subclass of the pipeline's own class, made once
per class and put on the instance) ends the request however the call ends; the decode guard (an instance
attribute on the VAE) ends it just before the VAE decodes. Nothing in diffusers is edited."""

from __future__ import annotations

import functools
import logging
import threading

logger = logging.getLogger(__name__)

SESSION_ATTR = "_kv_offload_session"
CALLING = threading.local()  # the session whose pipeline call runs on this thread (shared transformers)
_GUARDED_CLASSES: dict[type, type] = {}
_GUARDED_LOCK = threading.Lock()


def session_of(pipe):
    return pipe.__dict__.get(SESSION_ATTR)


def guarded_class(cls: type) -> type:
    """A subclass of `cls` whose `__call__` closes the request's stores however the call ends."""
    with _GUARDED_LOCK:
        guarded = _GUARDED_CLASSES.get(cls)
        if guarded is not None:
            return guarded

        @functools.wraps(cls.__call__)
        def __call__(self, *args, **kwargs):
            session = session_of(self)
            previous = getattr(CALLING, "session", None)
            CALLING.session = session
            try:
                try:
                    result = cls.__call__(self, *args, **kwargs)
                except BaseException:
                    if session is not None:
                        session.end_request(raise_errors=False)
                    raise
                finally:
                    CALLING.session = previous
                if session is not None:
                    session.end_request()
                return result
            finally:
                if session is not None and session.detach_after_call and previous is not session:
                    session.detach()  # `disable_kv_offload` was called during the call

        def __reduce_ex__(self, protocol):
            # An enabled pipeline carries hooks, open stores and a wrapped VAE bound to this process: a copy
            # would share them silently. Refuse clearly instead (pickle, copy.copy and copy.deepcopy land here).
            raise TypeError(f"{cls.__name__} has KV offload enabled and cannot be pickled or copied; call "
                            "disable_kv_offload(pipe) first and enable it again on the copy.")

        namespace = {"__call__": __call__, "__reduce_ex__": __reduce_ex__, "__module__": cls.__module__,
                     "__qualname__": cls.__qualname__, "__doc__": cls.__doc__, "_kv_offload_base": cls}
        guarded = type(cls.__name__, (cls,), namespace)
        _GUARDED_CLASSES[cls] = guarded
        return guarded


def guard_decode(vae, session) -> None:
    # An instance attribute shadows the class's `decode` for this VAE only; `del` restores it. The previous
    # instance attribute, if any (another pack's wrapper), is kept and called through.
    inner = vae.__dict__.get("decode")
    bound = inner if inner is not None else vae.decode

    @functools.wraps(bound)
    def decode(*args, **kwargs):
        # The denoising loop is over once the final latents reach the VAE: drop the K/V before decode allocates.
        # A decode while the loop still runs (a preview from a step callback: the pipeline's current timestep is
        # set) must leave the caches alone, the next steps still read them.
        if getattr(session.pipe, "_current_timestep", None) is None:
            session.end_request()
        return bound(*args, **kwargs)

    decode._kv_offload_previous = inner
    decode._kv_offload_session = session
    object.__setattr__(vae, "decode", decode)


def unguard_decode(vae, session) -> None:
    if "decode" not in vae.__dict__:  # never guarded (an enable stopped before it), or already undone
        return
    current = vae.__dict__["decode"]
    if getattr(current, "_kv_offload_session", None) is not session:
        logger.warning("The VAE's decode was re-wrapped after KV offload was enabled; leaving it in place.")
        return
    previous = current._kv_offload_previous
    if previous is None:
        object.__delattr__(vae, "decode")
    else:
        object.__setattr__(vae, "decode", previous)


def guard_copy(transformer, session) -> None:
    """Refuses pickling and copying the transformer while the adapter's hooks are on it: a copy would carry them
    (and their stores) and keep them after `disable_kv_offload`. Instance attributes: `del` restores it."""
    def refuse(*args):
        raise TypeError(f"{type(transformer).__name__} carries KV offload's hooks and cannot be pickled or copied; "
                        "call disable_kv_offload(pipe) first and enable it again on the copy.")

    refuse._kv_offload_session = session
    for name in ("__deepcopy__", "__reduce_ex__"):
        object.__setattr__(transformer, name, refuse)


def unguard_copy(transformer, session) -> None:
    for name in ("__deepcopy__", "__reduce_ex__"):
        if getattr(transformer.__dict__.get(name), "_kv_offload_session", None) is session:
            object.__delattr__(transformer, name)
