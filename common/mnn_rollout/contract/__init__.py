"""What the runtime and the operator share, importing neither of them.

- ``config``: the runtime config (versions, weights, routing, server limits) that the operator
  writes into the ``<name>-routing`` ConfigMap and the runtime serves; the version checks both
  sides apply; the ConfigMap key.
- ``routing``: user key -> bucket -> version (the routing contract).

Only the standard library, pydantic and PyYAML are imported here.
"""
