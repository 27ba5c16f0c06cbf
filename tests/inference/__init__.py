"""Tests of transformer/inference/."""
