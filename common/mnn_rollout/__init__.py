"""mnn_rollout: the console script, the contract the runtime and the operator share, the local
demo, and the tools that run things on this machine (shared by the demo, the tests and the benches).

Importing this package imports nothing else: each subpackage pulls in only what it needs.
"""

__version__ = "0.1.0"
