"""Bearer-token checks shared by the daemon's HTTP routes (nothing heavier than aiohttp imported,
so the routes that answer while the daemon starts can use them)."""

from __future__ import annotations

import hmac

from aiohttp import web


def bearer_ok(request: web.Request, token: str) -> bool:
    """``Authorization: Bearer <token>`` matches (an empty configured token admits everyone);
    compared in constant time."""
    if not token:
        return True
    got = request.headers.get("Authorization", "")
    return hmac.compare_digest(got.encode(), f"Bearer {token}".encode())
