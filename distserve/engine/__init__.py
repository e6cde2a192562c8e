"""The inference engine shared by prefill, decode and (later) colocated serving."""
