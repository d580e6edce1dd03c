"""Shared pytest fixtures.

Sections are kept separate so fixtures for other parts of the package can be added below.
"""
from __future__ import annotations

import os
import tempfile
import socket
import uuid
from collections.abc import Iterator

import pytest

# The node cache of remote stores goes to a fresh directory per test session (workers inherit it).
os.environ.setdefault("TIERCKPT_CACHE_DIR", tempfile.mkdtemp(prefix="tierckpt-test-cache-"))
# Loads route by the default costs unless a test asks for measured ones (the routes a test asserts stay fixed
# whatever the machine's load; tests/test_route_costs.py measures).
os.environ.setdefault("TIERCKPT_ROUTE_COSTS", "constants")


# -- storage backends ------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _reset_memory_backends() -> Iterator[None]:
    """Empty every ``memory://`` store after each test so no state leaks between tests."""
    yield
    from tierckpt.backends.memory import reset_memory_stores

    reset_memory_stores()


@pytest.fixture
def no_sweep_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sweeps of superseded generations run at once after their commit, not :data:`tierckpt.saving.cleanup.GRACE_S`
    later: for tests where no load races the sweep and ``cleanup.wait_pending()`` would only wait out the
    grace (what a sweep deletes is decided by commit sequences, never by the clock)."""
    from tierckpt.saving import cleanup

    monkeypatch.setattr(cleanup, "GRACE_S", 0.0)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def refused_endpoint() -> Iterator[str]:
    """``http://127.0.0.1:<port>`` that refuses every connection for the whole test: the port stays bound and
    never listens, so no other process can take it meanwhile. A port only found free (:func:`free_port`) may
    be taken by a gloo pair or a server before the client connects, which then waits on a listener that never
    answers instead of being refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


S3_TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": "/nonexistent/aws-config",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials",
    "NO_PROXY": "127.0.0.1,localhost",
}
"""The environment of every S3 test server: the credentials both servers accept, no AWS config, no proxy."""

S3_REQUESTS: list[tuple[str, str, str | None]] = []
"""``(method, path, Range header)`` of every request the moto server answered (see ``s3_requests``)."""


def _logged(app):
    """A WSGI middleware that appends each request to :data:`S3_REQUESTS`."""

    def wrapped(environ, start_response):
        S3_REQUESTS.append((environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""), environ.get("HTTP_RANGE")))
        return app(environ, start_response)

    return wrapped


@pytest.fixture
def s3_requests(s3_server: str, request: pytest.FixtureRequest) -> Iterator[list[tuple[str, str, str | None]]]:
    """The moto server's request log, emptied for this test (requests of every process, in order)."""
    if s3_server_kind(request) != "moto":
        pytest.skip("the request log is the moto server's")
    S3_REQUESTS.clear()
    yield S3_REQUESTS


def _atomic_conditional_puts() -> None:
    """Make moto's conditional PUTs (``If-None-Match: *``, ``If-Match``) atomic, as S3's are.

    moto checks the condition and then stores the object with nothing held between the two, and its
    threaded server runs requests at once, so two conditional PUTs arriving together could both pass
    the check. S3 itself decides a conditional write atomically, which is what tierckpt's commit relies
    on; one lock around moto's PUT handler gives the test server the same contract."""
    import threading

    from moto.s3.responses import S3Response

    put = S3Response.put_object
    if getattr(put, "atomic", False):
        return
    lock = threading.RLock()

    def atomic_put(self, *args, **kwargs):
        with lock:
            return put(self, *args, **kwargs)

    atomic_put.atomic = True
    S3Response.put_object = atomic_put


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 for the whole session; yields its endpoint URL.

    Sets fake AWS credentials and ``TIERCKPT_S3_ENDPOINT_URL`` in the environment (restored after
    the session) so ``open_backend("s3://...")`` reaches it without options, and disables the EC2
    metadata lookup so botocore never leaves 127.0.0.1.
    """
    from moto.server import ThreadedMotoServer

    _atomic_conditional_puts()
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    server._server.app = _logged(server._server.app)  # the request log of the s3_requests fixture
    with pytest.MonkeyPatch.context() as mp:
        for name, value in {**S3_TEST_ENV, "AWS_SESSION_TOKEN": "testing", "TIERCKPT_S3_ENDPOINT_URL": endpoint}.items():
            mp.setenv(name, value)
        try:
            yield endpoint
        finally:
            server.stop()


@pytest.fixture
def s3_bucket_uri(s3_server: str) -> Iterator[str]:
    """A fresh, empty bucket on the moto server; yields ``s3://<bucket>/prefix``."""
    import boto3

    bucket = f"tierckpt-{uuid.uuid4().hex[:16]}"
    client = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    client.create_bucket(Bucket=bucket)
    yield f"s3://{bucket}/prefix"
    client.close()


@pytest.fixture
def proxy(s3_server: str):
    """A fault-injecting reverse proxy in front of the moto server (``tests/fault_proxy.py``)."""
    from fault_proxy import FaultProxy

    p = FaultProxy(s3_server)
    yield p
    p.close()


@pytest.fixture
def uri(s3_server: str) -> str:
    """``s3://<fresh bucket>/ckpt`` on the moto server (modules that test other stores define their own ``uri``)."""
    import boto3

    bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1").create_bucket(Bucket=bucket)
    return f"s3://{bucket}/ckpt"


# -- multi-rank worker pool --------------------------------------------------------------------------
import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).parent))

from distributed import WorkerPool as _WorkerPool  # noqa: E402


@pytest.fixture(scope="session")
def dist_pool():
    """Four gloo worker processes, started once per session (see tests/distributed.py)."""
    pool = _WorkerPool(4)
    yield pool
    pool.close()


@pytest.fixture
def mapped_uses(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each async save through a memory tier found a spare mapped file to copy into (in order)."""
    from tierckpt.node.memory import link as link_module
    from tierckpt.node.memory import mapped

    used: list[bool] = []

    def spy(*args: object, **kwargs: object) -> object:
        writer = mapped.open_mapped(*args, **kwargs)
        used.append(writer is not None)
        return writer

    monkeypatch.setattr(link_module, "open_mapped", spy)
    return used


# -- the fast tier ---------------------------------------------------------------------------------
FAST_MODULES = frozenset({
    "test_api", "test_backends_memory", "test_cache_records", "test_cli_more", "test_concurrency", "test_convert",
    "test_hf_export", "test_import_graph", "test_layout", "test_load_planner", "test_load_wire", "test_locality",
    "test_mapped_read", "test_memory_tier", "test_metadata", "test_metadata_crc", "test_monitor", "test_read_crc_runs",
    "test_regions",
    "test_durable_wait",
    "test_replica_stream", "test_replication_wiring", "test_save_crc", "test_save_planner", "test_scheduler", "test_source_shape",
    "test_units", "test_verify", "test_writeback_runner",
})
"""Test modules whose tests run in one process with no server: ``pytest -m fast`` runs them (under a minute).

A test in one of them that takes seconds carries ``@pytest.mark.slow`` and stays out of the fast tier; the
full suite (what CI runs) runs every test whatever its marks.
"""


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests of :data:`FAST_MODULES` ``fast``, except the slow ones and any that spawn processes."""
    for item in items:
        module = item.module.__name__.rpartition(".")[2] if item.module is not None else ""
        on_radosgw = "radosgw" in getattr(getattr(item, "callspec", None), "params", {}).values()
        if module in FAST_MODULES and not on_radosgw and not any(
            item.get_closest_marker(name) for name in ("slow", "multiproc", "gpu")
        ):
            item.add_marker(pytest.mark.fast)


# -- a real S3 server beside moto: Ceph's radosgw -------------------------------------------------------
S3_SERVERS = ("moto", "radosgw")
"""The S3 servers of tests marked ``s3_servers``: moto (a mock) and radosgw (a real server, tests/radosgw.py)."""


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Tests marked ``s3_servers`` that use ``s3_server`` (directly or through ``s3_bucket_uri``, ``uri``, ...)
    run once per server of :data:`S3_SERVERS`, or of the mark's arguments (``s3_servers("radosgw")``: a slow
    test whose point is a real server's behaviour)."""
    marker = metafunc.definition.get_closest_marker("s3_servers")
    if marker and "s3_server" in metafunc.fixturenames:
        servers = marker.args or S3_SERVERS
        assert set(servers) <= set(S3_SERVERS), f"s3_servers{servers}: name servers of {S3_SERVERS}"
        metafunc.parametrize("s3_server", servers, indirect=True)


def s3_server_kind(request: pytest.FixtureRequest) -> str:
    """Which server this test's ``s3_server`` is: ``"radosgw"`` when one of the test's parameters is
    ``"radosgw"`` (the ``s3_servers`` mark's, or a fixture's own, e.g. ``params=["local", "moto", "radosgw"]``
    of a fixture that asks for ``s3_bucket_uri``), else ``"moto"``."""
    callspec = getattr(request.node, "callspec", None)
    return "radosgw" if callspec is not None and "radosgw" in callspec.params.values() else "moto"


@pytest.fixture(scope="session")
def radosgw_gateway():
    """A Ceph cluster with radosgw on 127.0.0.1 for the whole session (one per pytest worker); yields its
    :class:`radosgw.RadosGateway` (tests reach it through ``s3_server``, and stop it through ``radosgw``).

    Missing Ceph programs skip the test, except in CI (``CI=true``), where they fail it: there ``.ci/run``
    installs them, so their absence is a broken setup, not a choice."""
    from radosgw import RadosGateway, missing_programs

    missing = missing_programs()
    if missing:
        message = (f"radosgw tests need Ceph's {', '.join(missing)}: apt-get install radosgw ceph-mon ceph-osd "
                   "(Debian/Ubuntu), as .ci/run does")
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    with RadosGateway() as gateway:
        yield gateway


@pytest.fixture(scope="session")
def radosgw_server(radosgw_gateway) -> str:
    """The endpoint of this worker's radosgw (:func:`radosgw_gateway`)."""
    return radosgw_gateway.endpoint


@pytest.fixture
def radosgw(s3_server: str, request: pytest.FixtureRequest):
    """This worker's :class:`radosgw.RadosGateway`, for a test on radosgw (``s3_server`` of kind ``radosgw``) that
    stops it (``stop_gateway()``: the port refuses connections) and starts it again (``start_gateway()``: same
    port, same objects). A test that leaves it stopped gets it started after the test, so the next test of the
    worker finds it serving; the worker runs one test at a time, so no other test sees the outage."""
    if s3_server_kind(request) != "radosgw":
        pytest.fail("the radosgw fixture needs the test's s3_server to be radosgw (parametrize s3_server with "
                    "[\"radosgw\"], indirect=True)")
    gateway = request.getfixturevalue("radosgw_gateway")
    yield gateway
    if not gateway.gateway_running:
        gateway.start_gateway()


@pytest.fixture
def s3_server(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The S3 server of this test (its endpoint URL): moto, or radosgw where :func:`s3_server_kind` says so.

    The environment points ``open_backend("s3://...")`` and boto3 at it, with credentials it accepts; child
    processes started by the test inherit that."""
    if s3_server_kind(request) == "moto":
        return request.getfixturevalue("moto_server")
    endpoint = request.getfixturevalue("radosgw_server")
    for name, value in {**S3_TEST_ENV, "TIERCKPT_S3_ENDPOINT_URL": endpoint}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)  # radosgw would take it for an STS session
    return endpoint
