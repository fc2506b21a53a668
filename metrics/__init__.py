"""Generators and assets for Prometheus and Grafana (not part of the installed package)."""
