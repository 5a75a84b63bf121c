"""Test support shared by tests and benchmarks: in-memory fakes of the boto3 clients that count
every call, fleet builders, and the seeded trace generator."""
