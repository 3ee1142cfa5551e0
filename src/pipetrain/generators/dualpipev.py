"""Placeholder: being written (see generators/__init__.py)."""
