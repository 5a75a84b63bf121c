"""Benchmarks and the in-memory AWS fakes they (and the adapter unit tests) run on."""
