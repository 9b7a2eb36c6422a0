"""Test helpers shared across the test tree (importable as ``helpers`` via tests/conftest.py)."""
