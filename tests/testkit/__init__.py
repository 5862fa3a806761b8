"""Helpers the tests share (imported by test modules and conftest files, never a test module)."""
