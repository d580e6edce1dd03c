"""The byte-moving pieces of peer replication (:mod:`.replica`): a transfer's data stream, receiving each
file of it into the tier, and adopting a peer's ``COMMIT`` without ever replacing a newer one.

A generation's files travel on a data stream of their own, one TCP connection per transfer, beside the
replicator's control messages (header, answers, acknowledgement: :mod:`.wire`, over gloo):

* the sender listens on a fresh port of its node's address (:func:`stream_address`) and offers it, with a
  random token of :data:`TOKEN_BYTES`, in the transfer's header (:class:`Listener`, :class:`Offer`);
* the receiver, once it admitted the transfer, connects and says the token (:func:`connect`) *before* it
  answers: the sender finds the connection waiting, and each side sees the other die at once (a
  refused connection, a closed stream, a failed gloo answer), never only after a timeout;
* the sender takes the first connection that says the token (:meth:`Listener.accept`; any other is
  closed: on a node shared with other users, a process that did not read the header gets no byte) and
  sends each file with ``sendfile`` from the descriptor opened when the generation was committed: the
  kernel hands the tier's pages to the socket, no copy in user space (gloo copied them into its socket
  from a mapping, page fault by page fault);
* the receiver reads each file straight into the pages of its temp file in the tier, its CRC-32C taken
  after (:func:`receive_file`), published only if it matches the sender's manifest.

Every blocking step (accept, the token, each send and receive of up to :data:`STEP_BYTES`) is bounded by
the replicator's timeout, as its gloo steps are; a stream that fails fails the transfer (the level stays
``memory``, with the reason). The token travels in the clear over the replicator's gloo pair, as the job's
other traffic does: the stream is as private as gloo's own connections, no more.
"""

from __future__ import annotations

import fcntl
import hmac
import os
import secrets
import select
import socket
import struct
import time
from dataclasses import dataclass

from tierckpt.backends.bounded import MAX_RECORD_BYTES, read_capped
from tierckpt.backends.file_open import open_shared
from tierckpt.errors import CheckpointError
from tierckpt.native.layout import COMMIT, CommitRecord
from tierckpt.node.memory.incoming import IncomingFile
from tierckpt.node.memory.manifest import FileEntry, Manifest
from tierckpt.node.memory.memory import MemoryTier

ADDRESS_ENV = "TIERCKPT_REPLICA_ADDRESS"
"""The address a node's sender listens on for its data streams (default: the address gloo uses, see
:func:`stream_address`)."""
TOKEN_BYTES = 32
"""The length of a transfer's token, which the receiver says first on its stream."""
_TOKEN_WAIT_S = 5.0
"""How long an accepted connection may take to say its token."""
_SIOCGIFADDR = 0x8915


def stream_address() -> str:
    """The address this node's sender listens on: ``TIERCKPT_REPLICA_ADDRESS``, else the IPv4 address of
    the first interface ``GLOO_SOCKET_IFNAME`` names, else the host name's first address that can be bound
    (the rule torch's gloo devices follow, so the stream reaches wherever the replicator's gloo pair does)."""
    explicit = os.environ.get(ADDRESS_ENV, "").strip()
    if explicit:
        return explicit
    interfaces = [name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]
    if interfaces:
        return _interface_address(interfaces[0])
    for family, kind, proto, _, address in socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM):
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.bind((address[0], 0))
            return str(address[0])
        except OSError:
            continue
    return "127.0.0.1"


def _interface_address(name: str) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError as exc:
            raise CheckpointError(
                f"GLOO_SOCKET_IFNAME names {name!r}, which has no IPv4 address here ({exc}); name an interface of "
                f"this node, or set {ADDRESS_ENV} to the address replica streams should use"
            ) from exc
    return socket.inet_ntoa(answer[20:24])


@dataclass(frozen=True, slots=True)
class Offer:
    """Where a sender waits for one transfer's stream, and the token the receiver must say."""

    host: str
    port: int
    token: str
    """Hexadecimal, :data:`TOKEN_BYTES` bytes."""

    def encode(self) -> str:
        return f"{self.host} {self.port} {self.token}"

    @classmethod
    def decode(cls, text: str, source: str) -> Offer:
        try:
            host, port, token = text.split(" ")
            offer = cls(host, int(port), token)
            if len(bytes.fromhex(token)) != TOKEN_BYTES:
                raise ValueError("a token of the wrong length")
        except ValueError as exc:
            raise CheckpointError(f"{source} offered no usable data stream ({text[:200]!r}: {exc})") from exc
        return offer


class Listener:
    """A sender's socket for one transfer's stream: listening on a fresh port of :func:`stream_address`
    until :meth:`accept` took the connection that says its token, or :meth:`close`."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        host = stream_address()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._socket.bind((host, 0))
            self._socket.listen(8)
        except OSError as exc:
            self._socket.close()
            raise CheckpointError(f"cannot listen for replica streams on {host} ({exc}); set {ADDRESS_ENV} to an "
                                  f"address of this node that its peers reach") from exc
        self._token = secrets.token_bytes(TOKEN_BYTES)
        self.offer = Offer(host, self._socket.getsockname()[1], self._token.hex())

    def accept(self, source: str) -> Stream:
        """The connection that says the token, within the timeout (others are closed as they come)."""
        deadline = time.monotonic() + self._timeout_s
        while (left := deadline - time.monotonic()) > 0:
            self._socket.settimeout(left)
            try:
                conn, _ = self._socket.accept()
            except TimeoutError:
                break
            said = bytearray(TOKEN_BYTES)
            try:  # the receiver says it as soon as it connects: one that waits is not the receiver
                Stream(conn, min(left, _TOKEN_WAIT_S)).fill(memoryview(said))
            except OSError:
                said = bytearray()
            if hmac.compare_digest(bytes(said), self._token):
                return Stream(conn, self._timeout_s)
            conn.close()  # not the receiver: whoever it is, it gets nothing
        raise TimeoutError(f"{source} did not open its data stream within the replicator's timeout of "
                           f"{self._timeout_s:g}s")

    def close(self) -> None:
        self._socket.close()

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


STEP_BYTES = 8 << 20
"""The most bytes one ``recv`` of a stream asks for."""


class Stream:
    """One transfer's connected data stream; every step that waits for the peer is bounded by the
    replicator's timeout. The receiver's side blocks in the kernel (``SO_RCVTIMEO``): up to
    :data:`STEP_BYTES` arrive in one ``recv`` (``MSG_WAITALL``), where a Python-level timeout would poll and
    wake the thread (and take the GIL back) every few segments. The sender's side sends with ``sendfile``
    as far as the socket takes, and waits with ``poll`` for room (the kernel restarts a blocking
    ``sendfile``'s timer for every pipe-full it moves, so ``SO_SNDTIMEO`` would bound nothing)."""

    def __init__(self, conn: socket.socket, timeout_s: float) -> None:
        conn.settimeout(None)
        micros = max(1, int(timeout_s * 1e6))  # 0 would be no limit
        timeval = struct.pack("ll", micros // 1_000_000, micros % 1_000_000)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        self.conn, self._timeout_s = conn, timeout_s

    def send_file(self, fd: int, nbytes: int, key: str) -> None:
        """Send the first ``nbytes`` of the file open as ``fd``, with ``sendfile`` (the kernel hands the
        file's pages to the socket). A file shorter than ``nbytes`` (its sealed size) is an error; a
        receiver that takes no byte within the timeout fails the transfer."""
        self.conn.setblocking(False)
        room = select.poll()
        room.register(self.conn.fileno(), select.POLLOUT)
        sent = 0
        while sent < nbytes:
            try:
                n = os.sendfile(self.conn.fileno(), fd, sent, nbytes - sent)
            except BlockingIOError:
                if not room.poll(self._timeout_s * 1000):
                    raise TimeoutError(f"sending {key}: the receiver took no byte within the replicator's timeout "
                                       f"of {self._timeout_s:g}s ({sent} of {nbytes} bytes sent)") from None
                continue
            if n == 0:
                raise CheckpointError(f"{key} is shorter than its sealed {nbytes} bytes: {sent} were sent")
            sent += n

    def fill(self, view: memoryview) -> None:
        """Fill ``view`` from the stream; a stream that closes first, or sends nothing within the timeout
        (the kernel's ``SO_RCVTIMEO`` bounds each ``recv`` as a whole), raises."""
        got = 0
        while got < view.nbytes:
            want = min(STEP_BYTES, view.nbytes - got)
            try:
                n = self.conn.recv_into(view[got: got + want], want, socket.MSG_WAITALL)
            except BlockingIOError:
                n = -1
            if n == 0:
                raise ConnectionError(f"the data stream closed after {got} of {view.nbytes} bytes")
            if n < 0:
                raise TimeoutError(f"the data stream sent nothing within the replicator's timeout of "
                                   f"{self._timeout_s:g}s ({got} of {view.nbytes} bytes in)")
            got += n

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(offer: Offer, timeout_s: float, target: str) -> Stream:
    """The receiver's side of a stream: connected to ``offer`` within half the timeout, the token said.

    Half: the sender waits for the receiver's answer at most the timeout, so a connection that cannot be
    made (a port a firewall drops) is answered as a refusal while the sender still listens for it."""
    try:
        conn = socket.create_connection((offer.host, offer.port), timeout=timeout_s / 2)
    except OSError as exc:
        raise CheckpointError(
            f"cannot open the data stream of {target} at {offer.host}:{offer.port} ({type(exc).__name__}: {exc}); "
            f"the sending node listens on the address gloo uses there (or {ADDRESS_ENV}), which must be "
            f"reachable from this node"
        ) from exc
    try:
        conn.sendall(bytes.fromhex(offer.token))
    except OSError:
        conn.close()
        raise
    return Stream(conn, timeout_s)


def open_files(tier: MemoryTier, manifest: Manifest) -> dict[str, int]:
    """A descriptor of each file of ``manifest``, opened for reading (all or none), each holding its file's
    shared lock until it is closed (so the page pool never reuses a file being sent: :mod:`.pagepool`)."""
    files: dict[str, int] = {}
    try:
        for key, _ in manifest.files:
            files[key] = open_shared(tier.path_of(key))
    except OSError:
        for fd in files.values():
            os.close(fd)
        raise
    return files


def receive_file(tier: MemoryTier, key: str, entry: FileEntry, stream: Stream, scratch: memoryview) -> str | None:
    """Receive one file of a transfer from its stream into ``tier``, straight into the pages of its temp file
    (:meth:`~.incoming.IncomingFile.write_in_place`): why it was not published (a local failure: the rest of
    the file is drained through ``scratch``, so the stream stays in step), or ``None``. A failure of the
    stream itself raises (the transfer cannot go on)."""
    failure = None
    incoming: IncomingFile | None = None
    taken = False
    try:
        incoming = tier.receive(key, entry.size)
    except (CheckpointError, OSError) as exc:
        failure = f"cannot write {key}: {exc}"
    try:
        if incoming is not None:
            try:
                incoming.write_in_place(entry.size, stream.fill)
                taken = True
                incoming.finish(entry)
                incoming = None
            except (ConnectionError, TimeoutError):
                raise
            except (CheckpointError, OSError) as exc:
                failure = f"receiving {key} failed: {exc}"
        if not taken:  # the tier could not take it before its first byte: drain it
            for offset in range(0, entry.size, scratch.nbytes):
                stream.fill(scratch[: min(scratch.nbytes, entry.size - offset)])
    finally:
        if incoming is not None:
            incoming.abort()
    return failure


def adopt_commit(tier: MemoryTier, data: bytes) -> None:
    """Write a peer's ``COMMIT`` unless this tier holds the same or a newer one (compare-and-swap, so a
    commit of this node's own ranks racing it is never overwritten by an older record).

    Synchronous, under the same commit lock as :meth:`~.memory.MemoryTier.commit`: the receiving thread
    must not build an event loop per generation (``asyncio.run`` creates a loop and a worker thread,
    Python-level work that holds the GIL while training runs)."""
    record = CommitRecord.decode(data)
    path = tier.path_of(COMMIT)
    while True:
        try:
            current: bytes | None = read_capped(path, MAX_RECORD_BYTES)
        except FileNotFoundError:
            current = None
        if current is not None and CommitRecord.decode(current).seq >= record.seq:
            return
        if tier.commit_in_thread(COMMIT, data, current):
            return
        # someone committed meanwhile: compare again
