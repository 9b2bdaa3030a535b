"""`python -m offload_core stream`: the file tiers against the raw disk."""
