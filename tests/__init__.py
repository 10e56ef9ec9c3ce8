"""The test suite: unit/, distributed/, integration/ (tests), support/ (what they share)."""
