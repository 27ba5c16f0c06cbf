"""Tests of transformer/cli/."""
