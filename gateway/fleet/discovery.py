"""Replicas from DNS (a pool's ``discovery``): resolve, and keep re-resolving; the caller rebuilds the fleet when
the answer changes, exactly as on a config reload (gateway/reload.py), so tenants move as they would then."""

from __future__ import annotations

import logging

import dns.asyncresolver
import dns.exception
import dns.rdatatype
import dns.resolver

from gateway.config import DiscoveryConfig, GatewayConfig, ReplicaConfig

log = logging.getLogger(__name__)

Discovered = dict[str, list[ReplicaConfig]]


# The system's resolver configuration: its search list makes a relative name ("_http._tcp.vllm") resolve in the
# pod's own namespace, as the system resolver does for the Redis host name, so no manifest names a namespace.
RESOLV_CONF = "/etc/resolv.conf"


def _resolver(config: DiscoveryConfig) -> dns.asyncresolver.Resolver:
    try:
        resolver = dns.asyncresolver.Resolver(filename=RESOLV_CONF)
    except (OSError, dns.resolver.NoResolverConfiguration):
        resolver = dns.asyncresolver.Resolver(configure=False)  # no file: absolute names only
    if config.nameservers:  # they replace the system's servers; its search list still applies
        hosts, ports = [], set()
        for server in config.nameservers:
            host, _, port = server.partition(":")
            hosts.append(host)
            ports.add(int(port or 53))
        resolver.nameservers = hosts
        resolver.port = ports.pop() if len(ports) == 1 else 53
    resolver.lifetime = 2.0
    return resolver


async def resolve(config: DiscoveryConfig) -> list[ReplicaConfig]:
    """The replicas DNS names now, sorted by id; raises ``dns.exception.DNSException`` when it cannot say."""
    resolver = _resolver(config)
    replicas: dict[str, ReplicaConfig] = {}
    if config.record == "SRV":
        answer = await resolver.resolve(config.name, dns.rdatatype.SRV, search=True)
        for record in answer:
            target = record.target.to_text().rstrip(".")
            addresses = await resolver.resolve(target, dns.rdatatype.A)
            replica_id = target.split(".", 1)[0]
            url = f"http://{addresses[0].to_text()}:{record.port}"
            replicas[replica_id] = ReplicaConfig.model_validate({"id": replica_id, "url": url})
    else:
        for record in await resolver.resolve(config.name, dns.rdatatype.A, search=True):
            address = record.to_text()
            replicas[address] = ReplicaConfig.model_validate({"id": address, "url": f"http://{address}:{config.port}"})
    return [replicas[key] for key in sorted(replicas)]


async def discover(config: GatewayConfig, known: Discovered) -> Discovered:
    """Every discovery pool's replicas now; a pool whose lookup fails keeps what was known (an outage of DNS is
    not an outage of the fleet)."""
    found: Discovered = {}
    for pool in config.pools:
        if pool.discovery is None:
            continue
        try:
            found[pool.name] = await resolve(pool.discovery)
        except dns.exception.DNSException as exc:
            log.warning("discovery for pool %s failed (%s); keeping the replicas known", pool.name, exc)
            found[pool.name] = known.get(pool.name, list(pool.replicas))
    return found


def with_replicas(config: GatewayConfig, discovered: Discovered) -> GatewayConfig:
    """``config`` with each discovery pool's replicas replaced by what was found."""
    if not discovered:
        return config
    pools = [
        {**pool.model_dump(), "replicas": [r.model_dump() for r in discovered[pool.name]]}
        if pool.name in discovered
        else pool.model_dump()
        for pool in config.pools
    ]
    return GatewayConfig.model_validate({**config.model_dump(), "pools": pools})


def interval_s(config: GatewayConfig) -> float | None:
    intervals = [pool.discovery.interval_s for pool in config.pools if pool.discovery is not None]
    return min(intervals) if intervals else None
