"""The web page's files, shipped in the package (prima/api/static) and served as they are:
no build step and nothing fetched from elsewhere, so the page works on a network with no
internet. Only the files named here are served, so no request path can reach another file."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

INDEX = "index.html"
ASSETS = {
    INDEX: "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
# The page loads its own script and style and talks only to this server.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


@dataclass(frozen=True)
class Asset:
    data: bytes
    content_type: str


def is_page_file(path: str) -> bool:
    """Whether `path` names one of the page's files (which hold no data: served without a key)."""
    return path == "/" or (path.startswith("/static/") and path.removeprefix("/static/") in ASSETS)


def asset(path: str) -> Asset | None:
    """The file for a request path (`/` is the page, `/static/<name>` its parts), None if there
    is none by that name."""
    name = INDEX if path == "/" else path.removeprefix("/static/")
    content_type = ASSETS.get(name)
    if content_type is None or (path != "/" and not path.startswith("/static/")):
        return None
    return Asset((resources.files("prima.api") / "static" / name).read_bytes(), content_type)
