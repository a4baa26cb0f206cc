"""Where an engine may read an adapter from: the checks on a catalog entry's ``source``.

A source is sent to engines as is (vLLM's ``lora_path``, Triton's weights directory), so a source is a trust
boundary: an adapter added through the admin API must not make an engine read ``/proc/self/environ``, follow
``../../etc``, or fetch from a cloud metadata address. Every source is checked the same way, from the config file or
the admin API:

- never a NUL, newline or other control character, never a ``..`` component; a path is normalised (``//``, ``/./``,
  a trailing ``/``), and the normalised form is what the catalog keeps and engines get;
- a URL (``scheme://...``) only with a scheme in ``adapter_sources.schemes`` (none by default; ``file`` never, a path
  says it better), and never to a loopback, link-local, private or otherwise non-public address, written as an IP
  or as ``localhost``;
- a path under one of ``adapter_sources.roots`` when roots are configured. The admin API, without configured roots,
  takes only paths under a directory that holds one of the config file's own adapters.
"""

from __future__ import annotations

import ipaddress
import posixpath
import re
from collections.abc import Iterable, Sequence
from urllib.parse import urlsplit

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_NOT_PUBLIC_NAMES = ("localhost", "metadata.google.internal")


class SourceRefused(ValueError):
    """Why a source is refused, in one sentence."""


def normalised(source: str) -> str:
    """The source as the catalog keeps it; ``SourceRefused`` for what no configuration allows."""
    if _CONTROL.search(source):
        raise SourceRefused("a source may not contain control characters (NUL, newline)")
    url = _URL.match(source)
    path = urlsplit(source).path if url else source
    if ".." in path.replace("\\", "/").split("/"):
        raise SourceRefused("a source may not contain a '..' component")
    if url:
        if url.group(1).lower() == "file":
            raise SourceRefused("file:// sources are refused: give the path")
        return source
    kept = posixpath.normpath(source)
    return "/" + kept.lstrip("/") if source.startswith("//") else kept  # normpath keeps a leading '//'


def check(source: str, roots: Sequence[str], schemes: Sequence[str]) -> None:
    """``source`` (normalised) is allowed under these roots and schemes, or ``SourceRefused`` says why."""
    url = _URL.match(source)
    if url:
        scheme = url.group(1).lower()
        if scheme not in {s.lower() for s in schemes}:
            allowed = ", ".join(schemes) or "none"
            raise SourceRefused(f"scheme {scheme!r} is not in adapter_sources.schemes (allowed: {allowed})")
        host = urlsplit(source).hostname or ""
        if not public_host(host):
            raise SourceRefused(f"host {host!r} is not a public address (loopback, link-local, private or local)")
        return
    if roots and not under(source, roots):
        raise SourceRefused(f"the path is not under adapter_sources.roots ({', '.join(roots)})")


def is_url(source: str) -> bool:
    return _URL.match(source) is not None


def under(path: str, roots: Iterable[str]) -> bool:
    """``path`` is one of ``roots`` or inside one (by components: /srv/lorasx is not under /srv/loras)."""
    return posixpath.isabs(path) and any(
        path == root or path.startswith(root.rstrip("/") + "/") for root in (posixpath.normpath(r) for r in roots)
    )


def directories_of(sources: Iterable[str]) -> list[str]:
    """The directories that hold these (path) sources: the admin API's roots when none are configured."""
    return sorted({posixpath.dirname(s) for s in sources if posixpath.isabs(s) and posixpath.dirname(s) != "/"})


def public_host(host: str) -> bool:
    """Not loopback, link-local, private or local, by its literal form (chat image URLs use this too)."""
    name = host.lower().rstrip(".")
    if not name or name in _NOT_PUBLIC_NAMES or name.endswith(".localhost"):
        return False
    if re.fullmatch(r"[0-9.]+|0x[0-9a-f.x]+", name) and not re.fullmatch(r"\d+\.\d+\.\d+\.\d+", name):
        return False  # an IP in another notation (2852039166, 0xa9fea9fe): no public host is written so
    try:
        address = ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return True  # a name: what it resolves to is the engine's network's business
    return address.is_global
