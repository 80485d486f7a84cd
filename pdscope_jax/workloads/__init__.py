"""Routing workloads for random-weight models."""
