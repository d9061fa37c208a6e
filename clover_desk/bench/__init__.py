"""``clover-desk bench SUITE``: benchmarks that print figures."""
