"""Transports that move KV blocks between engines (NIXL), and a fault-injecting wrapper."""
