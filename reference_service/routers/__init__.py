"""HTTP routers, one per concern: the MRC endpoints and the health/metrics endpoints."""
