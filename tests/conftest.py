"""Shared fixtures: the deterministic hypothesis profile, the S3 (moto) and Azure (azurite) servers on
loopback. Storages that fail or stall on purpose live in ``ckpt_engine.testing``."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import settings

pytest_plugins = ["pytester"]  # tests/test_markers.py collects a small suite with this conftest


# Deterministic property tests: the same examples on every run and machine, no example database.
settings.register_profile("deterministic", derandomize=True, database=None, deadline=None)
settings.load_profile("deterministic")


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server over real HTTP on loopback, with credentials in the environment."""
    import os

    import s3server

    server = s3server.start()
    saved = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)
    s3server.make_bucket(server, "ckpt")
    yield server
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def s3_url(s3_server):
    """A fresh prefix in the test bucket."""
    return f"s3://ckpt/run-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def azurite_server():
    """Azure's blob emulator (azurite) over real HTTP on loopback, its connection string in the environment."""
    import azurite

    server = azurite.start()
    try:
        azurite.make_container(server, "ckpt")
        with pytest.MonkeyPatch.context() as env:
            for k, v in server.env.items():
                env.setenv(k, v)
            yield server
    finally:
        server.stop()


@pytest.fixture
def az_url(azurite_server):
    """A fresh prefix in the test container, through adlfs (``abfs://``)."""
    return f"abfs://ckpt/run-{uuid.uuid4().hex[:12]}"


@pytest.fixture(params=["local", "memory", "fsspec-local", pytest.param("s3", marks=pytest.mark.s3),
                        pytest.param("azure", marks=pytest.mark.azure)])
def any_url(request, tmp_path):
    """The same test on every backend (the storage conformance suite)."""
    if request.param == "local":
        return str(tmp_path / "ck")
    if request.param == "memory":
        return f"memory://ckpt-test-{uuid.uuid4().hex}"
    if request.param == "fsspec-local":  # this machine's files through fsspec (FsspecStorage, not LocalStorage)
        return f"dir::file://{tmp_path / 'ck'}"
    return request.getfixturevalue("s3_url" if request.param == "s3" else "az_url")


def pytest_itemcollected(item):
    """A test that uses an object-store server carries its marker from the moment it is collected, so
    that ``-m "not s3 and not azure"`` leaves it out (marks added in ``pytest_collection_modifyitems``
    came after pytest's own selection there: the quick subset started moto and azurite)."""
    for fixture, mark in (("s3_server", pytest.mark.s3), ("azurite_server", pytest.mark.azure)):
        if fixture in getattr(item, "fixturenames", ()):
            item.add_marker(mark)


@pytest.hookimpl(trylast=True)  # after pytest's own reordering for fixtures
def pytest_collection_modifyitems(items):
    """Modules marked ``slow`` come first, each module's tests in their own order.

    scripts/test.sh runs the suite on pytest-xdist workers a module at a time, in this order
    (``--dist loadfile --no-loadscope-reorder``). The slow modules take minutes each (real training
    jobs): handed out first, they spread over the workers while the many short modules fill in the
    end; handed out last, one of them could run alone after everything else."""
    slow = {item.module.__name__ for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.module.__name__ not in slow)  # stable: the order within a module stays


@pytest.fixture
def memory_url():
    """A fresh memory:// root (the in-process filesystem is global, so names must be unique)."""
    return f"memory://ckpt-test-{uuid.uuid4().hex}"
