"""
The kubelet stand-in's (see ``kubelet.py``) client of the Kubernetes API emulator.
"""
import http.client
import json
import urllib.parse
from typing import Any


class ApiError(Exception):
    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f'{status}: {body}')
        self.status = status


class Api:
    """Plain HTTP/JSON to the emulator (no kubernetes client: nothing global, nothing to configure)."""

    def __init__(self, url: str, timeout: float = 5.0) -> None:
        parsed = urllib.parse.urlparse(url)
        self.host, self.port, self.timeout = parsed.hostname or '127.0.0.1', parsed.port or 80, timeout

    def call(self, method: str, path: str, body: Any = None, query: dict[str, str] | None = None,
             content_type: str = 'application/json', ok: tuple[int, ...] = (200, 201, 202)) -> Any:
        if query:
            path += '?' + urllib.parse.urlencode(query)
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, path, body=data, headers={'Content-Type': content_type, 'Accept': 'application/json'})
            rsp = conn.getresponse()
            raw = rsp.read()
        finally:
            conn.close()
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = raw.decode(errors='replace')
        if rsp.status not in ok:
            raise ApiError(rsp.status, parsed)
        return parsed

    def get_or_none(self, path: str) -> Any:
        try:
            return self.call('GET', path)
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def merge_patch(self, path: str, body: Any) -> Any:
        return self.call('PATCH', path, body, content_type='application/merge-patch+json')
