"""Tests that need no ranks, launcher or model hub: one process (test_layering also imports every
module afresh in one child interpreter)."""
