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




# timm's Swin and SAM adapters read timm >= 1.0.31 (earlier releases size Swin's windows per
# stage and set SAM's head differently; the adapters refuse them by name). On an older timm
# (the lower-bounds run) the windowed-model tests are skipped, not hidden: the reason says why.
def _timm_release() -> tuple[int, ...]:
    import re

    import timm

    return tuple(int(p) for p in re.findall(r"\d+", timm.__version__)[:3])


WINDOWED_FILES = ("test_timm_swin", "test_hf_swin", "test_swin_methods", "test_sam",
                  "test_globenc_alti_windowed")


DOCS_BUILD_SKIP = pytest.mark.skip(
    reason="builds the documentation (minutes): selected with -m docs_build, which CI's docs "
           "step runs after installing the docs extra (.ci/docs)")


INTEGRATION_SKIP = pytest.mark.skip(
    reason="runs whole programs in subprocesses (training runs, torchrun, a wheel's install): "
           "selected with -m integration, which CI runs after the README's command (.ci/run)")


def pytest_collection_modifyitems(config, items):
    # the longest tests first (stable: the others keep their order), so that pytest -n's
    # workers start on them and share the short ones at the end
    items.sort(key=lambda item: item.get_closest_marker("long") is None)
    # The documentation builds (the site, the API pages, the tutorials executed) and the
    # integration runs of whole programs are collected (counted) by every run but run only
    # when selected by marker, in CI's later steps; the README's test command stays within
    # minutes.
    markexpr = config.getoption("markexpr") or ""
    for marker, skip_mark in (("docs_build", DOCS_BUILD_SKIP), ("integration", INTEGRATION_SKIP)):
        if marker not in markexpr:
            for item in items:
                if item.get_closest_marker(marker):
                    item.add_marker(skip_mark)
    if _timm_release() >= (1, 0, 31):
        return
    skip = pytest.mark.skip(reason="timm's Swin and SAM need timm >= 1.0.31 (the adapters "
                                   "refuse older releases by name)")
    for item in items:
        node = item.nodeid
        if any(f in node for f in WINDOWED_FILES) or "swin" in node or "timm_sam" in node \
                or item.get_closest_marker("timm_windows"):
            item.add_marker(skip)
