"""Goodput planning: latency profiles of workers, a discrete-event simulator of the serving system, and the placement search."""
