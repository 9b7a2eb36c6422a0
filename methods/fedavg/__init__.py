"""FedAvg (McMahan et al., AISTATS 2017): example-weighted averaging of one shared architecture."""

from fedge.config import PaperFleet

# the fleet `fedge run --strategy NAME` gets where the run's defaults cannot serve it (fedge.config.paper_fleets)
PAPER_FLEETS = {"fedavg": PaperFleet({"zoo": "cnn1"}, "FedAvg averages one shared architecture: every client on cnn1")}
