"""Workloads, load generator, reports and simulated workers."""
