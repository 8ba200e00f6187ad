"""The API keys the proxy accepts, re-read when their file changes: a Secret mounted as a volume is
updated in place by the kubelet (a new directory swapped in behind a symlink), so revoking a key
takes effect within a second or so of the kubelet's sync, without a restart."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)


def read_keys(path: Path) -> set[str]:
    return {line.strip() for line in path.read_text().splitlines() if line.strip()}


def bearer(authorization: str | None, accepted: set[str]) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header when it is one of ``accepted``."""
    scheme, _, token = (authorization or "").partition(" ")
    return token if scheme.lower() == "bearer" and token in accepted else None


class ApiKeys:
    def __init__(self, inline: list[str], path: Path | None, check_every_s: float = 1.0) -> None:
        self._inline, self._path, self._every = set(inline), path, check_every_s
        # Configured keys mean authentication, whatever the file holds later: a Secret emptied by
        # mistake must lock clients out, not let everyone in.
        self.required = bool(inline) or path is not None
        self._file: set[str] = read_keys(path) if path is not None else set()  # unreadable at start: an error
        self._seen = self._identity()
        self._checked = time.monotonic()

    def _identity(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self._path) if self._path is not None else None  # follows the Secret's symlinks
        except OSError:
            return None
        return None if st is None else (st.st_ino, st.st_mtime_ns, st.st_size)

    def current(self) -> set[str]:
        if self._path is not None and time.monotonic() - self._checked >= self._every:
            self._checked = time.monotonic()
            seen = self._identity()
            if seen != self._seen:
                try:
                    self._file = read_keys(self._path)
                    logger.info("API keys re-read from %s (%d keys)", self._path, len(self._file))
                except OSError as exc:
                    # Keeping the old keys beats refusing every client while the file is replaced.
                    logger.error("cannot re-read API keys from %s (%s); keeping the previous ones", self._path, exc)
                self._seen = seen
        return self._inline | self._file
