"""``RemoteConfig``: where the shared remote tier lives and how kvstore treats it.

Every option says what it guarantees; README.md, "Remote tier", shows a working setup.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

_AUTH_MODES = ("raise", "disable")


@dataclass(frozen=True)
class RemoteConfig:
    """An S3-compatible bucket shared by every store of a fleet (``open(remote=...)``).

    ``endpoint``   the S3 endpoint URL (``http://127.0.0.1:8333`` for a local SeaweedFS
                   gateway); None: ``AWS_ENDPOINT_URL`` from the environment, else AWS.
    ``bucket``     the bucket (it must exist: kvstore never creates or deletes buckets).
    ``prefix``     objects go under ``<prefix>/v1/<namespace digest hex>/<key hex>``
                   (FORMAT.md, "Remote objects").
    ``region``     None: ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, else ``us-east-1``.
    ``access_key_id`` / ``secret_access_key`` / ``session_token``: None (the default)
                   takes credentials the standard AWS way: the ``AWS_ACCESS_KEY_ID`` ...
                   environment variables, else the shared config and credentials files
                   (``AWS_PROFILE``; through boto3 when it is installed), else the
                   instance / web-identity providers.
    ``hmac_key``   sign every object written (HMAC-SHA256 trailer) and refuse, as a
                   counted miss, any object without a valid tag: another tenant with
                   write access to the bucket cannot inject KV.  Every store of a fleet
                   needs the same key.  None: objects are checked (CRC32C, key) but not
                   authenticated.
    ``read_deadline_s`` the most a get / match_prefix / prefetch waits for the remote
                   (waiting for a request slot included); blocks not fetched by then are
                   misses (the engine recomputes them).  Requests still unanswered then
                   are circuit-breaker failures when the read got no answer at all: on
                   a slow cluster a get pays at most this once, and only until the
                   breaker opens.  Open waits at most ``connect_timeout_s`` + this for
                   its access check.
    ``request_timeout_s`` / ``connect_timeout_s``  per S3 request.  A request a read
                   abandoned at its deadline runs on (a blocking call) and holds its
                   slot until the cluster answers or ``request_timeout_s`` ends it.
    ``concurrency`` S3 requests in flight at once (reads and uploads together), counted
                   until each request returns, abandoned ones included: never more at
                   the cluster, nor more threads in requests.  Uploads take at most
                   ``concurrency - 1`` of them (all of one when it is 1), so a read
                   always has one.
    ``upload_workers`` background uploads in flight at once.
    ``upload_queue_blocks`` blocks waiting for upload; puts beyond it are not uploaded
                   (``upload_dropped``): the queue never holds block bytes, only keys,
                   and an upload reads the block back from the local store.
    ``breaker_failures`` consecutive failed requests that open the circuit breaker:
                   then every remote call is a fast miss (no request) for
                   ``breaker_reset_s`` seconds, after which one request probes the
                   cluster and closes the breaker if it answers.
    ``on_auth_error`` ``"raise"`` (default): credentials the cluster refuses at open are
                   a :class:`~kvstore.errors.RemoteAuthError`; ``"disable"``: the store
                   opens with the remote tier disabled and says why in its stats.
    ``close_drain_s`` at close, wait up to this long for queued uploads to finish;
                   the rest are dropped (counted).
    """

    bucket: str
    endpoint: str | None = None
    prefix: str = "kvstore"
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None
    session_token: str | None = None
    hmac_key: bytes | None = None
    read_deadline_s: float = 2.0
    request_timeout_s: float = 10.0
    connect_timeout_s: float = 1.0
    concurrency: int = 16
    upload_workers: int = 4
    upload_queue_blocks: int = 4096
    breaker_failures: int = 3
    breaker_reset_s: float = 5.0
    on_auth_error: Literal["raise", "disable"] = "raise"
    close_drain_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.bucket or "/" in self.bucket:
            raise ValueError(f"RemoteConfig.bucket must be a bucket name, got {self.bucket!r}")
        if self.prefix != self.prefix.strip("/") or not self.prefix:
            raise ValueError(f"RemoteConfig.prefix must be non-empty without leading or "
                             f"trailing '/', got {self.prefix!r}")
        if self.hmac_key is not None and len(self.hmac_key) < 16:
            raise ValueError("RemoteConfig.hmac_key must be at least 16 bytes (use 32 random "
                             "bytes, the same on every store of the fleet)")
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ValueError("give both access_key_id and secret_access_key, or neither "
                             "(then the standard AWS environment/config is used)")
        for name in ("read_deadline_s", "request_timeout_s", "connect_timeout_s",
                     "breaker_reset_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RemoteConfig.{name} must be > 0, got {getattr(self, name)}")
        for name in ("concurrency", "upload_workers", "upload_queue_blocks",
                     "breaker_failures"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"RemoteConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.close_drain_s < 0:
            raise ValueError(f"RemoteConfig.close_drain_s must be >= 0, got {self.close_drain_s}")
        if self.on_auth_error not in _AUTH_MODES:
            raise ValueError(f"RemoteConfig.on_auth_error must be one of {_AUTH_MODES}, "
                             f"got {self.on_auth_error!r}")

    def __repr__(self) -> str:  # never print secrets
        return (f"RemoteConfig(bucket={self.bucket!r}, endpoint={self.endpoint!r}, "
                f"prefix={self.prefix!r}, signed={self.hmac_key is not None})")


HMAC_KEY_FILE_BYTES = 4096
"""The most a key file may hold: a key is tens of bytes, and a path to /dev/zero, a log
or a disk image must not be read whole into memory (a pipe, as ``<(...)`` gives, is fine)."""


def read_hmac_key_file(path: str) -> bytes:
    """The HMAC key in a file (surrounding whitespace removed): how the CLI and the vLLM
    connector take it, so that it is never written into a command line or a config
    that gets logged.  At most :data:`HMAC_KEY_FILE_BYTES` are read; more is refused."""
    try:
        with open(path, "rb") as f:
            key = f.read(HMAC_KEY_FILE_BYTES + 1)
    except OSError as e:
        raise ValueError(f"cannot read the HMAC key file {path!r}: {e.strerror}") from None
    if len(key) > HMAC_KEY_FILE_BYTES:
        raise ValueError(f"the HMAC key file {path!r} holds more than {HMAC_KEY_FILE_BYTES} "
                         "bytes: not a key file (a key is 32 random bytes)")
    return key.strip()
