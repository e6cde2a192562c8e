"""The four gRPC services, each runnable alone as `python -m services.<name>`."""
