"""State paths: keys joined with '/', escaped as in JSON Pointer (RFC 6901).

`~` is written `~0` and `/` is written `~1`, so any string key round-trips.
"""


def escape_key(key) -> str:
    """Return one path segment for a dict key or list index."""
    return str(key).replace("~", "~0").replace("/", "~1")


def unescape_key(segment: str) -> str:
    """Invert `escape_key` for one segment (the result is always a str)."""
    return segment.replace("~1", "/").replace("~0", "~")


def join_path(*keys) -> str:
    """Join keys into one path, skipping empty prefixes."""
    return "/".join(escape_key(k) for k in keys if k != "")


def child_path(prefix: str, key) -> str:
    """Return the path of `key` under `prefix`."""
    return escape_key(key) if not prefix else f"{prefix}/{escape_key(key)}"


def split_path(path: str) -> list[str]:
    """Split a path into its unescaped segments."""
    return [unescape_key(s) for s in path.split("/")] if path else []


def has_prefix(path: str, prefix: str) -> bool:
    """True when `path` equals `prefix` or lies under it ('/' or a module-style '.' boundary)."""
    prefix = prefix.rstrip("/")
    return (not prefix or path == prefix or path.startswith(prefix + "/")
            or path.startswith(prefix + "."))
