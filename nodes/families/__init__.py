"""The model families the node serves, each behind its own seam: detection, patches and caches."""
