"""Fixtures: the platforms under test and GPU gating (plain helpers: helpers.py).

Every test that takes the `platform` fixture runs once per platform: on "cpu"
always, and on "cuda" as a test marked `gpu`. Without a GPU those skip, unless
JAX_TILED_REQUIRE_GPU=1, which turns the skip into a failure so that a GPU run
cannot pass by skipping.

Tests import the installed package: `python -P -m pytest` (the README's
command) keeps the repository root, and with it the uncompiled source tree
jax_tiled/, off sys.path.
"""

from __future__ import annotations

import os
import zlib

# Four CPU devices for tests/test_sharding.py; XLA reads this when jax starts.
os.environ["XLA_FLAGS"] = " ".join(
    filter(None, [os.environ.get("XLA_FLAGS"), "--xla_force_host_platform_device_count=4"])
)

import jax
import numpy as np
import pytest

from helpers import gpu_available, load_repository_module

REQUIRE_GPU = os.environ.get("JAX_TILED_REQUIRE_GPU") == "1"


@pytest.fixture(autouse=True)
def _gpu_gate(request):
    if request.node.get_closest_marker("gpu") and not gpu_available():
        if REQUIRE_GPU:
            pytest.fail("JAX_TILED_REQUIRE_GPU=1 but jax sees no CUDA device")
        pytest.skip("needs a CUDA GPU")


PLATFORMS = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=PLATFORMS)
def platform(request):
    """Runs the test with jax's default device on this platform."""
    with jax.default_device(jax.devices(request.param)[0]):
        yield request.param


@pytest.fixture
def on_gpu():
    """Runs a `gpu`-marked test with jax's default device on the first GPU."""
    with jax.default_device(jax.devices("cuda")[0]):
        yield


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test's name so failures reproduce."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


TEST_TIMES = os.environ.get("JAX_TILED_TEST_TIMES")


def pytest_collection_modifyitems(config, items):
    """With JAX_TILED_SLOW_FIRST=1, the tests tests/gpu_slow_tests.tsv names
    are collected so that pytest-xdist's workers start them first, one a
    worker, the slowest first (tools/test_shards.py's slow_first says how and
    why); the rest keep their order. Every worker reads the same table and
    worker count, so every worker collects the same order."""
    if os.environ.get("JAX_TILED_SLOW_FIRST") != "1":
        return
    shards_tool = load_repository_module("tools/test_shards.py")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    slow = shards_tool.read_slow_tests(shards_tool.SLOW_TABLE)
    order = shards_tool.slow_first([item.nodeid for item in items], slow, workers)
    position = {test: i for i, test in enumerate(order)}
    items.sort(key=lambda item: position[item.nodeid])


def pytest_runtest_logreport(report):
    """With JAX_TILED_TEST_TIMES=PATH, each test's call time is appended to PATH
    as it ends ("seconds<TAB>outcome<TAB>test"; under pytest-xdist, by the
    controller), so a GPU run cut short by its time limit still says where its
    time went and which tests it did not finish (tools/device_check.sh sets
    it; tools/test_shards.py --unfinished). A test skipped or failed in its
    setup ends there: its setup's line."""
    in_worker = "PYTEST_XDIST_WORKER" in os.environ  # its controller writes the line
    ended = report.when == "call" or (report.when == "setup" and report.outcome != "passed")
    if TEST_TIMES and ended and not in_worker:
        with open(TEST_TIMES, "a") as times:
            times.write(f"{report.duration:.3f}\t{report.outcome}\t{report.nodeid}\n")
