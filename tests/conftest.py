import pytest
import torch

from tests.helpers import load_parity

# The test models are tiny: one thread is faster and immune to OpenMP spin-waits when
# the machine is shared.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def parity():
    """(model, x, targets, logits, maps, meta) of the parity fixture (float64)."""
    return load_parity()


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
