"""pFedHR (NeurIPS 2023): one shared pool of reassembled candidates (Alg. 1), matched to each client."""
