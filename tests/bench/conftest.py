import pytest


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny models gain nothing from threads, and on a busy machine OpenMP threads waiting for each other make
    every op many times slower; restored after each test."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
