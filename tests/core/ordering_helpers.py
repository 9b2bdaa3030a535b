"""Shared by the ordering suites: read layers back the way a consumer kernel would on SimCuda."""


def read_back(sim, store, keys):
    """Gets `keys` in turn, each read by a kernel queued on the consumer's stream; what they saw, after a sync."""
    seen = []
    for key in keys:
        k, v = store.get(key)
        sim.launch(lambda k, v, key=key: seen.append((key, k.clone(), v.clone())), k, v)
    sim.synchronize()
    return seen
