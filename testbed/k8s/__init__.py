"""The Kubernetes API emulator and the kubelet stand-in (see the package docstring of ``testbed``)."""
