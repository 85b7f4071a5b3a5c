"""
The Kubernetes API emulator test bed: ``emulator.py`` (the server, built on kmock), ``harness.py``
(``EmulatorProcess``: run it as a subprocess), ``fixtures.py`` (``k8s_emulator``,
``k8s_emulator_factory``), ``kubeconfig.py``; the kubelet stand-in lives beside it.
"""
