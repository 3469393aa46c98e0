"""One small client interface over both faces: Litestar's TestClient (ASGI) and a wsgiref-based caller (WSGI)."""

from __future__ import annotations

import dataclasses
import io
import json as jsonlib
import wsgiref.util
import wsgiref.validate
from typing import Any

from litestar.testing import TestClient


@dataclasses.dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> Any:
        return jsonlib.loads(self.body)


def _body_of(json: Any, content: bytes | str | None) -> bytes:
    if content is not None:
        return content.encode() if isinstance(content, str) else content
    return b"" if json is None else jsonlib.dumps(json).encode()


class Client:
    face: str

    def request(self, method: str, path: str, *, json: Any = None, content: bytes | str | None = None,
                headers: dict[str, str] | None = None) -> Reply:
        raise NotImplementedError

    def get(self, path: str, **kwargs: Any) -> Reply:
        return self.request("GET", path, **kwargs)

    def post(self, path: str, **kwargs: Any) -> Reply:
        return self.request("POST", path, **kwargs)


class AsgiClient(Client):
    face = "asgi"

    def __init__(self, client: TestClient) -> None:
        self._client = client

    def request(self, method: str, path: str, *, json: Any = None, content: bytes | str | None = None,
                headers: dict[str, str] | None = None) -> Reply:
        response = self._client.request(method, path, content=_body_of(json, content), headers=headers or {})
        return Reply(response.status_code, {k.lower(): v for k, v in response.headers.items()}, response.content)


class WsgiClient(Client):
    """Calls the WSGI app in-process through wsgiref's validator (PEP 3333 conformance is checked as a bonus)."""
    face = "wsgi"

    def __init__(self, app: Any, *, validate: bool = True) -> None:
        self.app = app
        self._app = wsgiref.validate.validator(app) if validate else app

    def request(self, method: str, path: str, *, json: Any = None, content: bytes | str | None = None,
                headers: dict[str, str] | None = None, chunked: bool = False) -> Reply:
        """`chunked`: no Content-Length; the server marks the input as terminated (wsgi.input_terminated)."""
        body = _body_of(json, content)
        environ: dict[str, Any] = {}
        wsgiref.util.setup_testing_defaults(environ)
        environ.update({
            "REQUEST_METHOD": method, "PATH_INFO": path.encode().decode("latin-1"), "QUERY_STRING": "",
            "wsgi.input": io.BytesIO(body),
            "CONTENT_LENGTH": str(len(body)),
        })
        if chunked:
            del environ["CONTENT_LENGTH"]
            environ["wsgi.input_terminated"] = True
        for name, value in (headers or {}).items():
            key = name.upper().replace("-", "_")
            environ[key if key in ("CONTENT_TYPE", "CONTENT_LENGTH") else f"HTTP_{key}"] = value
        captured: dict[str, Any] = {}

        def start_response(status: str, response_headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            captured["status"] = int(status.split(" ", 1)[0])
            captured["headers"] = {k.lower(): v for k, v in response_headers}
            return lambda data: None

        result = self._app(environ, start_response)
        try:
            data = b"".join(result)
        finally:
            if hasattr(result, "close"):
                result.close()
        return Reply(captured["status"], captured["headers"], data)
