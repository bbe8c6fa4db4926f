"""SGLang end-to-end tests: each module starts its own server in a subprocess.

They need SGLang (scripts/install_sglang_cpu.sh). Without it they are skipped with that
reason, unless SGL_PIC_REQUIRE_SGLANG=1 (CI sets it after installing), where its absence
fails the run instead.
"""

from __future__ import annotations

import importlib.util
import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "sglang: end-to-end through an SGLang server (needs SGLang installed)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if importlib.util.find_spec("sglang") is not None:
        return
    if os.environ.get("SGL_PIC_REQUIRE_SGLANG") == "1":
        raise pytest.UsageError(
            "SGL_PIC_REQUIRE_SGLANG=1 but sglang is not importable; run "
            "scripts/install_sglang_cpu.sh first"
        )
    skip = pytest.mark.skip(reason="sglang not installed (scripts/install_sglang_cpu.sh)")
    for item in items:
        if "sglang" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def metrics():  # noqa: ANN201 - PicMetrics, imported lazily (it needs prometheus_client)
    """The one PicMetrics of the test process: Prometheus names are global, so a second
    registration in the same process fails. Tests read deltas of it."""
    from sgl_pic.integration.metrics import PicMetrics

    return PicMetrics()
