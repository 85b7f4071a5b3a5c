"""The test bed: what the tests and the benchmarks run against on one machine, and no product code.

- ``k8s``: the Kubernetes API emulator (a stateful kmock-based server, run as its own process with
  ``python -m testbed.k8s.emulator``) and the kubelet stand-in that runs Deployments' pods as real
  runtime processes on 127.0.0.N.
- ``cluster``: the emulator, the kubelet, the CRD and real operator processes together.
- ``promstack``: real Prometheus and Alertmanager (Debian binaries) on loopback.
"""
