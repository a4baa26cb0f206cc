"""Placement: where tenants live. The traffic each gateway measures per key (gateway/observe/traffic.py), merged
across gateways through Redis (exchange.py) into the fleet's figure."""
