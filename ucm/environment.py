"""The ``UCM_*`` environment variables UCM's documentation names: honoured, or refused at startup.

Honoured: ``UCM_LOG_LEVEL`` (the ``ucm`` loggers' level), ``UCM_DEBUG=true`` (the same as
``UCM_LOG_LEVEL=DEBUG``), ``UCM_LOG_FORMAT`` (a logging format string), ``UCM_LOG_FILE`` (UCM's
records go to this file instead) — any of these gives the ``ucm`` loggers a handler of their own;
without them logging stays as the host process (vLLM, a test) set it up — and
``UCM_METRICS_ENABLE``/``UCM_ENABLE_METRICS=true`` (metrics are always on). The rest configure
what lives in the connector config here and are refused with where to put it, rather than being
ignored. UCM's other variables (``UCM_STORE_HEALTH_FILE``, ...) are not these and are left alone.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from ucm.config import ConfigError

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_IN_CONFIG = "set it in the connector config (kv_connector_extra_config or ucm_config.yaml)"
REFUSED = {
    "UCM_STORAGE_BACKEND": f"the store is chosen by store.spec; {_IN_CONFIG}",
    "UCM_STORAGE_PATH": f"store directories are store.<kind>.roots; {_IN_CONFIG}",
    "UCM_IO_DIRECT": f"O_DIRECT is store.<kind>.direct_io; {_IN_CONFIG}",
    "UCM_BLOCK_SIZE": "tokens per block are vLLM's --block-size",
    "UCM_SPARSE_TYPE": f"sparse attention is sparse.algorithm (or ucm_sparse_config); {_IN_CONFIG}",
    "UCM_METRICS_PORT": "metrics are served on the vLLM server's own port, at /metrics",
    "UCM_PROFILE": "no built-in profiler; use py-spy or torch.profiler on the engine",
    "UCM_PROFILE_OUTPUT": "no built-in profiler; use py-spy or torch.profiler on the engine",
}
_HANDLER_NAME = "ucm-environment"
DEFAULT_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"


def check_environment(environ: Mapping[str, str]) -> str:
    """Refuse what the documented variables cannot mean; the ``ucm`` loggers' level they ask for
    ("" when none). Without side effects, so that a deployment's spec can be checked before an
    engine starts (the operator, ``ucm up``), not only when it does."""
    for name, why in REFUSED.items():
        if environ.get(name):
            raise ConfigError(f"{name}: not supported: {why}; unset it")
    for name in ("UCM_METRICS_ENABLE", "UCM_ENABLE_METRICS"):
        if _flag(environ, name) is False:
            raise ConfigError(f"{name}=false: not supported: metrics are always exported at /metrics; unset it")
    level = environ.get("UCM_LOG_LEVEL", "").upper()
    if level and level not in LEVELS:
        raise ConfigError(f"UCM_LOG_LEVEL: {environ['UCM_LOG_LEVEL']!r} is not one of {', '.join(LEVELS)}")
    if _flag(environ, "UCM_DEBUG"):
        if level and level != "DEBUG":
            raise ConfigError(f"UCM_DEBUG=true and UCM_LOG_LEVEL={level} disagree; set one")
        level = "DEBUG"
    if environ.get("UCM_LOG_FORMAT"):
        try:
            logging.Formatter(environ["UCM_LOG_FORMAT"], validate=True)
        except ValueError as exc:
            raise ConfigError(f"UCM_LOG_FORMAT: {exc}") from None
    return level


def apply_environment(environ: Mapping[str, str]) -> None:
    """Check the documented variables and set up the ``ucm`` loggers as they ask (idempotent)."""
    level = check_environment(environ)
    fmt, path = environ.get("UCM_LOG_FORMAT"), environ.get("UCM_LOG_FILE")
    if not (level or fmt or path):
        return  # logging stays as the host process (vLLM, a test) set it up
    root = logging.getLogger("ucm")
    root.setLevel(level or "INFO")
    try:
        handler: logging.Handler = logging.FileHandler(path) if path else logging.StreamHandler()
    except OSError as exc:
        raise ConfigError(f"UCM_LOG_FILE: cannot open {path}: {exc.strerror}") from None
    handler.setFormatter(logging.Formatter(fmt or DEFAULT_FORMAT))
    handler.set_name(_HANDLER_NAME)
    for old in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.propagate = False  # UCM's records go to this handler only, not twice


def _flag(environ: Mapping[str, str], name: str) -> bool | None:
    value = environ.get(name, "").strip().lower()
    if not value:
        return None
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise ConfigError(f"{name}: {environ[name]!r} is not true or false")
