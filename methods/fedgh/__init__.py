"""FedGH (Yi et al., ACM MM 2023): a generalized global header trained on the clients' class prototypes."""

from fedge import constants as C
from fedge.config import PaperFleet

# the fleet `fedge run --strategy NAME` gets where the run's defaults cannot serve it (fedge.config.paper_fleets)
PAPER_FLEETS = {
    "fedgh": PaperFleet(
        {"zoo": C.FEDGH_ZOO}, "FedGH shares one header: its five CNNs on one 500-d representation (FedGH §5)"
    )
}
