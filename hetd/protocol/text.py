"""Strings a peer sent, cut to a length fit for a log line, an error reply or the dashboard: a
worker may send a megabyte where a word is expected (a ``bye`` reason, an unknown message type)."""

from __future__ import annotations

SHOWN = 200  # characters of a peer's string kept (as a worker's name may have)


def clip(text: str, limit: int = SHOWN) -> str:
    """``text``, or its first ``limit - 1`` characters and an ellipsis: never over ``limit``."""
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"
