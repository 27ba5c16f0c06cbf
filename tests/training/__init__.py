"""Tests of transformer/training/."""
