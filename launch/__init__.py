"""The composition root: the `fedge` command line, the in-process simulation and the MQTT deployment wiring.

The only package that may import every other; nothing imports it. See docs/architecture.md.
"""
