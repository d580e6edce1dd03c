"""A replica transfer's data stream (``tierckpt.node.memory.transfer``): who may take it, what it carries, and
how it fails — real sockets on 127.0.0.1, real tier files, no process group. The sender listens
(``Listener``), the receiver connects (``connect``) and says the token."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import crc32c
import pytest

from tierckpt.errors import CheckpointError
from tierckpt.node.memory import MemoryConfig, MemoryTier
from tierckpt.node.memory.manifest import FileEntry
from tierckpt.node.memory.transfer import (
    ADDRESS_ENV, TOKEN_BYTES, Listener, Offer, connect, receive_file, stream_address,
)

URI = "s3://bucket/run/step-5"
KEY = "g-00000005-1-x/data/rank-00000.bin"


@pytest.fixture
def loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ADDRESS_ENV, "127.0.0.1")


@pytest.fixture
def tier(tmp_path: Path) -> MemoryTier:
    return MemoryTier(URI, MemoryConfig(directory=str(tmp_path / "shm"), budget_bytes=1 << 30))


def source_file(tmp_path: Path, data: bytes) -> int:
    path = tmp_path / "sent.bin"
    path.write_bytes(data)
    return os.open(path, os.O_RDONLY)


def serve_in_thread(listener: Listener, fd: int, nbytes: int) -> threading.Thread:
    """The sender's side: take the connection that says the token, send the file on it."""
    def serve() -> None:
        with listener.accept("the receiver") as stream:
            stream.send_file(fd, nbytes, KEY)

    thread = threading.Thread(target=serve)
    thread.start()
    return thread


def serve_bytes_in_thread(listener: Listener, data: bytes) -> threading.Thread:
    """A sender that sends ``data`` as it is (bytes changed on the way, or a sender that dies)."""
    def serve() -> None:
        with listener.accept("the receiver") as stream:
            stream.conn.sendall(data)

    thread = threading.Thread(target=serve)
    thread.start()
    return thread


def test_only_the_connection_that_says_the_token_gets_the_file_and_it_arrives_bit_exact(
    loopback: None, tier: MemoryTier, tmp_path: Path
) -> None:
    data = os.urandom(3 * (1 << 20) + 777)
    fd = source_file(tmp_path, data)
    with Listener(timeout_s=10) as listener:
        offer = listener.offer
        assert offer.host == "127.0.0.1" and len(bytes.fromhex(offer.token)) == TOKEN_BYTES
        # Another user's processes connect first: one says a wrong token, one says nothing and leaves.
        intruder = socket.create_connection((offer.host, offer.port))
        intruder.sendall(os.urandom(TOKEN_BYTES))
        silent = socket.create_connection((offer.host, offer.port))
        silent.close()
        sender = serve_in_thread(listener, fd, len(data))
        with connect(offer, 10, "the sender") as stream:
            failure = receive_file(tier, KEY, FileEntry(len(data), crc32c.crc32c(data)), stream, memoryview(bytearray(1 << 20)))
        sender.join(10)
        intruder.settimeout(5)
        try:
            got = intruder.recv(1 << 20)
        except ConnectionResetError:
            got = b""
        assert got == b""  # closed on it: not one byte of the file
        intruder.close()
    os.close(fd)
    assert failure is None
    assert Path(tier.path_of(KEY)).read_bytes() == data


def test_a_stream_nobody_opens_fails_within_the_timeout_naming_the_source(loopback: None) -> None:
    with Listener(timeout_s=0.5) as listener:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="rank 3 did not open its data stream within the replicator's timeout of 0.5s"):
            listener.accept("rank 3")
    assert time.monotonic() - started < 5


def test_a_file_damaged_on_the_way_is_not_published_and_the_stream_stays_in_step(
    loopback: None, tier: MemoryTier, tmp_path: Path
) -> None:
    first, second = os.urandom(5000), os.urandom(4000)
    with Listener(timeout_s=10) as listener:
        sender = serve_bytes_in_thread(listener, bytes([first[0] ^ 1]) + first[1:] + second)
        scratch = memoryview(bytearray(1024))
        with connect(listener.offer, 10, "the sender") as stream:
            bad = receive_file(tier, KEY, FileEntry(len(first), crc32c.crc32c(first)), stream, scratch)
            good = receive_file(tier, KEY + ".2", FileEntry(len(second), crc32c.crc32c(second)), stream, scratch)
        sender.join(10)
    assert bad is not None and "arrived with 5000 bytes" in bad and "discarded" in bad
    assert not os.path.exists(tier.path_of(KEY))
    assert good is None and Path(tier.path_of(KEY + ".2")).read_bytes() == second
    assert not [p for p in Path(tier.root).rglob("*") if p.is_file() and ".tmp" in p.name]  # no temp file left


def test_a_stream_cut_short_fails_the_transfer_and_leaves_nothing(loopback: None, tier: MemoryTier) -> None:
    data = os.urandom(10_000)
    with Listener(timeout_s=10) as listener:
        sender = serve_bytes_in_thread(listener, data[:6000])  # the sender dies
        with connect(listener.offer, 10, "the sender") as stream, pytest.raises(ConnectionError, match="closed after 6000 of"):
            receive_file(tier, KEY, FileEntry(len(data), crc32c.crc32c(data)), stream, memoryview(bytearray(1 << 20)))
        sender.join(10)
    assert not os.path.exists(tier.path_of(KEY))
    assert not [p for p in Path(tier.root).rglob("*") if p.is_file()]


def test_a_file_shorter_than_its_sealed_size_is_an_error_on_the_sending_side(loopback: None, tmp_path: Path) -> None:
    fd = source_file(tmp_path, b"x" * 100)
    with Listener(timeout_s=10) as listener:
        with connect(listener.offer, 10, "the sender") as receiving, listener.accept("the receiver") as sending:
            with pytest.raises(CheckpointError, match=f"{KEY} is shorter than its sealed 200 bytes: 100 were sent"):
                sending.send_file(fd, 200, KEY)
            assert receiving.conn.recv(1 << 10) == b"x" * 100
    os.close(fd)


def test_an_unreachable_offer_is_an_error_that_names_where_and_the_setting(tmp_path: Path) -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]  # bound, never listening: the connection is refused
        offer = Offer("127.0.0.1", port, "00" * TOKEN_BYTES)
        with pytest.raises(CheckpointError, match=f"cannot open the data stream of rank 2 at 127.0.0.1:{port}.*{ADDRESS_ENV}"):
            connect(offer, 2, "rank 2")


def test_an_offer_that_is_not_one_is_a_clear_error() -> None:
    assert Offer.decode(Offer("10.0.0.2", 4242, "ab" * TOKEN_BYTES).encode(), "x") == Offer("10.0.0.2", 4242, "ab" * TOKEN_BYTES)
    for text in ("10.0.0.2 4242", "10.0.0.2 port " + "ab" * TOKEN_BYTES, "10.0.0.2 4242 abcd"):
        with pytest.raises(CheckpointError, match="rank 2 offered no usable data stream"):
            Offer.decode(text, "rank 2")


def test_the_address_follows_the_setting_then_gloos_interface(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ADDRESS_ENV, "10.1.2.3")
    assert stream_address() == "10.1.2.3"
    monkeypatch.delenv(ADDRESS_ENV)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo,eth9")
    assert stream_address() == "127.0.0.1"  # the first interface named, as gloo's first device
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "no-such-if0")
    with pytest.raises(CheckpointError, match=f"GLOO_SOCKET_IFNAME names 'no-such-if0'.*{ADDRESS_ENV}"):
        stream_address()
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    with socket.socket() as probe:
        probe.bind((stream_address(), 0))  # the host name's address, bindable here


def test_a_receiver_that_stops_reading_fails_the_send_within_about_one_timeout(loopback: None, tmp_path: Path) -> None:
    fd = source_file(tmp_path, os.urandom(64 << 20))  # more than the sockets' buffers hold
    with Listener(timeout_s=1.0) as listener, connect(listener.offer, 10, "the sender"):  # connects, never reads
        started = time.monotonic()
        with listener.accept("the receiver") as stream, pytest.raises(
            TimeoutError, match=f"sending {KEY}: the receiver took no byte within the replicator's timeout of 1s"
        ):
            stream.send_file(fd, 64 << 20, KEY)
        assert time.monotonic() - started < 2.5  # one wait for room, not one per pipe-full the kernel moved
    os.close(fd)


def test_a_sender_that_stops_sending_fails_the_receive_within_about_one_timeout(loopback: None, tier: MemoryTier) -> None:
    with Listener(timeout_s=1.0) as listener, connect(listener.offer, 1.0, "the sender") as stream:
        with listener.accept("the receiver") as sending:
            sending.conn.sendall(b"y" * 1000)  # then nothing more
            started = time.monotonic()
            with pytest.raises(TimeoutError, match="sent nothing within the replicator's timeout of 1s"):
                receive_file(tier, KEY, FileEntry(5000, 0), stream, memoryview(bytearray(1 << 10)))
            assert time.monotonic() - started < 3  # the part that came, then one timeout
    assert not os.path.exists(tier.path_of(KEY))


def test_an_intruder_that_connects_and_says_nothing_does_not_hold_the_transfer_off(
    loopback: None, tier: MemoryTier, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tierckpt.node.memory import transfer

    monkeypatch.setattr(transfer, "_TOKEN_WAIT_S", 0.3)
    data = os.urandom(100_000)
    fd = source_file(tmp_path, data)
    with Listener(timeout_s=10) as listener:
        holder = socket.create_connection((listener.offer.host, listener.offer.port))  # connects, stays silent
        sender = serve_in_thread(listener, fd, len(data))
        with connect(listener.offer, 10, "the sender") as stream:
            failure = receive_file(tier, KEY, FileEntry(len(data), crc32c.crc32c(data)), stream, memoryview(bytearray(1 << 16)))
        sender.join(10)
        holder.close()
    os.close(fd)
    assert failure is None and Path(tier.path_of(KEY)).read_bytes() == data


def test_a_file_the_tier_has_no_pages_for_is_drained_and_the_next_one_arrives(
    loopback: None, tier: MemoryTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where tmpfs has no room for a file's pages, populating its mapping fails (never a ``SIGBUS``): the
    file is reported, its bytes drained through the scratch buffer, and the stream goes on in step."""
    import errno

    from tierckpt.node.memory import pagepool

    first, second = os.urandom(3 << 20), os.urandom(70_000)
    refusals = iter([OSError(errno.ENOMEM, "no memory for the pages")])

    def populate(buffer: object) -> None:
        exc = next(refusals, None)
        if exc is not None:
            raise exc

    monkeypatch.setattr(pagepool, "populate_writable", populate)
    with Listener(timeout_s=10) as listener:
        sender = serve_bytes_in_thread(listener, first + second)
        scratch = memoryview(bytearray(1 << 20))
        with connect(listener.offer, 10, "the sender") as stream:
            bad = receive_file(tier, KEY, FileEntry(len(first), crc32c.crc32c(first)), stream, scratch)
            good = receive_file(tier, KEY + ".2", FileEntry(len(second), crc32c.crc32c(second)), stream, scratch)
        sender.join(10)
    assert bad == f"receiving {KEY} failed: [Errno {errno.ENOMEM}] no memory for the pages"
    assert not os.path.exists(tier.path_of(KEY))
    assert good is None and Path(tier.path_of(KEY + ".2")).read_bytes() == second


def test_the_receiver_gives_up_connecting_within_half_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A port that never answers (a firewall that drops packets) is given up on while the sender, which
    waits for the answer at most the whole timeout, still listens: the refusal reaches it."""
    from tierckpt.node.memory import transfer

    waited: list[float | None] = []

    def unanswered(address: tuple[str, int], timeout: float | None = None) -> socket.socket:
        waited.append(timeout)
        raise TimeoutError("timed out")

    monkeypatch.setattr(transfer.socket, "create_connection", unanswered)
    with pytest.raises(CheckpointError, match="cannot open the data stream of rank 4 at 10.0.0.9:4242 \\(TimeoutError"):
        connect(Offer("10.0.0.9", 4242, "00" * TOKEN_BYTES), 30.0, "rank 4")
    assert waited == [15.0]
