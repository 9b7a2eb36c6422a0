"""FedProx (Li et al., MLSys 2020): FedAvg whose clients minimise their loss plus a proximal term μ/2·‖w − w^t‖² to
the global model they received."""

from fedge.config import PaperFleet

# the fleet `fedge run --strategy NAME` gets where the run's defaults cannot serve it (fedge.config.paper_fleets)
PAPER_FLEETS = {
    "fedprox": PaperFleet({"zoo": "cnn1"}, "FedProx averages one shared architecture, as FedAvg: every client on cnn1")
}
