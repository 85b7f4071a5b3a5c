"""Kubernetes API emulator test bed (see emulator.py)."""
