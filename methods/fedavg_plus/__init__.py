"""FedAvg+ (Jiang, Konečný, Rush, Kannan 2019): FedAvg, then local tuning: each client is evaluated on the global model
after fine-tuning it on its own training data."""

from fedge.config import PaperFleet

# the fleet `fedge run --strategy NAME` gets where the run's defaults cannot serve it (fedge.config.paper_fleets)
PAPER_FLEETS = {
    "fedavg+": PaperFleet({"zoo": "cnn1"}, "FedAvg+ averages one shared architecture, as FedAvg: every client on cnn1")
}
