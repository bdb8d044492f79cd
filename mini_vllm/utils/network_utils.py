"""Addresses for the processes of a run to meet at.

Mirrors upstream ``vllm/utils/network_utils.py`` at v0.22.1
(``get_distributed_init_method`` :130, ``get_open_port`` :150). Left out:
the data-parallel port reservations and ``VLLM_PORT``.
"""

from __future__ import annotations

import ipaddress
import socket


def get_distributed_init_method(ip: str, port: int) -> str:
    """``tcp://ip:port`` (brackets around an IPv6 address): where rank 0's TCP store listens."""
    try:
        is_v6 = isinstance(ipaddress.ip_address(ip), ipaddress.IPv6Address)
    except ValueError:  # a host name
        is_v6 = False
    return f"tcp://[{ip}]:{port}" if is_v6 else f"tcp://{ip}:{port}"


def get_open_port() -> int:
    """A TCP port free on this machine now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]
