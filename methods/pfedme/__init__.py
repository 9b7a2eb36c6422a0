"""pFedMe (Dinh, Tran, Nguyen, NeurIPS 2020): personalized models regularized toward a local copy of the global model
by Moreau envelopes; the server averages the local copies."""

from fedge.config import PaperFleet

# the fleet `fedge run --strategy NAME` gets where the run's defaults cannot serve it (fedge.config.paper_fleets)
PAPER_FLEETS = {
    "pfedme": PaperFleet({"zoo": "cnn1"}, "pFedMe averages one shared architecture: every client on cnn1"),
}
