"""pFedClub and pFedClub+ (NeurIPS 2024): per-client teachers reassembled from uploaded blocks (CMSR), distilled into
each client's own model."""
