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


# FullGrad+ (fullgrad_plus, skip_fullgrad_plus) hands F.linear a per-token bias [B, N, D];
# torch before 2.10 sends a contiguous 3-D input through a fused addmm that expands the bias
# to 2-D and refuses it (torch 2.1-2.5 checked). Until the method adds such a bias after the
# product, its tests are expected failures on those versions (the lower-bounds run, torch
# 2.5), listed as such, not hidden; the CLI's default run and a comparison over every
# method use it too.
OLD_TORCH_LINEAR = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 10)
USES_FULLGRAD = {"tests/test_cli.py::test_explain_with_no_arguments_writes_a_png",
                 "tests/test_hf_adapter.py::test_hf_twin_of_a_timm_model_gets_identical_maps_"
                 "from_every_method"}


def pytest_collection_modifyitems(config, items):
    if not OLD_TORCH_LINEAR:
        return
    mark = pytest.mark.xfail(reason=f"FullGrad+ needs torch >= 2.10 (F.linear with a per-token "
                                    f"bias); this is torch {torch.__version__}", strict=False)
    for item in items:
        if "fullgrad" in item.nodeid or item.nodeid.split("[")[0] in USES_FULLGRAD:
            item.add_marker(mark)
