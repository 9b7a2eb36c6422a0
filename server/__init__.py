"""The coordinator (the one round loop) and the registered server-side strategies."""

from server import dcpfl, fedavg, fedmn, fedtrans, heterofl, local, pfedclub, pfedhr  # noqa: F401  (registers the strategies)
