"""HeteroFL (Diao, Ding, Tarokh, ICLR 2021): width slices of one global model, averaged where they overlap."""

from fedge.config import PaperFleet

# the fleet `fedge run --strategy NAME` gets where the run's defaults cannot serve it (fedge.config.paper_fleets)
PAPER_FLEETS = {
    "heterofl": PaperFleet(
        {"zoo": "cnn1,cnn3", "profiles": ("rpi-zero-2w", "rpi-4")},
        "HeteroFL cuts width slices for capacities far apart (FedTrans's comparison, over 29x): Pi Zero 2 W "
        "(9.2 M MACs) and Pi 4 (290 M) in turn, each registering a model it runs (cnn1, cnn3)",
    )
}
