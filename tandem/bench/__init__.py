"""Benchmarks: throughput of the engine and outside references on real prompts."""
