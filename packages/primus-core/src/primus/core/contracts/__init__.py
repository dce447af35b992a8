"""What plugins and core agree on, imported by every room and importing none: the hookspecs, the protocols
(backend, strategy, kernel provider), the plugin host, core's error types, the patch table."""
