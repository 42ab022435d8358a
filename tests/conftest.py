import os

import pytest
import torch

from tests.helpers import load_parity

THREADS_ENV = "CAPTUM_VIT_TEST_THREADS"


def pytest_addoption(parser):
    parser.addoption(
        "--threads", type=int, default=None, metavar="N",
        help=f"torch intra-op threads for the tests (default: ${THREADS_ENV}, else 1). "
             "Other counts split reductions and GEMMs differently, so they show other "
             "kernels' rounding on one machine.")


def pytest_configure(config):
    # The test models are tiny: one thread is faster and immune to OpenMP spin-waits when
    # the machine is shared, and it is the default.
    threads = config.getoption("--threads") or int(os.environ.get(THREADS_ENV) or 1)
    if threads < 1:
        raise pytest.UsageError(f"--threads / {THREADS_ENV} must be >= 1, got {threads}")
    torch.set_num_threads(threads)


def pytest_report_header(config):
    return (f"torch {torch.__version__}: {torch.get_num_threads()} intra-op thread(s), "
            f"CPU capability {torch.backends.cpu.get_cpu_capability()}")


@pytest.fixture(scope="session")
def parity():
    """(model, x, targets, logits, maps, meta) of the parity fixture (float64)."""
    return load_parity()


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


