"""Automation on the training step: prove a resume exact (audit), find the state (discover)."""

from .audit import AuditReport, audit
from .discover import Discovery, DiscoveryError, discover

__all__ = ["AuditReport", "audit", "Discovery", "DiscoveryError", "discover"]
