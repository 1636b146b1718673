"""Option values an engine's JSON extra config gives every integration alike (the vLLM
connector's ``kv_connector_extra_config``, SGLang's ``hicache-storage-backend-extra-config``):
the remote tier's options and a file mode.  ``who`` names the integration and ``where``
the engine setting in the errors, so an operator knows which config to fix.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import fields

from kvstore import permissions
from kvstore.remote.config import RemoteConfig, read_hmac_key_file

__all__ = ["SECRETS", "file_mode", "remote_config"]

# Never in an engine's config: engines log their configs.
SECRETS = ("access_key_id", "secret_access_key", "session_token", "hmac_key")


def remote_config(value: object, who: str, where: str) -> RemoteConfig:
    """The remote tier's options as a validated :class:`RemoteConfig`; credentials come
    from the AWS environment, the HMAC key from ``hmac_key_file``."""
    if not isinstance(value, Mapping):
        raise ValueError(f'{who}: remote must be an object of remote-tier options, e.g. '
                         f'{{"bucket": "kv", "endpoint": "http://host:8333"}}, got {value!r}')
    options = dict(value)
    secret = [k for k in SECRETS if k in options]
    if secret:
        raise ValueError(f"{who}: remote.{secret[0]} does not belong in {where} (the "
                         "engine logs it): credentials come from the AWS environment "
                         "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE), the HMAC "
                         "key from remote.hmac_key_file")
    known = {f.name for f in fields(RemoteConfig)} - set(SECRETS) | {"hmac_key_file"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"{who}: unknown remote options {unknown}; known options are "
                         f"{sorted(known)}")
    try:
        key_file = options.pop("hmac_key_file", None)
        if key_file is not None:
            options["hmac_key"] = read_hmac_key_file(os.fspath(key_file))
        return RemoteConfig(**options)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{who}: remote: {e}") from None


def file_mode(value: object, who: str) -> int:
    """An int, or an octal string as JSON configs spell modes ("0660", "0o660")."""
    mode = value
    if isinstance(value, str):
        try:
            mode = int(value.removeprefix("0o"), 8)
        except ValueError:
            mode = value
    try:
        return permissions.check_file_mode(mode)
    except ValueError as e:
        raise ValueError(f"{who}: {e}") from None
