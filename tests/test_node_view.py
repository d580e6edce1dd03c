"""A write-back commit's check against the node's view (``node/nodeview.py``), through the node cache: while
the remote answers no read, a first commit (``expected=None``) is accepted on the node and a commit that
expects bytes is not; once the node holds a pending commit, that is the view a later commit is checked against."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tierckpt.backends import LocalBackend
from tierckpt.errors import CheckpointBusyError, TransientStorageError
from tierckpt.native.layout import COMMIT, CommitRecord, new_generation
from tierckpt.node.disk import CacheConfig
from tierckpt.store import node_cache_over


class _Outage(LocalBackend):
    """A local remote that answers no read or commit of ``COMMIT`` (an outage, as a remote that refuses
    connections); its other keys stay reachable."""

    def _answer(self, key: str) -> None:
        if key == COMMIT:
            raise TransientStorageError(f"{self.uri_of(key)}: the remote does not answer")

    async def get(self, key: str) -> bytes:
        self._answer(key)
        return await super().get(key)

    async def get_capped(self, key: str, limit: int) -> bytes:
        self._answer(key)
        return await super().get_capped(key, limit)

    async def commit(self, key: str, data: bytes | memoryview, **kwargs: Any) -> None:
        self._answer(key)
        await super().commit(key, data, **kwargs)


def _record(step: int) -> bytes:
    return CommitRecord(new_generation(step), 1.0, step).encode()


async def test_a_first_commit_is_accepted_on_the_node_while_the_remote_is_down(tmp_path: Path) -> None:
    store = node_cache_over(_Outage(str(tmp_path / "remote")), CacheConfig(directory=str(tmp_path / "cache"),
                                                                           poll_s=0.01, exit_wait_s=0))
    try:
        with pytest.raises(TransientStorageError, match="does not answer"):  # it expects what it cannot see
            await store.commit(COMMIT, _record(1), expected=b"a commit read before", after={})
        assert store.catalog.pending(store.rh, COMMIT) is None
        first = _record(1)
        await store.commit(COMMIT, first, expected=None, after={})  # a URI this node never saw: the upload decides
        assert await store.written.get(COMMIT) == first and store.catalog.pending(store.rh, COMMIT) is not None
        with pytest.raises(CheckpointBusyError, match="refused"):  # the node's view is its pending commit now
            await store.commit(COMMIT, _record(2), expected=None, after={})
        second = _record(2)
        await store.commit(COMMIT, second, expected=first, after={})
        assert await store.written.get(COMMIT) == second
    finally:
        await store.drop_pending()  # its uploads would retry for as long as the process runs
