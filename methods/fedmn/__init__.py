"""FedMN (Wang et al., ICDM 2022): a shared pool of modular blocks and a routing hypernetwork choosing each client's
blocks."""

from fedge.config import PaperFleet

# the fleet `fedge run --strategy NAME` gets where the run's defaults cannot serve it (fedge.config.paper_fleets)
PAPER_FLEETS = {
    "fedmn": PaperFleet(
        {"zoo": "fedmn_2x2x2_cnn1", "partition": "clustered", "alpha": 0.4, "label_clusters": 3},
        "FedMN trains one modular network, its Table II pool [2x2x2] on cnn1 encoders, on FedEM's clustered split "
        "(3 class groups, Dir(0.4))",
    )
}
