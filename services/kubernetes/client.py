"""A pod's own connection to the Kubernetes API: its service account's token and CA, the API
server's in-cluster address, lists read a page at a time and JSON patches. Plain HTTPS
through httpx, no Kubernetes client library: the scheduler's occupancy source and
``ringwatch kubernetes sync`` ask for a few resources, not the whole API.
"""

from __future__ import annotations

import json
import os
import ssl
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

# Where a pod finds its service account (the kubelet mounts it, or a projected volume puts it
# there: deploy/kubernetes/base/raycluster.yaml, remediation.yaml).
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
SERVICE_ACCOUNT_TOKEN = SERVICE_ACCOUNT / "token"
SERVICE_ACCOUNT_CA = SERVICE_ACCOUNT / "ca.crt"
NODES_PATH = "/api/v1/nodes"
PAGE = 500
JSON_PATCH = "application/json-patch+json"


class KubernetesError(Exception):
    """The API could not be asked, or refused; the message is one line for a person."""


class ServiceAccount:
    """Where the API server is and what to present to it. ``api_url`` (the setting
    RINGWATCH_KUBERNETES_API_URL), ``token_path`` and ``ca_path`` default to what a pod is
    given."""

    def __init__(self, api_url: str = "", *, token_path: str | Path = SERVICE_ACCOUNT_TOKEN,
                 ca_path: str | Path = SERVICE_ACCOUNT_CA,
                 environ: Mapping[str, str] = os.environ) -> None:
        self.api_url = api_url.rstrip("/")
        self.token_path = Path(token_path)
        self.ca_path = Path(ca_path)
        self.environ = environ

    def base_url(self) -> str:
        if self.api_url:
            return self.api_url
        host = self.environ.get("KUBERNETES_SERVICE_HOST")
        if not host:
            raise KubernetesError("KUBERNETES_SERVICE_HOST is not set: not in a pod (set "
                                  "RINGWATCH_KUBERNETES_API_URL)")
        port = self.environ.get("KUBERNETES_SERVICE_PORT", "443")
        return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"

    def token(self) -> str:
        """Read at each use: the kubelet rotates a projected token."""
        try:
            token = self.token_path.read_text().strip()
        except OSError as exc:
            raise KubernetesError(f"cannot read the service account token {self.token_path}: "
                                  f"{exc.strerror}") from None
        if not token:
            raise KubernetesError(f"the service account token {self.token_path} is empty")
        return token

    def verify(self, url: str) -> ssl.SSLContext | bool:
        if url.startswith("https://") and self.ca_path.exists():
            return ssl.create_default_context(cafile=str(self.ca_path))
        return True

    def open(self, timeout_s: Callable[[], float]) -> KubernetesApi:
        """A conversation with the API server, with the token as it is now; ``timeout_s``
        gives each request's timeout when it is sent (what is left of a bound). With an
        ``api_url`` given and no token file, no token is sent: ``kubectl proxy`` adds its
        user's credentials."""
        import httpx

        url = self.base_url()
        headers = {"Accept": "application/json"}
        if not self.api_url or self.token_path.exists():
            headers["Authorization"] = f"Bearer {self.token()}"
        return KubernetesApi(httpx.Client(base_url=url, headers=headers,
                                          verify=self.verify(url)), timeout_s)


class KubernetesApi:
    """One httpx client on the API server; close it (or use ``with``) when done."""

    def __init__(self, client: httpx.Client, timeout_s: Callable[[], float]) -> None:
        self.client = client
        self.timeout_s = timeout_s

    def __enter__(self) -> KubernetesApi:
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()

    def _send(self, method: str, path: str, **kw: Any) -> httpx.Response:
        import httpx

        try:
            return self.client.request(method, path, timeout=self.timeout_s(), **kw)
        except httpx.HTTPError as exc:
            raise KubernetesError(f"{method} {path}: {type(exc).__name__} "
                                  f"({self.client.base_url})") from None

    def list_items(self, path: str, params: Mapping[str, str] | None = None, *,
             accept: str | None = None, page: int = PAGE) -> Iterator[dict[str, Any]]:
        """Every item of a list, a page of ``page`` at a time (``continue``)."""
        cont = ""
        while True:
            query = {**(params or {}), "limit": str(page), **({"continue": cont} if cont else {})}
            resp = self._send("GET", path, params=query,
                              headers={"Accept": accept} if accept else None)
            if resp.status_code != 200:
                raise KubernetesError(f"GET {path} answered {resp.status_code}: "
                                      f"{status_message(resp)}")
            body = json.loads(resp.content)  # bytes as they came: no text decoding first
            yield from body.get("items") or ()
            cont = (body.get("metadata") or {}).get("continue") or ""
            if not cont:
                return

    def patch(self, path: str, ops: list[dict[str, Any]]) -> dict[str, Any]:
        """A JSON patch (RFC 6902); the object as the API server stored it. A ``test`` that
        fails (the object changed since it was read) is refused whole, nothing applied."""
        resp = self._send("PATCH", path, content=json.dumps(ops).encode(),
                          headers={"Content-Type": JSON_PATCH})
        if resp.status_code != 200:
            raise KubernetesError(f"PATCH {path} answered {resp.status_code}: "
                                  f"{status_message(resp)}")
        out: dict[str, Any] = json.loads(resp.content)
        return out


def status_message(resp: httpx.Response) -> str:
    """A Kubernetes Status object's message and its causes' (401 Unauthorized, 403 forbidden
    by RBAC, 422 a patch whose test failed)."""
    try:
        body = resp.json()
        causes = [str(c.get("message")) for c in (body.get("details") or {}).get("causes") or ()
                  if c.get("message")]
        return "; ".join([str(body.get("message") or resp.reason_phrase), *causes])[:300]
    except (ValueError, AttributeError):
        return resp.text[:200] or resp.reason_phrase
