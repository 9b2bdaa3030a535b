"""`python -m offload_core pose`: Wan Animate 2's pose cache at real shapes."""
