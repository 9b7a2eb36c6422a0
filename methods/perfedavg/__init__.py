"""Per-FedAvg (Fallah, Mokhtari, Ozdaglar, NeurIPS 2020): FedAvg of a MAML objective; each client personalizes the
global model by one gradient step on its own data."""

from fedge.config import PaperFleet

# the fleet `fedge run --strategy NAME` gets where the run's defaults cannot serve it (fedge.config.paper_fleets)
PAPER_FLEETS = {
    "perfedavg": PaperFleet({"zoo": "cnn1"}, "Per-FedAvg averages one shared architecture: every client on cnn1")
}
