"""FedTrans (Zhu, Liu, Chowdhury, Lai, MLSys 2024): one small model grows by function-preserving transformations;
clients get the models their devices can run."""

from fedge.config import PaperFleet

# the fleet `fedge run --strategy NAME` gets where the run's defaults cannot serve it (fedge.config.paper_fleets)
PAPER_FLEETS = {
    "fedtrans": PaperFleet(
        {"zoo": "cnn1,cnn3", "profiles": ("rpi-zero-2w", "rpi-4")},
        "FedTrans grows models for capacities over 29x apart (§5.1): Pi Zero 2 W (9.2 M MACs) and Pi 4 (290 M), "
        "31.5x, in turn, each registering a model it runs (cnn1, cnn3)",
    )
}
