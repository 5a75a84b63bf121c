"""Benchmarks that print figures: sweep cost at fleet scale and savings on traces."""
