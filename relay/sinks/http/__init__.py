"""The HTTP sink: one request per row, per-destination budgets, signatures, Retry-After."""
