"""Placeholder package: built by a later issue."""
