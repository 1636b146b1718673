"""The store's options in an engine's JSON extra config (the vLLM connector's
``kv_connector_extra_config``, SGLang's ``hicache-storage-backend-extra-config``), read
alike by every integration.

Every :class:`~kvstore.options.StoreOptions` field is a key of the extra config, with
StoreOptions' default and StoreOptions' validation (once, when the config is read), so an
option added to the store reaches the engines without being restated here.  The JSON
forms: ``io_engine`` is the key of ``engine`` (a name); ``codec`` is a name of
:data:`CODECS`; ``file_mode`` an int or an octal string (``"0660"``); ``io_scheduling``
true, false or an object of :class:`~kvstore.IoSchedule` fields; ``remote`` an object of
:class:`~kvstore.remote.RemoteConfig` options.  ``namespace`` and ``allow_new_namespace``
are the integration's (:data:`INTEGRATION_SETS`).  ``who`` names the integration and
``where`` the engine setting in the errors, so an operator knows which config to fix.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from kvstore import IoSchedule
from kvstore.codecs.pipeline import CodecSpec
from kvstore.options import ENGINES, StoreOptions, check_file_mode
from kvstore.tiers.remote.config import RemoteConfig, read_hmac_key_file

__all__ = ["CODECS", "INTEGRATION_SETS", "SECRETS", "STORE_KEYS", "codec_name",
           "engine_store_defaults", "file_mode", "refuse_integration_keys", "remote_config",
           "store_open_options", "store_options"]

# Never in an engine's config: engines log their configs.
SECRETS = ("access_key_id", "secret_access_key", "session_token", "hmac_key")

CODECS: dict[str, CodecSpec | None] = {
    "raw": None, "zstd": CodecSpec(zstd=True),
    "fp8_e4m3": CodecSpec(fp8="e4m3"), "fp8_e5m2": CodecSpec(fp8="e5m2"),
    "fp8_e4m3+zstd": CodecSpec(fp8="e4m3", zstd=True),
    "fp8_e5m2+zstd": CodecSpec(fp8="e5m2", zstd=True)}
"""The codecs an extra config names (``"codec"``), and the spec each is."""

INTEGRATION_SETS = {
    "namespace": "the integration derives it from the model (the key scope)",
    "allow_new_namespace": "always true: every key is scoped to its model already",
}
"""Store options an extra config does not set, and why."""

_KEY_OF = {"engine": "io_engine"}  # store option -> its extra-config key, where they differ

STORE_KEYS = {_KEY_OF.get(f.name, f.name): f.name for f in fields(StoreOptions)
              if f.name not in INTEGRATION_SETS}
"""Extra-config key -> the StoreOptions field it sets."""


def engine_store_defaults() -> StoreOptions:
    """An engine's store options when its config gives none: an engine opens its key
    scope (model, weights, layout) as a new namespace the first time it runs."""
    return StoreOptions(allow_new_namespace=True)


def refuse_integration_keys(extra: Mapping[str, Any], who: str, where: str) -> None:
    """A store option the integration sets itself, given in ``extra``, is an error that
    says why (before the unknown-key error would list it as unknown)."""
    for key, why in INTEGRATION_SETS.items():
        if key in extra:
            raise ValueError(f"{who}: {key} is not an option of {where}: {why}")


def store_options(extra: dict[str, Any], who: str, where: str) -> StoreOptions:
    """Take the store's keys out of ``extra`` and make the store's options of them (the
    defaults: StoreOptions'); a bad value is a ``ValueError`` that starts with ``who``
    and names the key."""
    given = {STORE_KEYS[key]: extra.pop(key) for key in list(extra) if key in STORE_KEYS}
    types_ = {f.name: str(f.type) for f in fields(StoreOptions)}
    values: dict[str, Any] = {name: _value(name, types_[name], value, who, where)
                              for name, value in given.items()}
    try:
        return StoreOptions.of(allow_new_namespace=True, **values)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{who}: {e}") from None


def store_open_options(options: StoreOptions) -> dict[str, Any]:
    """Keyword arguments of ``kvstore.open`` / ``open_blocking`` for ``options``; the
    remote tier is attached once the key scope is known (``attach_remote``), so it is
    not among them."""
    return {f.name: getattr(options, f.name) for f in fields(StoreOptions)
            if f.name not in ("namespace", "remote")}


def _value(name: str, type_: str, value: object, who: str, where: str) -> object:
    """A JSON value as the StoreOptions field ``name`` takes it: the field's type (from
    its annotation) checked, the fields JSON cannot spell converted."""
    key = _KEY_OF.get(name, name)
    if name == "codec":
        if value not in CODECS:
            raise ValueError(f"{who}: codec must be one of {sorted(CODECS)}, got {value!r}")
        return CODECS[str(value)]
    if name == "engine":
        if value not in ENGINES:
            raise ValueError(f"{who}: {key} must be one of {', '.join(map(repr, ENGINES))}, "
                             f"got {value!r}")
        return value
    if name == "remote":
        return None if value is None else remote_config(value, who, where)
    if name == "file_mode":
        return None if value is None else file_mode(value, who)
    if name == "io_scheduling" and isinstance(value, Mapping):
        known = sorted(f.name for f in fields(IoSchedule))
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"{who}: unknown io_scheduling options {unknown}; known "
                             f"options are {known}")
        try:
            return IoSchedule(**value)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{who}: io_scheduling: {e}") from None
    kinds = [k.strip() for k in type_.split("|")]
    if value is None and "None" in kinds:
        return None
    # bool is an int in Python, never in JSON
    allowed = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,)}
    if any(isinstance(value, allowed.get(k, ())) and (k == "bool") == isinstance(value, bool)
           for k in kinds):
        return value
    raise ValueError(f"{who}: {key} must be {_spelled(kinds, name)}, got {value!r}")


def _spelled(kinds: list[str], name: str) -> str:
    words = {"bool": "true or false", "int": "an int", "float": "a number", "str": "a string",
             "None": "null"}
    said = [words[k] for k in kinds if k in words]
    if name == "io_scheduling":
        said.append("an object of IoSchedule options")
    return " or ".join(said) or "a value JSON cannot spell"


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
        return check_file_mode(mode)
    except ValueError as e:
        raise ValueError(f"{who}: {e}") from None


def codec_name(spec: CodecSpec | None) -> str:
    """The :data:`CODECS` name of ``spec``."""
    for name, known in CODECS.items():
        if known == spec:
            return name
    raise ValueError(f"codec {spec!r} has no name an extra config could give")

