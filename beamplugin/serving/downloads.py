"""Translated files kept for download (``POST /translate_file`` answers with their URL): each
under a random id in a temporary directory of the server's, for ``lifetime`` seconds (10
minutes by default), and at most ``most`` of them (the oldest go first), so that a busy server
does not fill its disk; the directory goes when the server exits."""

from __future__ import annotations

import secrets
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

CONTENT_TYPES = {".txt": "text/plain", ".html": "text/html", ".htm": "text/html",
                 ".srt": "application/x-subrip",
                 ".docx": "application/vnd.openxmlformats-officedocument.wordprocessingml.document",
                 ".odt": "application/vnd.oasis.opendocument.text"}  # fmt: skip
BINARY = (".docx", ".odt")  # no charset in their content type


class Downloads:
    def __init__(
        self, lifetime: float = 600.0, most: int = 100, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.lifetime, self.most, self.clock = lifetime, most, clock
        # removed when the server exits (the object's finalizer), or when it is collected
        self._directory = tempfile.TemporaryDirectory(prefix="beamplugin-files-")
        self._kept: dict[str, tuple[float, str]] = {}  # id -> (when kept, file name), oldest first

    def keep(self, name: str, data: bytes) -> str:
        """``data`` kept as ``name``; its id (random: only who was given it can fetch it)."""
        self._expire()
        while len(self._kept) >= self.most:
            self._remove(next(iter(self._kept)))
        key = secrets.token_urlsafe(16)
        (Path(self._directory.name) / key).write_bytes(data)
        self._kept[key] = (self.clock(), name)
        return key

    def fetch(self, key: str, name: str) -> bytes | None:
        """The file kept under ``key`` as ``name``; None if there is none (or it expired)."""
        self._expire()
        if self._kept.get(key, (0.0, None))[1] != name:
            return None
        return (Path(self._directory.name) / key).read_bytes()

    def _expire(self) -> None:
        now = self.clock()
        for key in [k for k, (kept, _) in self._kept.items() if now - kept >= self.lifetime]:
            self._remove(key)

    def _remove(self, key: str) -> None:
        del self._kept[key]
        (Path(self._directory.name) / key).unlink(missing_ok=True)


def download_headers(name: str) -> dict[str, str]:
    """The headers of a kept file's download: its content type (by its extension, one that
    ``POST /translate_file`` takes) and its name to save it as."""
    extension = "." + name.rpartition(".")[2].lower()
    return {
        "Content-Type": CONTENT_TYPES[extension]
        + ("" if extension in BINARY else "; charset=utf-8"),
        "Content-Disposition": f'attachment; filename="{name}"',
    }
