"""Metric providers: one file each, one interface (base.py), one factory (factory.py)."""
