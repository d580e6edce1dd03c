"""A real S3 server for the tests: a one-monitor, one-OSD Ceph cluster on 127.0.0.1 with radosgw in front.

Debian's Ceph is 16.2 (pacific), whose radosgw cannot run without a cluster (no dbstore), so
:class:`RadosGateway` starts one in a private folder:

1. ``monmaptool`` + ``ceph-mon --mkfs``, then ``ceph-mon`` on a free port (``auth ... = none``);
2. ``ceph osd new`` + ``ceph-osd --mkfs`` on BlueStore in a sparse file, then ``ceph-osd``;
3. ``radosgw`` with the beast frontend on another free port (``ms mon client mode = crc``, else a
   radosgw without auth loops on ``get_initial_auth_request returned -13``);
4. ``radosgw-admin user create`` with the access and secret key the tests use.

Every daemon runs in the foreground as a child of this process and is stopped by its pid
(:meth:`RadosGateway.stop`), which also removes the folder. For outage tests, radosgw alone can be stopped
(:meth:`RadosGateway.stop_gateway`: killed, its port refuses connections) and started again
(:meth:`RadosGateway.start_gateway`: same port, same cluster, so every object written before is there). A
killed radosgw leaves its watches on the cluster's control objects, and the next radosgw's first metadata
write (a bucket creation) waits until the OSD drops them: ``osd client watch timeout = 10`` makes that about
7 s, not 28 s (the default is 30 s). Starting takes about 25 s and the cluster
holds about 1.5 GiB of memory, so the tests start one per pytest worker (a session fixture).

Run ``python tests/radosgw.py`` to start one by hand; it prints the endpoint and stops on Ctrl-C.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path

DAEMONS = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "monmaptool", "ceph")
"""The programs a cluster needs (Debian packages ``ceph-mon``, ``ceph-osd``, ``radosgw``)."""

ACCESS_KEY = "testing"
SECRET_KEY = "testing"


class RadosGatewayError(RuntimeError):
    """The cluster did not start; the message names the step and the tail of its log."""


def missing_programs() -> list[str]:
    """The programs of :data:`DAEMONS` not on ``PATH`` (empty: a cluster can start here)."""
    return [name for name in DAEMONS if shutil.which(name) is None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RadosGateway:
    """One Ceph cluster (a monitor, an OSD) and its radosgw, each a child process of this one.

    Lifecycle: ``start()`` (about 25 s), then :attr:`endpoint` serves S3 with :data:`ACCESS_KEY` and
    :data:`SECRET_KEY`; ``stop()`` ends the daemons by pid (radosgw, the OSD, the monitor) and removes the
    folder. Use it as a context manager to stop it on every path.
    """

    def __init__(self, *, start_timeout_s: float = 180.0, osd_size_bytes: int = 20 * 2**30) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="tierckpt-radosgw-"))
        self.start_timeout_s = start_timeout_s
        self.osd_size_bytes = osd_size_bytes
        self.mon_port = _free_port()
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.conf = self.folder / "ceph.conf"
        self._processes: list[subprocess.Popen[bytes]] = []
        self._gateway: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> RadosGateway:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        """Create and start the cluster and radosgw; raise :class:`RadosGatewayError` naming the step that failed."""
        try:
            self._write_conf()
            self._start_monitor()
            self._start_osd()
            self._start_gateway()
            self._create_user()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop every daemon by its pid (gateway first, monitor last) and remove the folder."""
        for process in reversed(self._processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for process in reversed(self._processes):
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._processes.clear()
        self._gateway = None
        shutil.rmtree(self.folder, ignore_errors=True)

    @property
    def gateway_running(self) -> bool:
        """Whether radosgw runs (it does between :meth:`start` and :meth:`stop`, unless :meth:`stop_gateway`)."""
        return self._gateway is not None and self._gateway.poll() is None

    def stop_gateway(self, sig: signal.Signals = signal.SIGKILL) -> None:
        """Stop radosgw alone, by its pid (SIGKILL: requests in flight are cut, as in a crash), and return once
        its port refuses connections; the monitor and the OSD keep running, so the objects stay."""
        if self._gateway is None:
            raise RadosGatewayError("stop radosgw: it is not running")
        gateway, self._gateway = self._gateway, None
        gateway.send_signal(sig)
        gateway.wait(timeout=30)
        self._processes.remove(gateway)
        deadline = time.monotonic() + 30
        while self._answers():  # a socket the dead process held may linger a moment
            if time.monotonic() > deadline:
                raise RadosGatewayError(f"stop radosgw: {self.endpoint} still answers 30 s after it exited")
            time.sleep(0.1)

    def start_gateway(self) -> None:
        """Start radosgw again after :meth:`stop_gateway`, on the same port and cluster; return once it serves."""
        if self.gateway_running:
            raise RadosGatewayError("start radosgw: it is already running")
        self._start_gateway()

    # -- steps ---------------------------------------------------------------------------------------
    def _write_conf(self) -> None:
        for sub in ("run", "log", "mon/ceph-a", "osd/ceph-0", "rgw"):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        self.fsid = str(uuid.uuid4())
        d = self.folder
        self.conf.write_text(f"""[global]
fsid = {self.fsid}
mon host = v2:127.0.0.1:{self.mon_port}
public network = 127.0.0.1/32
auth cluster required = none
auth service required = none
auth client required = none
auth supported = none
ms mon client mode = crc
run dir = {d}/run
admin socket = {d}/run/$cluster-$name.asok
log file = {d}/log/$name.log
pid file = {d}/run/$name.pid
keyring = {d}/keyring
mon data = {d}/mon/$cluster-$id
osd data = {d}/osd/$cluster-$id
osd objectstore = bluestore
bluestore block path = {d}/osd/block
bluestore block create = true
bluestore block size = {self.osd_size_bytes}
bluestore fsck on mount = false
bluestore cache autotune = false
bluestore cache size = 134217728
osd memory target = 939524096
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
osd max object name len = 256
osd max object namespace len = 64
mon allow pool size one = true
mon allow pool delete = true
mon max pg per osd = 1000
mon warn on pool no redundancy = false
mon data avail warn = 1
mon data avail crit = 0
osd client watch timeout = 10
osd op num shards = 1
osd op num threads per shard = 2
log to stderr = false
err to stderr = true
debug ms = 0

[client.rgw]
rgw frontends = beast endpoint=127.0.0.1:{self.port}
rgw data = {d}/rgw
rgw dns name = 127.0.0.1
rgw thread pool size = 64
rgw enable usage log = false
rgw lc debug interval = 10
""")

    def _run(self, step: str, *args: str, timeout_s: float = 60.0) -> str:
        """One administrative command; its stdout, or :class:`RadosGatewayError` naming ``step``."""
        try:
            done = subprocess.run(
                [*args, "-c", str(self.conf)], capture_output=True, text=True, timeout=timeout_s, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise RadosGatewayError(f"{step}: {' '.join(args)} did not finish in {timeout_s:.0f} s{self._logs()}") from exc
        if done.returncode != 0:
            raise RadosGatewayError(f"{step}: {' '.join(args)} exited {done.returncode}: "
                                    f"{done.stderr.strip()[-2000:]}{self._logs()}")
        return done.stdout

    def _daemon(self, *args: str) -> subprocess.Popen[bytes]:
        """Start a daemon in the foreground as a child of this process (stopped by pid in :meth:`stop`)."""
        log = open(self.folder / "log" / f"{args[0]}.out", "ab")  # noqa: SIM115 - the child holds it
        process = subprocess.Popen([*args, "-f", "-c", str(self.conf)], stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)
        log.close()
        self._processes.append(process)
        return process

    def _logs(self) -> str:
        """The tail of every daemon's log, for an error message."""
        tails = []
        for path in sorted((self.folder / "log").glob("*")):
            text = path.read_text(errors="replace")[-1500:]
            if text.strip():
                tails.append(f"\n--- {path.name} ---\n{text}")
        return "".join(tails)

    def _wait(self, step: str, ready: Callable[[], bool]) -> None:
        """Poll ``ready`` until it holds; :class:`RadosGatewayError` when a daemon exits or time runs out."""
        deadline = time.monotonic() + self.start_timeout_s
        while not ready():
            for process in self._processes:
                if process.poll() is not None:
                    raise RadosGatewayError(f"{step}: {process.args[0]} exited {process.returncode}{self._logs()}")
            if time.monotonic() > deadline:
                raise RadosGatewayError(f"{step}: not ready after {self.start_timeout_s:.0f} s{self._logs()}")
            time.sleep(0.25)

    def _start_monitor(self) -> None:
        monmap = self.folder / "monmap"
        self._run("create the monitor map", "monmaptool", "--create", "--fsid", self.fsid,
                  "--addv", "a", f"[v2:127.0.0.1:{self.mon_port}]", str(monmap))
        self._run("create the monitor", "ceph-mon", "--mkfs", "-i", "a", "--monmap", str(monmap))
        self._daemon("ceph-mon", "-i", "a")
        self._wait("start the monitor", lambda: self._quiet("ceph", "mon", "stat"))

    def _start_osd(self) -> None:
        osd_uuid = str(uuid.uuid4())
        osd_id = self._run("register the OSD", "ceph", "osd", "new", osd_uuid).strip()
        self._run("create the OSD", "ceph-osd", "-i", osd_id, "--mkfs", "--osd-uuid", osd_uuid, timeout_s=120)
        self._daemon("ceph-osd", "-i", osd_id)

        def up() -> bool:
            try:
                return json.loads(self._run("wait for the OSD", "ceph", "osd", "stat", "-f", "json"))["num_up_osds"] >= 1
            except (RadosGatewayError, ValueError, KeyError):
                return False

        self._wait("start the OSD", up)

    def _start_gateway(self) -> None:
        self._gateway = self._daemon("radosgw", "-n", "client.rgw")
        self._wait("start radosgw", self._answers)

    def _answers(self) -> bool:
        """Whether radosgw answers an HTTP request on :attr:`endpoint`."""
        try:
            urllib.request.urlopen(self.endpoint, timeout=2).close()
        except urllib.error.HTTPError:
            return True  # any S3 answer (403 for an anonymous list) means it serves
        except OSError:
            return False
        return True

    def _create_user(self) -> None:
        self._run("create the S3 user", "radosgw-admin", "-n", "client.rgw", "user", "create", "--uid", "tierckpt",
                  "--display-name", "tierckpt tests", "--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY)

    def _quiet(self, *args: str) -> bool:
        try:
            self._run("probe", *args, "--connect-timeout", "5", timeout_s=10)
        except RadosGatewayError:
            return False
        return True


if __name__ == "__main__":
    with RadosGateway() as gateway:
        print(f"radosgw at {gateway.endpoint} (access key {ACCESS_KEY}, secret {SECRET_KEY}); "
              f"folder {gateway.folder}; Ctrl-C stops it", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
