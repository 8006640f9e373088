"""Where a webhook may point: public http(s) addresses only, unless an operator allows a network.

Checked when a webhook is created or changed, and again at every delivery after DNS:
the delivery then connects to the very address that was checked (``CheckedUrl.pinned``),
so a name that re-resolves to an internal address in between cannot redirect it.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import httpx

from ringwatch.services.errors import RingwatchError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# Private networks (RFC 1918, unique-local fc00::/7) and the shared address space of
# carrier-grade NAT (RFC 6598), which the ipaddress module calls neither private nor global.
PRIVATE = tuple(ipaddress.ip_network(n) for n in (
    "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "fc00::/7"))
# NAT64's well-known prefix (RFC 6052): a gateway translates it to the IPv4 address inside.
NAT64 = ipaddress.ip_network("64:ff9b::/96")


class UrlRefused(RingwatchError):
    """A webhook URL the policy does not allow; ``reason`` says why, without the URL's secrets."""

    status_code = 422
    code = "url_refused"

    def __init__(self, reason: str) -> None:
        super().__init__(f"webhook URL refused: {reason}")
        self.reason = reason


class HostUnresolved(UrlRefused):
    """The host has no address now: refused at registration, retried at delivery."""


@dataclass(frozen=True)
class CheckedUrl:
    url: httpx.URL
    addresses: tuple[IPAddress, ...]

    def pinned(self, address: IPAddress) -> tuple[httpx.URL, dict[str, str], dict[str, str]]:
        """The request URL aimed at ``address``, with the Host header and TLS server name
        (SNI, and the name the certificate is checked against) of the original URL."""
        host = self.url.raw_host.decode("ascii")
        extensions = {"sni_hostname": host} if self.url.scheme == "https" else {}
        return (self.url.copy_with(host=str(address)),
                {"Host": self.url.netloc.decode("ascii")}, extensions)


def parse_networks(values: Iterable[str | IPNetwork]) -> list[IPNetwork]:
    return [v if not isinstance(v, str) else ipaddress.ip_network(v.strip(), strict=False)
            for v in values]


def check_url(url: str, allowed_networks: Sequence[str | IPNetwork]) -> None:
    """Raise ``UrlRefused`` unless every address of ``url``'s host may be reached."""
    resolve(url, allowed_networks)


def resolve(url: str, allowed_networks: Sequence[str | IPNetwork]) -> CheckedUrl:
    """Parse ``url``, resolve its host once and check every address it gave."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError) as exc:
        raise UrlRefused(f"not a valid URL ({exc})") from None
    if parsed.scheme not in ("http", "https"):
        raise UrlRefused(f"scheme {parsed.scheme!r} is not http or https")
    if not parsed.host:
        raise UrlRefused("the URL has no host")
    addresses = _addresses(parsed.raw_host.decode("ascii"), parsed.port or _default_port(parsed))
    allowed = parse_networks(allowed_networks)
    for address in addresses:
        reason = refusal(address, allowed)
        if reason:
            shown = parsed.host if _is_literal(parsed.host) else f"{parsed.host} resolves to {address}, which"
            raise UrlRefused(f"{shown} is {reason}; allow its network in "
                             "RINGWATCH_WEBHOOK_ALLOWED_NETWORKS to deliver there")
    return CheckedUrl(parsed, addresses)


def refusal(address: IPAddress, allowed: Sequence[IPNetwork]) -> str | None:
    """Why ``address`` may not be reached (None: it may)."""
    if any(address in net for net in allowed):
        return None
    embedded = _embedded_ipv4(address)
    if embedded is not None:
        inner = refusal(embedded, allowed)
        return f"an IPv6 form of {embedded}, {inner}" if inner else None
    for kind, test in _KINDS:
        if test(address):
            return kind
    return None


_KINDS = (
    ("a loopback address", lambda a: a.is_loopback),
    ("a link-local address", lambda a: a.is_link_local),
    ("an unspecified address", lambda a: a.is_unspecified),
    ("a multicast address", lambda a: a.is_multicast),
    ("a reserved address", lambda a: a.is_reserved),
    ("a private address", lambda a: any(a in net for net in PRIVATE)),
    # What is left and not global: documentation, benchmarking, protocol assignments.
    ("not a public address", lambda a: not a.is_global),
)


def _embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address inside an IPv4-mapped, NAT64, 6to4 or Teredo IPv6 address."""
    if not isinstance(address, ipaddress.IPv6Address):
        return None
    if address in NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    return None


def _is_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _default_port(url: httpx.URL) -> int:
    return 443 if url.scheme == "https" else 80


def _addresses(host: str, port: int) -> tuple[IPAddress, ...]:
    """Every address the host has: the literal itself, or all that DNS gives (in its order)."""
    try:
        return (ipaddress.ip_address(host),)
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise HostUnresolved(f"{host} does not resolve ({exc})") from None
    found: dict[IPAddress, None] = {}
    for *_, sockaddr in infos:
        found[ipaddress.ip_address(str(sockaddr[0]).split("%")[0])] = None
    if not found:
        raise HostUnresolved(f"{host} has no address")
    return tuple(found)
