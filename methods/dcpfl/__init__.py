"""DC-PFL (Tang et al., IJCAI 2024): own feature extractors, one shared classifier head trained on calibrated class
statistics."""

from fedge import constants as C
from fedge.config import PaperFleet

# the fleet `fedge run --strategy NAME` gets where the run's defaults cannot serve it (fedge.config.paper_fleets)
PAPER_FLEETS = {
    "dcpfl": PaperFleet(
        {"zoo": C.FEDGH_ZOO},
        "DC-PFL shares one classifier head: FedGH's five CNNs on one 500-d representation (DC-PFL §5, after FedGH)",
    )
}
