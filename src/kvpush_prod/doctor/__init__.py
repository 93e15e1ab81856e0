"""``kvpush doctor``: a preflight of one host (versions, NIXL backends, UCX transports, keys,
control ports) and, with ``--peer``, of the path to a running engine."""
