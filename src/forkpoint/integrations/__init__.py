"""Adapters for the frameworks people train with; each imports its framework only when used."""
