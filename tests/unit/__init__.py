"""Unit tests of single modules (the end-to-end suite beside it starts real collectors)."""
