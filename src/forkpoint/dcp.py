"""`forkpoint.dcp.Writer` / `forkpoint.dcp.Reader`: DCP storage backends over forkpoint
versions (torch is imported when one of them is first used)."""


def __getattr__(name: str):
    from .integrations import dcp

    return getattr(dcp, name)
