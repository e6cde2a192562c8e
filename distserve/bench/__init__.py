"""`distserve bench`: goodput of an OpenAI-compatible endpoint under Poisson load, as DistServe defines it.

workload (lengths, arrivals, prompts) -> client (streams /v1/completions, records
timings) -> stats (percentiles, SLO attainment, goodput, results.json) -> plots.
"""
