"""Integration fixtures: topic producing for the data-plane tests (Spark and TMPDIR fixtures: tests/conftest.py)."""

from __future__ import annotations

from tests.integration.dataplane_fixtures import produce_topic

__all__ = ["produce_topic"]  # a fixture shared by the data-plane tests
