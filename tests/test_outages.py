"""A service that answered nothing through a whole retry sequence is tried once per call until it
answers (:mod:`tierckpt.io.outages`), against the moto server behind the fault proxy: requests counted
at the proxy, the mark lifted by an answer — a success or a definite "not found" — and kept per service."""

from __future__ import annotations

import time
import uuid

import pytest

from tierckpt.errors import CheckpointNotFoundError, TransientStorageError
from tierckpt.io.outages import Outages
from tierckpt.io.scheduler import get_scheduler
from tierckpt.store import open_store

from fault_proxy import FaultProxy, Rule  # noqa: E402


@pytest.fixture
def bucket(s3_server: str) -> str:
    import boto3

    name = f"outage-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1").create_bucket(Bucket=name)
    return name


def store_at(bucket: str, prefix: str, endpoint: str):
    return open_store(f"s3://{bucket}/{prefix}", {"endpoint_url": endpoint, "cache": False})


def requests_for(proxy: FaultProxy, call) -> tuple[int, BaseException | None]:
    """How many requests ``call()`` made through the proxy, and what it raised."""
    proxy.reset_counters()
    try:
        get_scheduler().run(call())
        raised = None
    except Exception as exc:  # noqa: BLE001 - returned to the test
        raised = exc
    return proxy.requests, raised


def test_calls_to_a_service_that_answered_nothing_try_once_until_it_answers(
    proxy: FaultProxy, bucket: str, s3_server: str,
) -> None:
    one = store_at(bucket, "run/step-1", proxy.endpoint)
    other = store_at(bucket, "run/step-2", proxy.endpoint)  # another checkpoint of the same bucket
    get_scheduler().run(one.put("x", b"hello"))
    proxy.add_rule(Rule("503", count=None))  # the service is down

    n, raised = requests_for(proxy, lambda: one.get("x"))
    assert isinstance(raised, TransientStorageError) and n == 5, "the first call retries in full"
    for store in (one, other):
        n, raised = requests_for(proxy, lambda: store.get("x"))
        assert isinstance(raised, TransientStorageError) and n == 1, "later calls to the service try once"

    # The same bucket on another endpoint is another service: it is not marked.
    direct = store_at(bucket, "run/step-1", s3_server)
    assert get_scheduler().run(direct.get("x")) == b"hello"

    proxy.clear()  # the service is back: the first answer lifts the mark
    n, raised = requests_for(proxy, lambda: other.get("missing"))
    assert isinstance(raised, CheckpointNotFoundError) and n == 1, "a definite answer: the service is up"
    proxy.add_rule(Rule("503", count=2))  # a blip: two failures, then answers
    n, raised = requests_for(proxy, lambda: one.get("x"))
    assert raised is None and n == 3, "after an answer, calls retry in full again"


def test_a_call_without_retries_does_not_mark_its_service() -> None:
    outages = Outages()
    outages.exhausted("s3://b at e", 1, "one attempt asked for")
    assert outages.attempts("s3://b at e", 5) == 5
    outages.exhausted("s3://b at e", 5, "503 five times")
    assert outages.attempts("s3://b at e", 5) == 1 and outages.attempts("s3://c at e", 5) == 5
    assert outages.attempts(None, 5) == 5, "a call that names no service is never limited"
    outages.answered("s3://b at e")
    assert outages.attempts("s3://b at e", 5) == 5


def test_a_mark_lasts_its_hold_then_a_call_retries_in_full_again() -> None:
    outages = Outages(hold_s=0.2)
    outages.exhausted("s3://b at e", 5, "503 five times")
    assert outages.attempts("s3://b at e", 5) == 1
    time.sleep(0.25)
    assert outages.attempts("s3://b at e", 5) == 5, "a stale mark does not limit calls"
    outages.exhausted("s3://b at e", 5, "still 503")  # the full sequence failed again: marked anew
    assert outages.attempts("s3://b at e", 5) == 1

