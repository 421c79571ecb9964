"""What the server's routes share: the API key check and the bounded body reader (used by
`bmeg.serving.app` and the OTLP/HTTP route, `bmeg.serving.otlp_http`)."""

from __future__ import annotations

import secrets

from fastapi import HTTPException, Request
from fastapi.security import APIKeyHeader
from pydantic import SecretStr

API_KEY_HEADER = "X-API-Key"
#: Declared in the OpenAPI document; `auto_error=False` so a missing key gets our own 401.
API_KEY_SCHEME = APIKeyHeader(name=API_KEY_HEADER, auto_error=False, scheme_name="APIKey",
                              description="The server's key (BMEG_API_KEY).")


def check_api_key(key: str | None, expected: SecretStr | None) -> None:
    """401 unless `key` is the server's key (compared in constant time); no key is expected
    only when the settings say `no_auth`."""
    if expected is None:
        return
    if key is None or not secrets.compare_digest(key.encode(), expected.get_secret_value().encode()):
        raise HTTPException(401, f"this needs the API key: send it in the {API_KEY_HEADER} header",
                            headers={"WWW-Authenticate": API_KEY_HEADER})


async def read_body(request: Request, limit: int, allow_empty: bool = False) -> bytes:
    """The body as sent, refused (413) as soon as it is known to pass `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise HTTPException(413, f"body of {declared} bytes is over the limit of {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise HTTPException(413, f"body is over the limit of {limit} bytes")
    if not body and not allow_empty:
        raise HTTPException(400, "empty body: send a trace")
    return bytes(body)
