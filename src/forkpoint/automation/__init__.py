"""Automation on the training step: prove a resume exact (audit)."""

from .audit import AuditReport, audit

__all__ = ["AuditReport", "audit"]
