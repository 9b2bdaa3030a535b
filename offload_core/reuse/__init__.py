"""Prefix reuse: the registry of kept prefixes, its budgets, and the key (fingerprints of inputs, weights and the code a forward runs)."""
