"""fedge's own methods, one package each (its options, server half, client half, task configs, own layers and math,
and a README naming the paper's equations), registered through the `fedge.methods` entry points of pyproject.toml
(fedge.plugins). `reassembly` is no method: it holds what pFedClub and pFedHR share."""
