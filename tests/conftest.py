"""Shared fixtures: the ``xp`` fixture over every installed array namespace, Hypothesis profile."""

import os
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

# Test helpers live beside this file; tests import them by module name (importlib mode).
sys.path.insert(0, os.path.dirname(__file__))

from _namespaces import available_namespaces  # noqa: E402

settings.register_profile(
    "ci", derandomize=True, deadline=None, max_examples=25, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", deadline=None, max_examples=100,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _use(ns):
    if ns.skip_reason:
        pytest.skip(ns.skip_reason)
    return ns


@pytest.fixture(scope="session", params=available_namespaces(), ids=lambda ns: ns.id)
def xp(request):
    """Every array namespace and float dtype: numpy, array-api-strict, torch, jax, cupy."""
    return _use(request.param)


@pytest.fixture(scope="session", ids=lambda ns: ns.id,
                params=[ns for ns in available_namespaces() if ns.name != "jax"])
def hxp(request):
    """The namespaces Hypothesis draws chains on: JAX compiles every operation anew for each
    new shape, so it runs the same properties on fixed shapes instead (DESIGN §10)."""
    return _use(request.param)


@pytest.fixture
def rng():
    return np.random.default_rng(12345)
