"""kvbroker: KV-cache handle metadata in Redis; sets up prefill -> decode UCX transfers."""
