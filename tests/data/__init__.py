"""Tests of transformer/data/."""
