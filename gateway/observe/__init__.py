"""Metrics, traces, the access log and the status page's recent activity."""
