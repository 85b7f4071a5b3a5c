"""Makes the emulator fixtures available to every test under tests/k8s/."""
from .fixtures import k8s_emulator, k8s_emulator_factory  # noqa: F401
