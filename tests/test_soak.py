"""Soak: 4 ranks save and load 20 rounds through the node cache to S3 (moto); memory and open file
descriptors stay flat, nothing hangs, every round loads bit-exactly, the last one is durable on S3."""

import pytest

import scenarios

pytestmark = pytest.mark.multiproc

ROUNDS = 20


def test_soak_save_load_rounds(dist_pool, s3_server, s3_bucket_uri):
    options = {"endpoint_url": s3_server, "key": "testing", "secret": "testing", "region": "us-east-1"}
    per_rank = dist_pool.run(scenarios.soak, s3_bucket_uri, options, ROUNDS, timeout_s=600)
    for rank, record in enumerate(per_rank):
        rss, fds = record["rss_kib"], record["fds"]
        assert len(rss) == ROUNDS
        # In-flight uploads hold sockets and files for a moment, so single samples spike; a leak raises
        # the floor, so compare the lowest values of an early and of the last window of rounds.
        assert min(fds[-5:]) <= min(fds[2:7]) + 2, f"rank {rank}: open file descriptors grew {fds}"
        # RSS warms up (allocator arenas, caches) over the first rounds, then must stay flat.
        assert min(rss[-5:]) <= min(rss[8:13]) + 24 * 1024, f"rank {rank}: RSS grew {rss} KiB"
