"""What a client's target names: one broker (`host:port`, `unix:...`) or a fleet of them (`a:1,b:2`,
`dns:///name:port`, `etcd://host:port/prefix`). Its own small module so that a command that only needs to tell the
two apart (the broker's `health`, a container's HEALTHCHECK every few seconds) imports nothing heavy."""

from __future__ import annotations

FLEET_SCHEMES = ("dns:///", "etcd://")


def is_fleet(target: str) -> bool:
    """Whether a target names several brokers (a list, a DNS name, an etcd prefix) rather than one."""
    return "," in target or target.startswith(FLEET_SCHEMES)
