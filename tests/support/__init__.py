"""What several test packages share: harnesses, fakes and helpers (no test module imports another)."""
