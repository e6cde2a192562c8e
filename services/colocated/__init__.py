"""Colocated worker: prefills and decodes requests in one process, one engine (the baseline DistServe compares against).

Run with `python -m services.colocated` or `distserve-colocated`.
"""
